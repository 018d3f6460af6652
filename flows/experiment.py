"""An experiment: every cell of a matrix (env × algo × scaler × seed) as a training run, then a report.

Cells run in this process, one after another (``run_training`` directly: a laptop's cores go to
each run's actors). Each cell is an MLflow run nested under ONE parent MLflow run (tag
``mlflow.parentRunId``); the parent is created with ``MlflowClient`` (never the fluent API) and
found again by its tag ``nitro.experiment_parent`` on a re-run.

Resumable: a cell's run id is deterministic (``nitro.experiments.cell_run_id``), so re-running the
flow (or retrying its flow run) finds each cell's checkpoints. A cell whose checkpoint reached its
stop (round limit, budget or target) is skipped; a cell that failed mid-way resumes from its last
completed round. A failing cell does not stop the others (``fail_fast=False``); the flow fails at
the end, after writing the report of what finished, so a retry only redoes what is missing.

``random`` cells get the measured mean actors per round of their (env, algo, seed)'s nitro cell,
and ``replay`` cells the per-round actor counts of the cell they replay once it has finished,
which the run order puts first (see ``nitro/experiments/__init__.py``).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from prefect import flow, runtime
from prefect.artifacts import acreate_link_artifact, acreate_markdown_artifact

from nitro.experiments import (
    ExperimentSpec,
    build_report,
    carried_runs,
    cell_config,
    cell_run_id,
    cell_scaler,
    cell_state,
    expand_cells,
    load_spec,
    machine_info,
    mark_done,
    mean_actors_launched,
    mean_actors_per_round,
    nitro_partner,
    replay_counts,
    replay_partner,
    saved_config_mismatch,
    select_cells,
)
from nitro.tracking.tracker import TAG_MACHINE, RunTracker, default_tracking_uri

log = logging.getLogger("nitro")

TAG_PARENT = "nitro.experiment_parent"
TAG_EXPERIMENT = "nitro.experiment"
TAG_CELL = "nitro.cell"
TAG_LABEL = "nitro.cell_label"
TAG_PARENT_RUN = "mlflow.parentRunId"
TAG_PARENT_FLOW_RUN = "nitro.experiment_flow_run_id"


class ExperimentFailed(RuntimeError):
    pass


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:50]


def ensure_parent_run(tracker: RunTracker, spec: ExperimentSpec, flow_run_id: str | None) -> str:
    """The experiment's parent MLflow run: found by tag, else created (MlflowClient only)."""
    import yaml

    return parent_run(tracker, TAG_PARENT, spec.name, f"experiment-{spec.name}", flow_run_id,
                      spec_yaml=yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False),
                      params={"compare": spec.compare,
                              "budget_usd" if spec.compare == "budget" else "rounds":
                                  spec.budget_usd if spec.compare == "budget" else spec.rounds},
                      tags={TAG_EXPERIMENT: spec.name, "compare": spec.compare})


def parent_run(tracker: RunTracker, tag: str, name: str, run_name: str, flow_run_id: str | None, *,
               spec_yaml: str, params: dict[str, Any], tags: dict[str, str] | None = None) -> str:
    """The parent MLflow run of a group of runs (an experiment, a probe), found by ``tag`` =
    ``name``, else created with the spec as an artifact; marked RUNNING again on a re-run."""
    from mlflow.entities import ViewType

    client = tracker.client
    found = client.search_runs([tracker.experiment_id], filter_string=f"tags.`{tag}` = '{name}'",
                               run_view_type=ViewType.ACTIVE_ONLY, order_by=["attributes.start_time ASC"],
                               max_results=1)
    all_tags = {tag: name, "mlflow.runName": run_name, **(tags or {})}
    # Not `prefect.flow_run_id`: the parent run carries the same flow run as every child, so the
    # tag would not tell them apart.
    if flow_run_id:
        all_tags[TAG_PARENT_FLOW_RUN] = flow_run_id
    if found:
        run_id = found[0].info.run_id
        if found[0].info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        if flow_run_id:
            client.set_tag(run_id, TAG_PARENT_FLOW_RUN, flow_run_id)
        return run_id
    run = client.create_run(tracker.experiment_id, run_name=run_name, tags=all_tags)
    client.log_text(run.info.run_id, spec_yaml, "spec.yaml")
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    return run.info.run_id


def attach_child(tracker: RunTracker, config, run_id: str, parent: str, tags: dict[str, str]) -> str:
    """Create (or find) a training run's MLflow run nested under ``parent``, before
    ``run_training`` attaches to it by its ``nitro.run_id`` tag (which also records the Prefect
    flow run)."""
    from nitro.pricing.cost import ledger_from_config

    tags = {TAG_PARENT_RUN: parent, **tags, **ledger_from_config(config).tags()}
    mlflow_run = tracker.start_or_attach(None, run_id, config, tags=tags)
    current = tracker.client.get_run(mlflow_run).data.tags
    missing = {k: v for k, v in tags.items() if current.get(k) != v and k.startswith(("mlflow.", "nitro."))}
    for k, v in missing.items():
        tracker.client.set_tag(mlflow_run, k, v)
    return mlflow_run


@flow(name="nitro-experiment", persist_result=False, log_prints=True)
async def experiment(
    spec_path: str | None = None,
    spec: dict | None = None,
    sensitivity: bool = False,
    overrides: list[str] | None = None,
    report_dir: str | None = None,
    fail_fast: bool = False,
    only: dict[str, list[str]] | None = None,
) -> dict:
    """Run every cell of an experiment spec (YAML path or mapping), then write and log the report.

    ``sensitivity``: also run the spec's ``sensitivity`` sweep (paper §8.4). ``overrides``: dotted
    config overrides for every cell (e.g. ``home=/data/nitro``). ``report_dir``: default the
    spec's ``report_dir``, else ``docs/results/<name>``. ``only``: run just the cells whose fields
    have these values (e.g. ``{"env": ["Hopper-v5"]}``); the report still covers the whole spec
    and counts the cells not yet run."""
    source = spec_path if spec_path is not None else spec
    if source is None or (spec_path is not None and spec is not None):
        raise ValueError("give exactly one of spec_path or spec")
    parsed = load_spec(source, overrides or [])
    return await run_experiment(parsed, sensitivity=sensitivity, report_dir=report_dir, fail_fast=fail_fast,
                                only=only)


async def run_experiment(spec: ExperimentSpec, *, sensitivity: bool = False,
                         report_dir: str | os.PathLike | None = None, fail_fast: bool = False,
                         only: dict[str, list[str]] | None = None) -> dict:
    from flows.training import run_training

    cells = expand_cells(spec, sensitivity=sensitivity)
    to_run = select_cells(cells, only or {})
    first = cell_config(spec, cells[0])
    uri = first.tracking.mlflow_uri or default_tracking_uri(first)
    tracker = RunTracker(uri, spec.name)
    flow_run_id = str(runtime.flow_run.id) if runtime.flow_run.id else None
    parent = ensure_parent_run(tracker, spec, flow_run_id)
    out_dir = Path(report_dir or spec.report_dir or Path("docs/results") / spec.name)
    carried = carried_runs(out_dir, spec, cells)
    machine = machine_info()["cpu"]
    log.info("experiment %s: %d cells%s%s, MLflow parent run %s", spec.name, len(cells),
             f" ({len(to_run)} selected by --only)" if len(to_run) < len(cells) else "",
             f", {len(carried)} finished in its report ({out_dir / 'results.json'})" if carried else "",
             parent)

    results: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {k: run.note for k, run in carried.items() if run.note}
    failed: dict[str, str] = {}
    for i, cell in enumerate(to_run, 1):
        run_id = cell_run_id(spec.name, cell)
        if cell.key in carried and cell_state(cell_config(spec, cell), run_id)[0] != "done":
            log.info("cell %d/%d %s: finished on %s, carried from the report, skipped", i, len(to_run), cell.key,
                     carried[cell.key].row.get("machine"))
            results[cell.key] = {"run_id": run_id, "state": "carried"}
            continue
        random_mean = None
        if cell_scaler(spec, cell) == "random":
            partner = nitro_partner(cell)
            if partner.key in failed:
                failed[cell.key] = f"skipped: its nitro cell {partner.key} failed"
                log.warning("cell %d/%d %s: %s", i, len(to_run), cell.key, failed[cell.key])
                continue
            random_mean = mean_actors_per_round(cell_config(spec, partner), cell_run_id(spec.name, partner))
            if random_mean is None and partner.key in carried:
                random_mean = mean_actors_launched(carried[partner.key].history)
            if random_mean is not None:
                notes[cell.key] = f"random_mean_actors={random_mean:.3f}, measured on {partner.key}"
        replay = None
        if replay_partner(spec, cell) is not None:  # the shuffled control: another cell's counts
            replay, why = replay_counts(spec, cell, carried)
            if replay is None:
                failed[cell.key] = f"skipped: {why}"
                log.warning("cell %d/%d %s: %s", i, len(to_run), cell.key, failed[cell.key])
                continue
            notes[cell.key] = why
        config = cell_config(spec, cell, random_mean, replay)
        if cell_scaler(spec, cell) == "random" and random_mean is None:
            own = config.scaler.random_mean_actors
            notes[cell.key] = (
                f"no nitro cell to match; random_mean_actors={own} from the base config" if own is not None
                else f"no nitro cell to match; random_boost_prob={config.scaler.random_boost_prob}")
        state, done_rounds = cell_state(config, run_id)
        if state == "done":
            log.info("cell %d/%d %s: finished earlier (%d rounds), skipped", i, len(to_run), cell.key, done_rounds)
            _close_if_left_running(tracker, run_id)
            results[cell.key] = {"run_id": run_id, "state": "skipped", "rounds_done": done_rounds}
            continue
        mismatch = saved_config_mismatch(config, run_id)
        if mismatch:
            failed[cell.key] = mismatch
            log.error("cell %d/%d %s: %s", i, len(to_run), cell.key, mismatch)
            if fail_fast:
                break
            continue
        log.info("cell %d/%d %s: %s (run %s)", i, len(to_run), cell.key,
                 f"resuming after round {done_rounds}" if state == "partial" else "starting", run_id)
        try:
            attach_child(tracker, config, run_id, parent, {TAG_EXPERIMENT: tracker.experiment_name, TAG_CELL: cell.key,
                                                           TAG_LABEL: cell.label, TAG_MACHINE: machine})
            result = await run_training(config, run_id)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # one cell failing must not stop the study
            failed[cell.key] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log.exception("cell %d/%d %s failed", i, len(to_run), cell.key)
            if fail_fast:
                break
            continue
        mark_done(config, run_id, result.model_dump())
        results[cell.key] = {**result.model_dump(), "state": "ran"}
        ret = result.final_eval_return
        log.info("cell %d/%d %s: %d rounds, %s, final evaluation return %s, spend $%.4f", i, len(to_run), cell.key,
                 result.rounds_done, result.stop_reason,
                 "n/a" if ret is None or math.isnan(ret) else f"{ret:.1f}", result.spend_usd)

    notes.update({k: f"FAILED: {v}" for k, v in failed.items()})
    report = build_report(spec, cells, uri, out_dir, parent_run_id=parent, notes=notes, carried=carried)
    client = tracker.client
    client.log_artifacts(parent, str(out_dir), "report")
    for s in report.summary:
        if s.get("sensitivity"):
            continue
        key = slug(f"{s['env']}-{s['algo']}-{s['label']}").replace("-", "_")
        for name in ("final_return_mean", "total_spend_usd_mean"):
            if isinstance(s[name], float) and math.isfinite(s[name]):
                client.log_metric(parent, f"{key}/{name}", s[name])
    client.set_terminated(parent, status="FAILED" if failed else "FINISHED")

    mlflow_url = tracker.run_url(parent)
    await acreate_link_artifact(mlflow_url, link_text=f"MLflow parent run of experiment {spec.name}",
                         key=f"nitro-experiment-{slug(spec.name)}-mlflow",
                         description="The experiment's report is logged under the run's artifacts, in report/")
    await acreate_markdown_artifact(
        f"# Nitro experiment `{spec.name}`\n\n"
        f"Report: [MLflow parent run]({mlflow_url}) (artifacts → `report/README.md`), "
        f"and on disk at `{out_dir.resolve()}`.\n\n"
        f"{len(cells)} cells: {sum(r['state'] == 'ran' for r in results.values())} ran, "
        f"{sum(r['state'] == 'skipped' for r in results.values())} skipped (finished earlier), "
        f"{sum(r['state'] == 'carried' for r in results.values())} carried from the report "
        "(finished on other machines), "
        f"{len(failed)} failed"
        f"{f', {len(cells) - len(to_run)} left out by --only' if len(to_run) < len(cells) else ''}.\n\n"
        + _summary_markdown(report),
        key=f"nitro-experiment-{slug(spec.name)}",
        description=f"Nitro experiment {spec.name}: summary and link to the full report",
    )
    outcome = {
        "experiment": spec.name,
        "parent_run_id": parent,
        "tracking_uri": uri,
        "report_dir": str(out_dir),
        "report_files": [str(p) for p in report.files],
        "cells": {c.key: cell_run_id(spec.name, c) for c in cells},
        "results": results,
        "failed": failed,
    }
    if failed:
        first_failures = "; ".join(f"{k}: {v}" for k, v in list(failed.items())[:3])
        raise ExperimentFailed(f"{len(failed)} of {len(to_run)} cells failed ({first_failures}); "
                               "re-run the same command to resume them")
    return outcome


def _summary_markdown(report) -> str:
    from nitro.experiments import format_summary

    main = [s for s in report.summary if not s.get("sensitivity")]
    return format_summary(main) if main else "No finished cells."


def _close_if_left_running(tracker: RunTracker, run_id: str) -> None:
    """A cell whose checkpoint reached its stop but whose process died before closing its
    MLflow run: mark the run FINISHED (its metrics are all there; the checkpoint is on disk)."""
    mlflow_run = tracker.find_run(run_id)
    if mlflow_run is not None and tracker.client.get_run(mlflow_run).info.status == "RUNNING":
        tracker.client.set_terminated(mlflow_run, status="FINISHED")
