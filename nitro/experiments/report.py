"""An experiment's report: plots, a Markdown summary, CSV/JSON raw numbers and machine info, all from MLflow.

The per-round metrics are in the rounds file alone (``nitro.experiments.rounds``); ``results.json``
holds the rest: the spec, every cell's row and config, the summary, the ratios, the notes, the machine."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nitro.experiments.carry import CarriedRun
from nitro.experiments.cells import Cell, cell_config, fmt_value, sensitivity_cells, slug
from nitro.experiments.machine import machine_info, machine_markdown
from nitro.experiments.rounds import write_rounds
from nitro.experiments.scores import (
    ACROSS_BLOCK,
    across_section,
    start_return,
    statistics_block,
    task_scores,
)
from nitro.experiments.spec import ExperimentSpec
from nitro.experiments.stats import (
    LATE_EVALUATIONS,
    experiment_rows,
    finite,
    format_ratios,
    format_summary,
    late_return,
    ratios_against,
    return_spend_area,
    round_cost_table,
    summarize,
    threshold_table,
    time_to_threshold,
)

REPORT_METRICS = ("eval_return_mean", "eval_stochastic_return_mean", "train_return_mean", "actors_launched",
                  "actors_wanted", "env_steps_total", "spend_round_usd", "spend_total_usd", "boost_score", "hessian_R",
                  "round_s", "round_lambda_s", "round_billed_s",
                  # the goodput scaler's reading of each round (nitro/scaling/goodput.py), for a study's
                  # account of which term of its model held: the noise scale, the price fit, the choice
                  "goodput/phi", "goodput/c0_usd", "goodput/c1_usd", "goodput/best_actors", "goodput/gain_over_min")
# A study's pre-registration, written by hand into its report folder before any cell runs: the
# generated README.md links to it and never overwrites it.
PREREGISTRATION = "PREREGISTRATION.md"


@dataclass
class Report:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[dict[str, Any]] = field(default_factory=list)
    # rliable's per task and arm (task_statistics) and across tasks, per metric (across_tasks)
    task_statistics: list[dict[str, Any]] = field(default_factory=list)
    across_tasks: list[dict[str, Any]] = field(default_factory=list)
    thresholds: list[dict[str, Any]] = field(default_factory=list)  # per env, algo and arm: time to the threshold
    best_of: list[dict[str, Any]] = field(default_factory=list)  # per task, score and arm: against the grid's best
    markdown: str = ""


def _write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return path


def json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def build_report(
    spec: ExperimentSpec,
    cells: Sequence[Cell],
    tracking_uri: str,
    out_dir: str | os.PathLike,
    *,
    parent_run_id: str | None = None,
    notes: Mapping[str, str] | None = None,
    carried: Mapping[str, CarriedRun] | None = None,
) -> Report:
    """Plots, Markdown summary (README.md), CSV/JSON raw numbers and machine info in ``out_dir``.

    Everything comes from MLflow: the per-run table is ``nitro compare``'s rows (same code, same
    formatting), the summary aggregates those rows, the curves are the runs' metric histories.
    ``notes``: per cell key, a remark (e.g. where a random cell's mean actors came from).
    ``carried``: per cell key, a run finished on another machine (``nitro.experiments.carry``),
    reported from the earlier report's numbers where this MLflow store has no finished run of it."""
    from mlflow.tracking import MlflowClient

    from nitro.tracking import plots
    from nitro.tracking.compare import format_table

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    info = machine_info()
    client = MlflowClient(tracking_uri=tracking_uri)
    histories: dict[str, list[dict[str, float]]] = {}
    rows = []
    for r in experiment_rows(tracking_uri, spec, cells):
        if r["status"] != "FINISHED" and r["cell"] in (carried or {}):
            continue  # the cell finished elsewhere; this store holds only a start of it
        per_step: dict[int, dict[str, float]] = {}
        for key in REPORT_METRICS:
            for m in client.get_metric_history(r["mlflow_run_id"], key):
                per_step.setdefault(int(m.step), {"round": int(m.step)})[key] = m.value
        histories[r["mlflow_run_id"]] = [per_step[k] for k in sorted(per_step)]
        rows.append({**r, "machine": r["machine"] or info["cpu"]})  # a run from before runs were tagged ran here
    here = {r["cell"] for r in rows}
    for key, run in (carried or {}).items():
        if key not in here:
            rows.append(run.row)
            histories[run.row["mlflow_run_id"]] = run.history
    order = {c.key: i for i, c in enumerate(cells)}
    rows.sort(key=lambda r: order[r["cell"]])
    for r in rows:  # from the history, so a carried run (its report older than the column) has it too
        r["late_return"] = late_return(histories[r["mlflow_run_id"]])
        r["start_return"] = start_return(histories[r["mlflow_run_id"]])
        r["return_area"] = (return_spend_area(histories[r["mlflow_run_id"]], spec.budget_usd)
                            if spec.budget_usd is not None else math.nan)
    report.rows = rows
    round_rows = [{"run_name": r["run_name"], "label": r["label"], "env": r["env"], "algo": r["algo"],
                   "seed": r["seed"], **h} for r in rows for h in histories[r["mlflow_run_id"]]]
    rounds_file = write_rounds(out, round_rows, ["run_name", "label", "env", "algo", "seed", "round", *REPORT_METRICS])

    main_labels = list(dict.fromkeys(c.label for c in cells if not c.is_sensitivity))
    main_rows = [r for r in rows if not r["variant"]]
    report.summary = summarize(main_rows, main_labels)

    md: list[str] = [f"# Experiment `{spec.name}`", ""]
    if spec.description:
        md += [spec.description.strip(), ""]
    if (out / PREREGISTRATION).exists():  # written by hand before any cell ran; this file is rebuilt
        md += [f"Pre-registered before any cell ran: [{PREREGISTRATION}]({PREREGISTRATION}) (the compared "
               "arms, the primary metric, the budget, the seeds and the stop rule).", ""]
    common = (f"the same budget, ${spec.budget_usd:g} per cell (round cap {spec.max_rounds})"
              if spec.compare == "budget" else f"the same number of rounds, {spec.rounds} per cell")
    md += [
        f"Matrix: env {', '.join(spec.matrix.env)} × algo {', '.join(spec.matrix.algo)} × scaler "
        f"{', '.join(spec.matrix.scaler)} × seeds {', '.join(map(str, spec.matrix.seed))}; compared under {common}.",
        f"Cells finished: {sum(r['status'] == 'FINISHED' for r in rows)} of {len(cells)}"
        + (f"; MLflow parent run `{parent_run_id}`" if parent_run_id else "") + ".",
        "",
        "Final return: the run's last evaluation, whole episodes with the policy's mean action "
        "(`nitro compare`'s `final return`; a budget run spends what it kept in hand on evaluating "
        f"its last policy); last {LATE_EVALUATIONS} evals' return: the mean of the run's last "
        f"{LATE_EVALUATIONS} evaluations (`{rounds_file.name}`'s `eval_return_mean`), which says where a run "
        "stood over its last rounds where its last evaluation alone may catch a swing; total spend: "
        "the ledger's cumulative spend. All as mean ± 95% t-interval over seeds.",
        "",
        _clock_line(cell_config(spec, cells[0]), rounds_file.name),
        "",
        *_baselines_table(spec, cells),
    ]
    if spec.compare == "budget":
        md += ["A cell stops when the budget cap finds no room for another round. The cap reserves "
               "upper bounds (nitro/scaling/budget.py): the learner's time until the next decision and each actor's "
               "timeout-bounded cost, so "
               "cells with long (boosted) rounds leave more of the budget unspent; read the total spend "
               "column next to the return.", ""]
    def add(path: Path) -> str:
        report.files.append(path)
        return path.name

    for env in spec.matrix.env:
        for algo in spec.matrix.algo:
            stem = f"{slug(env.split('/')[-1])}-{algo}"
            groups: dict[str, list[list[dict[str, float]]]] = {}
            for lab in main_labels:
                runs = [histories[r["mlflow_run_id"]] for r in main_rows
                        if r["env"] == env and r["algo"] == algo and r["label"] == lab]
                if runs:
                    groups[lab] = runs
            md += [f"## {env} · {algo}", ""]
            if not groups:
                md += ["No finished runs yet.", ""]
                continue
            title = f"{env} {algo}"
            figs = [
                plots.plot_group_curves(groups, out / f"{stem}-return-vs-round.png", x_key="round",
                                        y_key="eval_return_mean",
                                        title=f"{title}: evaluation return vs round (mean ± 95% CI)",
                                        ylabel="evaluation return (whole episodes)"),
                plots.plot_group_curves(groups, out / f"{stem}-return-vs-spend.png", x_key="spend_total_usd",
                                        y_key="eval_return_mean",
                                        title=f"{title}: evaluation return vs cumulative spend",
                                        xlabel="cumulative spend (USD)", ylabel="evaluation return (whole episodes)"),
                plots.plot_group_curves(groups, out / f"{stem}-actors-per-round.png", x_key="round",
                                        y_key="actors_launched", title=f"{title}: actors per round",
                                        ylabel="actors launched"),
            ]
            summ = [s for s in report.summary if s["env"] == env and s["algo"] == algo]
            figs.append(plots.plot_group_bars({s["label"]: s["final_return_values"] for s in summ},
                                              out / f"{stem}-final-return.png",
                                              title=f"{title}: final evaluation return",
                                              ylabel="final evaluation return"))
            figs.append(plots.plot_group_bars({s["label"]: s["total_spend_usd_values"] for s in summ},
                                              out / f"{stem}-total-spend.png", title=f"{title}: total spend",
                                              ylabel="USD"))
            md += [format_summary(summ), ""]
            ratios = ratios_against(summ, spec.reference)
            if ratios:
                md += [f"Against `{spec.reference}`: each entry's mean over seeds divided by `{spec.reference}`'s, "
                       "with a percentile-bootstrap 95% CI (arch's `IndependentSamplesBootstrap`: each arm's seeds "
                       "resampled on their own). The ratio says how much of the reference's return an entry makes; "
                       "the probability of improvement below says how often its seed beats the reference's.", "",
                       format_ratios(ratios), ""]
                report.ratios += ratios
            if (threshold := spec.thresholds.get(env)) is not None:
                lines, records = threshold_table(
                    {lab: [time_to_threshold(run, threshold) for run in runs] for lab, runs in groups.items()},
                    threshold, spec.reference)
                md += lines
                report.thresholds += [{"env": env, "algo": algo, **r} for r in records]
            if spec.compare == "budget":
                md += round_cost_table(groups)
            block, stats, against = task_scores(main_rows, env, algo, main_labels, spec.reference, spec.best_of)
            md += block
            report.task_statistics += stats
            report.best_of += against
            md += [f"![{p.stem}]({add(p)})" for p in figs] + [""]

    tasks = [(env, algo) for env in spec.matrix.env for algo in spec.matrix.algo]
    across_md, report.across_tasks, profile = across_section(main_rows, tasks, main_labels, spec.reference, out)
    md += statistics_block(ACROSS_BLOCK, across_md)
    if profile is not None:
        add(profile)

    sens = sensitivity_cells(spec, cells)
    sens_rows = [r for r in rows if r["variant"]] or []
    if sens and sens_rows and spec.sensitivity is not None:
        md += ["## Sensitivity (paper §8.4)", "",
               f"Scaler `{spec.sensitivity.scaler}`, one parameter at a time, others at the base value; "
               "the base value is the main matrix's cells.", ""]
        by_cell = {r["cell"]: r for r in rows}
        sens_summary = []
        for key, per_value in sens.items():
            for env in spec.matrix.env:
                for algo in spec.matrix.algo:
                    values = {}
                    for value, cs in per_value.items():
                        rs = [by_cell[c.key] for c in cs if c.key in by_cell and c.env == env and c.algo == algo]
                        fr = [float(r["final_return"]) for r in rs if finite(r.get("final_return"))]
                        if rs:
                            values[f"{key}={fmt_value(value)}"] = fr
                            s = summarize([{**r, "label": f"{key}={fmt_value(value)}"} for r in rs])[0]
                            sens_summary.append({**s, "param": key, "value": value})
                    if values:
                        name = f"{slug(env.split('/')[-1])}-{algo}-sensitivity-{slug(key)}.png"
                        p = plots.plot_group_bars(values, out / name, title=f"{env} {algo}: final return vs {key}",
                                                  ylabel="final evaluation return")
                        md += [f"![{p.stem}]({add(p)})"]
        md += ["", format_summary(sens_summary), ""]
        report.summary += [{**s, "sensitivity": True} for s in sens_summary]

    md += ["## Runs (`nitro compare --experiment " + spec.name + "`)", "",
           format_table(rows, markdown=True), ""]
    if notes:
        md += ["## Notes", ""] + [f"- `{k}`: {v}" for k, v in notes.items()] + [""]
    md += machine_markdown(info)
    machines = dict(Counter(str(r.get("machine")) for r in rows))
    if len(machines) > 1 or (machines and info["cpu"] not in machines):
        md += ["Runs by machine (CPU models differ; compare runs within one): "
               + "; ".join(f"{m}: {n}" for m, n in machines.items()) + ". `runs.csv` names each run's.", ""]

    run_cols = ["run_name", "nitro_run_id", "mlflow_run_id", "cell", "label", "env", "algo", "scaler", "seed",
                "rounds_done", "final_return", "late_return", "return_area", "start_return", "total_spend_usd",
                "env_steps_total",
                "pretrain_episodes", "pretrain_env_steps", "pretrain_usd", "status", "machine"]
    add(_write_csv(out / "runs.csv", rows, run_cols))
    add(rounds_file)
    summary_cols = ["env", "algo", "label", "n", "final_return_mean", "final_return_ci95", "late_return_mean",
                    "late_return_ci95", "total_spend_usd_mean",
                    "total_spend_usd_ci95", "rounds_done_mean", "env_steps_total_mean", "pretrain_episodes_mean",
                    "pretrain_env_steps_mean", "pretrain_usd_mean"]
    add(_write_csv(out / "summary.csv", report.summary, summary_cols))
    configs = {c.key: cell_config(spec, c).model_dump(mode="json") for c in cells}
    results = {
        "experiment": spec.name, "spec": spec.model_dump(mode="json"), "parent_run_id": parent_run_id,
        "tracking_uri": tracking_uri, "machine": info, "summary": report.summary, "ratios": report.ratios,
        "time_to_threshold": report.thresholds,
        "statistics": {"per_task": report.task_statistics, "across_tasks": report.across_tasks,
                       "best_of": report.best_of},
        "configs": configs, "runs": rows, "notes": dict(notes or {}),
    }
    results_path = out / "results.json"
    results_path.write_text(json.dumps(json_safe(results), indent=1, default=str))
    add(results_path)
    report.markdown = "\n".join(md)
    add_path = out / "README.md"
    add_path.write_text(report.markdown + "\n")
    add(add_path)
    return report


def _baselines_table(spec: ExperimentSpec, cells: Sequence[Cell]) -> list[str]:
    """What each matrix entry runs and how its actors are billed (Markdown lines)."""
    from nitro.pricing.cost import ledger_from_config

    first = {c.scaler: c for c in reversed(cells) if not c.is_sensitivity}
    lines = ["| matrix entry | scaler | its overrides | actors billed as | what it is |", "|---|---|---|---|---|"]
    for name in spec.matrix.scaler:
        baseline = spec.baseline(name)
        priced = ledger_from_config(cell_config(spec, first[name])).tags()["cost.actor_pricing"]
        overrides = ", ".join(f"`{o}`" for o in baseline.overrides) or "-"
        lines.append(f"| {name} | {baseline.scaler} | {overrides} | {priced} | {baseline.description or '-'} |")
    return [*lines, ""]


def _clock_line(config, rounds_file: str) -> str:
    """Which clock the learner was billed by (nitro/pricing/clock.py), in one sentence."""
    if config.clock.kind == "lambda":
        c = config.clock
        return ("Clock: **Lambda-projected** (`clock.kind: lambda`): each round's learner time is billed as if the "
                "round's invocations had run at once on Lambda: the learner's own steps as measured, plus the "
                f"slowest invocation, plus {c.dispatch_s_per_invocation * 1000:g} ms of fan-out per invocation, "
                f"{c.invoke_s * 1000:g} ms of invoke latency and a {c.cold_start_s:g} s cold start where a round needs "
                "more instances than were warm. The budget cap uses the same clock; the measured wall time is in "
                f"`{rounds_file}` (`round_s`) beside the billed one (`round_billed_s`).")
    return ("Clock: **measured** wall time: the learner is billed for each round as it ran on this machine, "
            "local actors queueing for its cores included.")


def iter_report_files(report: Report) -> Iterable[Path]:
    return iter(report.files)
