"""``nitro experiment``: run an experiment spec through the ``nitro-experiment`` flow and print its summary;
``nitro experiment report DIR``: rebuild a finished report's rliable statistics from its files."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def parse_only(items: list[str]) -> dict[str, list[str]]:
    """``["env=Hopper-v5", "scaler=nitro,fixed"]`` -> ``{"env": ["Hopper-v5"], "scaler": ["nitro", "fixed"]}``."""
    from nitro.experiments import ExperimentError

    only: dict[str, list[str]] = {}
    for item in items:
        field, sep, values = item.partition("=")
        names = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not field.strip() or not names:
            raise ExperimentError(f"--only {item!r}: expected FIELD=V1,V2 (e.g. env=Hopper-v5)")
        only.setdefault(field.strip(), []).extend(names)
    return only


def cmd_experiment(args) -> int:
    """``nitro experiment SPEC [--sensitivity] [--report-dir DIR] [--fail-fast] [--only F=V,..] [key=value ...]``.

    Validates the spec (and ``--only``) before Prefect starts, runs the ``nitro-experiment`` flow
    in this process and prints the summary table. Exit 0: all selected cells finished; 1: some
    cells failed (re-run the same command to resume them); 2: invalid spec (raised as
    ExperimentError, a ConfigError)."""
    import asyncio

    from nitro.experiments import expand_cells, format_summary, load_spec, select_cells

    spec = load_spec(args.spec, args.overrides)  # fail fast, before Prefect starts
    only = parse_only(args.only)
    select_cells(expand_cells(spec, sensitivity=args.sensitivity), only)
    from flows.experiment import ExperimentFailed, experiment

    try:
        result = asyncio.run(experiment(spec_path=str(args.spec), sensitivity=args.sensitivity,
                                        overrides=list(args.overrides), report_dir=args.report_dir,
                                        fail_fast=args.fail_fast, only=only))
    except ExperimentFailed as exc:
        print(f"nitro: experiment incomplete: {exc}", file=sys.stderr)
        return 1
    summary = json.loads((Path(result["report_dir"]) / "results.json").read_text())["summary"]
    print(format_summary([s for s in summary if not s.get("sensitivity")], markdown=False))
    print(f"report: {result['report_dir']}/README.md   MLflow parent run: {result['parent_run_id']}")
    return 0


def report_parser():
    """``nitro experiment report DIR``'s parser (``cli.main`` dispatches to it: ``experiment`` takes a spec)."""
    import argparse

    from nitro.experiments.aggregate import BOOTSTRAP_REPS, PROFILE_REPS

    p = argparse.ArgumentParser(
        prog="nitro experiment report",
        description="Rewrite a finished report's rliable statistics (per task and scaler IQM, mean and P(> "
                    "reference) of the late return, the area under return vs spend and the final return, and each "
                    "arm against the best of the spec's grid; across tasks on normalised scores; "
                    "performance-profile.png) from the report's own results.json, runs.csv and rounds file, "
                    "with no MLflow store. Only the README's statistics blocks, results.json's `statistics` "
                    "and the profile change.")
    p.add_argument("report_dir", nargs="+", metavar="DIR", help="a report directory, e.g. docs/results/boost-stellaris")
    p.add_argument("--reps", type=int, default=BOOTSTRAP_REPS, help="bootstrap resamples per interval")
    p.add_argument("--profile-reps", type=int, default=PROFILE_REPS, help="bootstrap resamples of the profile bands")
    p.set_defaults(func=cmd_experiment_report)
    return p


def cmd_experiment_report(args) -> int:
    """Rebuild each DIR's statistics; print the across-tasks table and the files written. Exit 2
    (ExperimentError, one line) at the first DIR whose files lack what the statistics need."""
    from nitro.experiments.restats import rebuild_statistics
    from nitro.experiments.scores import format_across_table

    for report_dir in args.report_dir:
        rebuilt = rebuild_statistics(report_dir, reps=args.reps, profile_reps=args.profile_reps)
        if any(agg["arms"] for agg in rebuilt.across_tasks):
            print(format_across_table(rebuilt.across_tasks, rebuilt.reference))
        print(f"{report_dir}: rewrote " + ", ".join(p.name for p in rebuilt.files))
    return 0
