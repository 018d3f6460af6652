"""A finished report's rliable statistics, rebuilt from the report's own files (``nitro experiment report DIR``).

A report is written by the experiment flow from an MLflow store, and only the report is committed.
This reads what the report keeps: ``results.json`` (the spec's matrix and reference), ``runs.csv``
(per run: arm, task, seed, status, final and late return) and the rounds file (per round: the
evaluation return, from which a run's late return and its round-0 evaluation follow where
``runs.csv`` predates those columns; the spend, from which its area under return vs spend follows
in a budget experiment). It rewrites the rliable parts alone: the README's statistics
blocks (``scores.statistics_block``: per task after the task's tables, across tasks before the
runs table), ``results.json``'s ``statistics`` and ``performance-profile.png``. Every other line of
the README, hand-written or generated, and every other file stay as they are.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nitro.experiments.aggregate import BOOTSTRAP_REPS, PROFILE_REPS
from nitro.experiments.rounds import read_rounds, rounds_path
from nitro.experiments.scores import (
    ACROSS_BLOCK,
    BLOCK_BEGIN,
    BLOCK_END,
    PROFILE_FILE,
    across_section,
    start_return,
    statistics_block,
    task_name,
    task_scores,
)
from nitro.experiments.spec import ExperimentError, ExperimentSpec
from nitro.experiments.stats import late_return, return_spend_area

RUN_COLUMNS = ("label", "env", "algo", "seed", "final_return")  # runs.csv must have these
DERIVED_COLUMNS = ("late_return", "start_return")  # from runs.csv, else from the rounds' eval_return_mean
AREA_COLUMN = "return_area"  # in a budget experiment, from runs.csv, else from the rounds' returns and spend
# Where the across-tasks block goes in a README that has none yet: before the first of these
# headings (the report's order: tasks, across tasks, sensitivity, runs, notes, machine), else at the end.
ACROSS_BEFORE = ("## Sensitivity", "## Runs", "## Notes", "## Machine and versions")
_BLOCK = re.compile(re.escape(BLOCK_BEGIN).replace(re.escape("{name}"), "(?P<name>[^\n]*?)")
                    + r"\n.*?" + re.escape(BLOCK_END) + r"\n\n?", re.S)


@dataclass(frozen=True)
class ReportSpec:
    """What the statistics need of a report's spec (results.json's ``spec``)."""

    tasks: list[tuple[str, str]]  # (env, algo)
    labels: list[str]  # the main arms, in the matrix's order
    reference: str
    budget_usd: float | None  # None: the cells ran the same rounds, not the same money
    best_of: list[str]


@dataclass(frozen=True)
class RebuiltStatistics:
    reference: str
    per_task: list[dict[str, Any]]
    across_tasks: list[dict[str, Any]]
    profile: Path | None
    files: list[Path]


def _fail(report_dir: Path, what: str) -> ExperimentError:
    return ExperimentError(f"{report_dir}: cannot rebuild the statistics: {what}")


def read_spec(report_dir: Path) -> ReportSpec:
    """The report's tasks, main arms, reference arm (a spec from before ``reference`` existed gets
    the spec's default, ``fixed``), budget and grid."""
    path = report_dir / "results.json"
    if not path.exists():
        raise _fail(report_dir, "results.json is missing (it names the matrix and the reference)")
    spec = json.loads(path.read_text()).get("spec") or {}
    matrix = spec.get("matrix") or {}
    missing = [k for k in ("env", "algo", "scaler") if not matrix.get(k)]
    if missing:
        raise _fail(report_dir, f"results.json's spec.matrix lacks {', '.join(missing)}")
    reference = spec.get("reference") or ExperimentSpec.model_fields["reference"].default
    tasks = [(env, algo) for env in matrix["env"] for algo in matrix["algo"]]
    budget = spec.get("budget_usd") if spec.get("compare", "budget") == "budget" else None
    return ReportSpec(tasks, list(dict.fromkeys(matrix["scaler"])), str(reference),
                      float(budget) if budget is not None else None, list(spec.get("best_of") or []))


def read_runs(report_dir: Path, budget_usd: float | None = None) -> list[dict[str, Any]]:
    """``runs.csv``'s rows, each with its late return, round-0 evaluation and, given the budget, its
    area under return vs spend: from the row where ``runs.csv`` has them, else from the run's rounds
    (as the report computes them)."""
    path = report_dir / "runs.csv"
    if not path.exists():
        raise _fail(report_dir, "runs.csv is missing")
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        columns = list(reader.fieldnames or [])
        rows: list[dict[str, Any]] = list(reader)
    missing = [c for c in RUN_COLUMNS if c not in columns]
    if missing:
        raise _fail(report_dir, f"runs.csv lacks {', '.join(missing)}")
    wanted = (*DERIVED_COLUMNS, AREA_COLUMN) if budget_usd is not None else DERIVED_COLUMNS
    derive = [c for c in wanted if c not in columns]
    if not derive:
        return rows
    needs = f"runs.csv lacks {', '.join(derive)}"
    try:
        rounds = read_rounds(report_dir)
        name = rounds_path(report_dir).name
    except FileNotFoundError:
        raise _fail(report_dir, f"{needs} and there is no rounds file to derive them from") from None
    if "run_name" not in columns:
        raise _fail(report_dir, f"{needs} and has no run_name to find a run's rounds by")
    if not any("eval_return_mean" in h for history in rounds.values() for h in history):
        raise _fail(report_dir, f"{needs} and {name} has no eval_return_mean to derive them from")
    if AREA_COLUMN in derive and not any("spend_total_usd" in h for history in rounds.values() for h in history):
        raise _fail(report_dir, f"{needs} and {name} has no spend_total_usd to derive {AREA_COLUMN} from")
    for row in rows:
        history = rounds.get(row["run_name"], [])
        if "late_return" in derive:
            row["late_return"] = late_return(history)
        if "start_return" in derive:
            row["start_return"] = start_return(history)
        if AREA_COLUMN in derive and budget_usd is not None:
            row[AREA_COLUMN] = return_spend_area(history, budget_usd)
    return rows


def place_blocks(readme: str, blocks: Mapping[str, Sequence[str]]) -> str:
    """``readme`` with its statistics blocks replaced by ``blocks`` (name -> the block's lines): a
    task's block before the first figure of its ``## task`` section (the end of the section if it
    has none), the across-tasks block before the sensitivity, runs, notes or machine section. A task
    without a section of its own goes, under a heading of its own (which stays, as the task's section
    from then on), just before the across-tasks block."""
    lines = _BLOCK.sub("", readme).split("\n")

    def section_end(start: int) -> int:
        return next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))

    orphans: list[str] = []
    for name, block in blocks.items():
        if name == ACROSS_BLOCK:
            continue
        heading = next((i for i, line in enumerate(lines) if line == f"## {name}"), None)
        if heading is None:
            orphans += [f"## {name}", "", *block]
            continue
        end = section_end(heading)
        at = next((i for i in range(heading + 1, end) if lines[i].startswith("![")), end)
        lines[at:at] = list(block)
    across = [*orphans, *blocks.get(ACROSS_BLOCK, [])]
    before = next((i for i, line in enumerate(lines) if line.startswith(ACROSS_BEFORE)), None)
    if before is None:  # at the end, before the text's final newline
        before = len(lines) - 1 if lines[-1] == "" else len(lines)
        if before > 0 and lines[before - 1] != "":
            across = ["", *across]
    lines[before:before] = across
    return "\n".join(lines)


def _with_statistics(results: Mapping[str, Any], statistics: Mapping[str, Any]) -> dict[str, Any]:
    """``results`` with ``statistics`` where the report puts it (after ``ratios``, else after
    ``summary``), or in place of an earlier one; the other keys keep their order."""
    if "statistics" in results:
        return {**results, "statistics": statistics}
    after = "ratios" if "ratios" in results else "summary"
    out: dict[str, Any] = {}
    for key, value in results.items():
        out[key] = value
        if key == after:
            out["statistics"] = statistics
    out.setdefault("statistics", statistics)
    return out


def rebuild_statistics(report_dir: str | Path, *, reps: int = BOOTSTRAP_REPS,
                       profile_reps: int = PROFILE_REPS) -> RebuiltStatistics:
    """Rewrite the report's rliable statistics from its files (this module's docstring); raises
    ExperimentError, one line naming what is missing, where the files cannot carry them."""
    from nitro.experiments.report import json_safe

    out = Path(report_dir)
    if not out.is_dir():
        raise ExperimentError(f"{out}: not a report directory")
    spec = read_spec(out)
    tasks, labels, reference = spec.tasks, spec.labels, spec.reference
    rows = [r for r in read_runs(out, spec.budget_usd) if r["label"] in labels]  # a sensitivity cell's: key=value
    blocks: dict[str, list[str]] = {}
    per_task: list[dict[str, Any]] = []
    best_of: list[dict[str, Any]] = []
    for env, algo in tasks:
        block, stats, against = task_scores(rows, env, algo, labels, reference, spec.best_of, reps=reps)
        if block:
            blocks[task_name(env, algo)] = block
            per_task += stats
            best_of += against
    if not per_task:
        raise _fail(out, "no finished run has a final or a late return")
    across_md, across, profile = across_section(rows, tasks, labels, reference, out, reps=reps,
                                                profile_reps=profile_reps)
    blocks[ACROSS_BLOCK] = statistics_block(ACROSS_BLOCK, across_md)
    if profile is None:
        (out / PROFILE_FILE).unlink(missing_ok=True)  # an earlier one would contradict the section

    readme = out / "README.md"
    readme.write_text(place_blocks(readme.read_text() if readme.exists() else "", blocks))
    results_path = out / "results.json"
    text = results_path.read_text()
    results = _with_statistics(json.loads(text), {"per_task": per_task, "across_tasks": across, "best_of": best_of})
    ending = "\n" if text.endswith("\n") else ""
    results_path.write_text(json.dumps(json_safe(results), indent=1, default=str) + ending)
    files = [readme, results_path, *([profile] if profile is not None else [])]
    return RebuiltStatistics(reference, per_task, across, profile, files)
