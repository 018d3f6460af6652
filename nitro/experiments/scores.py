"""What an experiment's report shows of its arms' scores, per task and across tasks, through the
rliable statistics of ``nitro.experiments.aggregate``.

A run's scores (``METRICS``): its late return (the mean of its last evaluations), the area under its
return-vs-spend curve over the budget (a budget experiment's) and its final return.

- ``task_statistics``: per task and arm, the IQM and mean of the raw scores over seeds and the
  probability of improvement over the reference arm, each with its 95% CI;
- ``best_of_grid``: where the spec names a grid (``best_of``), every other arm's scores over the
  grid's best entry on the task, paired by seed;
- ``across_tasks`` and ``across_section``: the normalised scores over tasks, their aggregates and
  the performance profile.

Scores across tasks are on different scales, so the cross-task aggregates and the profile use
normalised scores (``normalisation``): 0 is where training started (the task's round-0
evaluation, the initialised policy, before any update) and 1 the best arm's mean on that task.
Per task, the raw returns are reported: there one scale serves every arm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nitro.experiments.aggregate import (
    BOOTSTRAP_REPS,
    BOOTSTRAP_SEED,
    MIN_RUNS_FOR_CI,
    PROFILE_REPS,
    format_estimate,
    improvement_probability,
    interval,
    plot_performance_profiles,
)
from nitro.experiments.stats import LATE_EVALUATIONS, finite, format_ratio, paired_ratio_ci

# The scores, in the order the pre-registrations rank them; a report shows those its runs have (a
# rounds-compared experiment has no budget, so no area under return vs spend).
METRICS: tuple[tuple[str, str], ...] = (("late_return", "late return"),
                                        ("return_area", "area under return vs spend"),
                                        ("final_return", "final return"))
PROFILE_FILE = "performance-profile.png"


def start_return(history: Sequence[Mapping[str, Any]]) -> float:
    """The run's round-0 evaluation return: its initialised policy, before any update (every arm
    of a seed starts from the same weights); NaN where round 0 did not evaluate."""
    for h in history:
        if int(h["round"]) == 0 and finite(h.get("eval_return_mean")):
            return float(h["eval_return_mean"])
    return math.nan


def metrics_of(rows: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, str], ...]:
    """The ``METRICS`` some row has a finite value of, in their order."""
    return tuple((m, name) for m, name in METRICS if any(finite(r.get(m)) for r in rows))


def _by_seed(rows: Sequence[Mapping[str, Any]], env: str, algo: str, label: str, metric: str) -> dict[int, float]:
    """{seed: score} of the arm's finished runs on the task that have the metric."""
    return {int(r["seed"]): float(r[metric]) for r in rows
            if (r["env"], r["algo"], r["label"]) == (env, algo, label) and r.get("status", "FINISHED") == "FINISHED"
            and finite(r.get(metric))}


def _arm_means(rows: Sequence[Mapping[str, Any]], env: str, algo: str, labels: Sequence[str],
               metric: str) -> dict[str, float]:
    """{label: mean over its seeds} of the arms among ``labels`` with finished runs that have the metric."""
    return {lab: float(np.mean(list(s.values()))) for lab in labels if (s := _by_seed(rows, env, algo, lab, metric))}


def _vector(scores: Mapping[int, float]) -> np.ndarray:
    return np.array([scores[s] for s in sorted(scores)], dtype=float)


def task_statistics(rows: Sequence[Mapping[str, Any]], env: str, algo: str, labels: Sequence[str], reference: str,
                    *, reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> list[dict[str, Any]]:
    """Per arm with finished runs on the task, for the late and the final return: the IQM and the
    mean over seeds of the raw returns, and P(arm > ``reference``), each with its 95% CI."""
    out = []
    metrics = metrics_of(rows)
    ref = {m: _by_seed(rows, env, algo, reference, m) for m, _ in metrics}
    for label in labels:
        entry: dict[str, Any] = {"env": env, "algo": algo, "label": label}
        for metric, _ in metrics:
            scores = _by_seed(rows, env, algo, label, metric)
            if not scores:
                continue
            x = _vector(scores)
            entry[metric] = {
                "seeds": len(x),
                "IQM": interval(x, "IQM", reps=reps, seed=seed).as_dict(),
                "mean": interval(x, "mean", reps=reps, seed=seed).as_dict(),
                "improvement": (improvement_probability(x, _vector(ref[metric]), reps=reps, seed=seed).as_dict()
                                if ref[metric] and label != reference else None),
            }
        if any(m in entry for m, _ in metrics):
            out.append(entry)
    return out


def best_of_grid(rows: Sequence[Mapping[str, Any]], env: str, algo: str, labels: Sequence[str],
                 grid: Sequence[str], *, reps: int = BOOTSTRAP_REPS,
                 seed: int = BOOTSTRAP_SEED) -> list[dict[str, Any]]:
    """Per score and per arm outside ``grid``: the task's best grid entry for that score (the highest
    mean over its seeds, chosen after the fact, which favours the grid), the arm's mean over the
    seeds both finished divided by the best's with a paired bootstrap 95% CI (``paired_ratio_ci``),
    the per-seed ratios, and P(arm > best) on those seeds (rliable)."""
    out = []
    for metric, _ in metrics_of(rows):
        means = _arm_means(rows, env, algo, grid, metric)
        if not means:
            continue
        best = max(means, key=lambda g: means[g])
        bar = _by_seed(rows, env, algo, best, metric)
        for label in labels:
            scores = _by_seed(rows, env, algo, label, metric)
            seeds = sorted(set(scores) & set(bar))
            if label in grid or not seeds:
                continue
            a, b = [scores[k] for k in seeds], [bar[k] for k in seeds]
            out.append({"env": env, "algo": algo, "label": label, "metric": metric, "best": best,
                        "best_mean": means[best], "seeds": seeds,
                        "ratio": paired_ratio_ci(a, b, seed=seed, draws=reps),
                        "per_seed": [x / y if y > 0 else math.nan for x, y in zip(a, b)],
                        "improvement": improvement_probability(a, b, reps=reps, seed=seed).as_dict()})
    return out


def normalisation(rows: Sequence[Mapping[str, Any]], env: str, algo: str, labels: Sequence[str],
                  metric: str) -> dict[str, Any]:
    """The task's constants for (score - start) / (best - start): ``start`` the mean of its runs'
    round-0 evaluations, ``best`` the highest arm mean of ``metric``; or ``reason`` why the task
    cannot be normalised (no round-0 evaluation, or no arm's mean above the start)."""
    task = [r for r in rows if (r["env"], r["algo"]) == (env, algo)]
    starts = [float(r["start_return"]) for r in task if finite(r.get("start_return"))]
    means = _arm_means(rows, env, algo, labels, metric)
    if not starts or not means:
        return {"reason": "no round-0 evaluation" if means else "no finished run"}
    start = float(np.mean(starts))
    best_label = max(means, key=lambda lab: means[lab])
    if means[best_label] <= start:
        return {"start": start, "reason": f"no arm's mean above the start, {start:.1f}"}
    return {"start": start, "best": means[best_label], "best_label": best_label}


def across_tasks(rows: Sequence[Mapping[str, Any]], tasks: Sequence[tuple[str, str]], labels: Sequence[str],
                 reference: str, metric: str, *, reps: int = BOOTSTRAP_REPS,
                 seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The normalised scores of ``metric`` over the tasks that can be normalised: per arm, the
    (seeds, tasks) matrix of the seeds it finished on every such task, its IQM and mean with
    stratified-bootstrap CIs, and P(arm > ``reference``) averaged over the tasks."""
    norms = {t: normalisation(rows, *t, labels, metric) for t in tasks}
    used = [t for t in tasks if "reason" not in norms[t]]
    matrices: dict[str, np.ndarray] = {}
    for label in labels:
        per_task = [_by_seed(rows, *t, label, metric) for t in used]
        seeds = sorted(set(per_task[0]).intersection(*per_task[1:])) if per_task else []
        if seeds:
            matrices[label] = np.array([[(s[k] - norms[t]["start"]) / (norms[t]["best"] - norms[t]["start"])
                                         for t, s in zip(used, per_task)] for k in seeds], dtype=float)
    arms = []
    for label, x in matrices.items():
        ref = matrices.get(reference)
        arms.append({"label": label, "seeds": x.shape[0],
                     "IQM": interval(x, "IQM", reps=reps, seed=seed).as_dict(),
                     "mean": interval(x, "mean", reps=reps, seed=seed).as_dict(),
                     "improvement": (improvement_probability(x, ref, reps=reps, seed=seed).as_dict()
                                     if ref is not None and label != reference else None)})
    return {"metric": metric, "tasks": [task_name(env, algo) for env, algo in used],
            "normalisation": {task_name(env, algo): norms[(env, algo)] for env, algo in tasks},
            "arms": arms, "scores": {label: x.tolist() for label, x in matrices.items()}}


def format_task_table(stats: Sequence[Mapping[str, Any]], reference: str) -> str:
    """Per arm: seeds, then per metric IQM, mean and P(> reference), each with its 95% CI."""
    metrics = [(m, name) for m, name in METRICS if any(m in s for s in stats)]
    head = ["scaler"]
    for _, name in metrics:
        head += [f"{name}: seeds", f"{name}: IQM (95% CI)", f"{name}: mean (95% CI)",
                 f"{name}: P(> {reference}) (95% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for s in stats:
        cells = [s["label"]]
        for metric, _ in metrics:
            m = s.get(metric)
            cells += ([str(m["seeds"]), format_estimate(m["IQM"], ".1f"), format_estimate(m["mean"], ".1f"),
                       format_estimate(m["improvement"], ".2f")] if m else ["0", "-", "-", "-"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_across_table(per_metric: Sequence[Mapping[str, Any]], reference: str) -> str:
    """Per arm and metric: seeds on every task, normalised IQM, mean and P(> reference)."""
    head = ["scaler", "score", "seeds (each task)", "IQM (95% CI)", "mean (95% CI)", f"P(> {reference}) (95% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    names = dict(METRICS)
    for agg in per_metric:
        for a in agg["arms"]:
            lines.append(f"| {a['label']} | {names[agg['metric']]} | {a['seeds']} | {format_estimate(a['IQM'], '.2f')} "
                         f"| {format_estimate(a['mean'], '.2f')} | {format_estimate(a['improvement'], '.2f')} |")
    return "\n".join(lines)


def format_normalisation(per_metric: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per task and metric: its start and best arm, or why it is left out."""
    names = dict(METRICS)
    out = []
    for agg in per_metric:
        for task, n in agg["normalisation"].items():
            if "reason" in n:
                out.append(f"- {task}, {names[agg['metric']]}: left out ({n['reason']}).")
            else:
                out.append(f"- {task}, {names[agg['metric']]}: 0 = {n['start']:.1f} (round-0 evaluation), "
                           f"1 = {n['best']:.1f} (`{n['best_label']}`'s mean).")
    return out


STATISTICS_NOTE = (
    "IQM and mean: rliable (Agarwal et al. 2021). The IQM is the mean of the middle half of the seeds' "
    "scores (a 25% trimmed mean), steadier than the mean against one seed's outlier and less wasteful "
    "than the median; the mean is the mean over tasks of each task's mean over seeds. Their 95% CIs are "
    "stratified percentile bootstraps ({reps:,} resamples of the seeds, within each task). "
    "P(> {reference}) is the probability of improvement: the chance that a seed of the row's scaler "
    "scores above a seed of `{reference}` on the same task (Mann-Whitney U over all pairs, a tie "
    "counting half), 0.5 for arms alike, averaged over tasks; its CI resamples each arm's seeds on "
    "their own. Late return: the mean of a run's last {late} evaluations; final return: its last "
    "evaluation; area under return vs spend: the evaluation returns integrated over the money spent "
    "and divided by the budget (the mean return the money bought along the way). Finished runs only; "
    "an interval needs at least {min_runs} seeds.")


def statistics_note(reference: str, late_evaluations: int, reps: int = BOOTSTRAP_REPS) -> str:
    return STATISTICS_NOTE.format(reference=reference, late=late_evaluations, reps=reps, min_runs=MIN_RUNS_FOR_CI)


# A README's generated statistics sit between these two lines (HTML comments: unseen once rendered),
# so that ``nitro experiment report`` can rewrite them in a README whose other text was edited by hand.
BLOCK_BEGIN = "<!-- rliable statistics: {name} (`nitro experiment report DIR` rewrites this block) -->"
BLOCK_END = "<!-- end of rliable statistics -->"
ACROSS_BLOCK = "across tasks"


def task_name(env: str, algo: str) -> str:
    """A task as the report's headings, tables and statistics name it."""
    return f"{env} · {algo}"


def statistics_block(name: str, lines: Sequence[str]) -> list[str]:
    """``lines`` (Markdown, the last one blank) between the block's markers, as README lines."""
    return [BLOCK_BEGIN.format(name=name), "", *lines, BLOCK_END, ""]


def format_best_of(against: Sequence[Mapping[str, Any]], grid: Sequence[str], reps: int = BOOTSTRAP_REPS) -> list[str]:
    """The table of ``best_of_grid``'s records, with the sentence that says how to read it."""
    names = dict(METRICS)
    lines = [f"Against the best of the grid ({', '.join(f'`{g}`' for g in grid)}), the bar: per score, the grid "
             "entry with the highest mean on this task, chosen after the fact (which favours the grid). The ratio "
             "is the row's mean over the seeds both finished divided by the best's, with a paired percentile-"
             f"bootstrap 95% CI (arch's `IIDBootstrap`, {reps:,} resamples of the seeds as pairs); the per-seed "
             "ratios in seed order; P(> best) as above, against the best's seeds.", "",
             "| scaler | score | best of the grid (mean) | seeds | ratio (95% CI) | per-seed ratios | "
             "P(> best) (95% CI) |", "|---|---|---|---|---|---|---|"]
    for r in against:
        per_seed = ", ".join(f"{x:.2f}" if finite(x) else "-" for x in r["per_seed"])
        lines.append(f"| {r['label']} | {names[r['metric']]} | `{r['best']}` ({r['best_mean']:.1f}) | "
                     f"{len(r['seeds'])} | {format_ratio(r['ratio'])} | {per_seed} | "
                     f"{format_estimate(r['improvement'], '.2f')} |")
    return [*lines, ""]


def task_block(env: str, algo: str, stats: Sequence[Mapping[str, Any]], reference: str, late_evaluations: int,
               reps: int = BOOTSTRAP_REPS, *, against: Sequence[Mapping[str, Any]] = (),
               grid: Sequence[str] = ()) -> list[str]:
    """One task's statistics block: the note on how they are computed, the per-arm table, and where
    the spec names a grid (``best_of``), each other arm against the grid's best."""
    lines = [statistics_note(reference, late_evaluations, reps), "", format_task_table(stats, reference), ""]
    if against:
        lines += format_best_of(against, grid, reps)
    return statistics_block(task_name(env, algo), lines)


def task_scores(rows: Sequence[Mapping[str, Any]], env: str, algo: str, labels: Sequence[str], reference: str,
                grid: Sequence[str], *, reps: int = BOOTSTRAP_REPS
                ) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """One task's statistics block (README lines), its ``task_statistics`` and, where ``grid`` names
    one, its ``best_of_grid`` records; all empty where no arm finished a run on the task."""
    stats = task_statistics(rows, env, algo, labels, reference, reps=reps)
    if not stats:
        return [], [], []
    against = best_of_grid(rows, env, algo, labels, grid, reps=reps) if grid else []
    return task_block(env, algo, stats, reference, LATE_EVALUATIONS, reps, against=against, grid=grid), stats, against


def across_section(rows: Sequence[Mapping[str, Any]], tasks: Sequence[tuple[str, str]], labels: Sequence[str],
                   reference: str, out_dir: str | Path, *, reps: int = BOOTSTRAP_REPS,
                   profile_reps: int = PROFILE_REPS, seed: int = BOOTSTRAP_SEED,
                   ) -> tuple[list[str], list[dict[str, Any]], Path | None]:
    """The report's across-tasks section (Markdown lines), its numbers per metric, and the
    performance-profile PNG written to ``out_dir`` (None where no task can be normalised)."""
    per_metric = [across_tasks(rows, tasks, labels, reference, m, reps=reps, seed=seed) for m, _ in metrics_of(rows)]
    md = ["## Across tasks (rliable)", "",
          "Each task's returns normalised as (return − start) / (best − start): start is the mean of the "
          "task's round-0 evaluations (the initialised policy, before any update; a seed's arms share its "
          "weights), best the highest scaler mean on the task for that score. So 0 is where training began "
          "and 1 the best scaler on the task. The constants are fixed, not resampled; a task without a "
          "round-0 evaluation, or where no scaler's mean beats the start, is left out. A scaler's seeds are "
          "those it finished on every task used. Per task, the tables above give the raw returns.", "",
          *format_normalisation(per_metric), ""]
    if not any(agg["arms"] for agg in per_metric):
        return [*md, "No task can be normalised yet: no aggregate and no performance profile.", ""], per_metric, None
    md += [format_across_table(per_metric, reference), ""]
    panels = {dict(METRICS)[agg["metric"]]: agg["scores"] for agg in per_metric if agg["scores"]}
    path = plot_performance_profiles(panels, Path(out_dir) / PROFILE_FILE, reps=profile_reps, seed=seed,
                                     title=f"Performance profiles over {len(per_metric[0]['tasks'])} task(s) "
                                           "(95% stratified-bootstrap bands)",
                                     xlabel="normalised score τ (0: round-0 policy, 1: best scaler)")
    md += ["Performance profiles: per threshold τ, the fraction of all runs (seeds × tasks) whose normalised "
           f"score is above τ, with 95% stratified-bootstrap bands ({profile_reps:,} resamples). A curve "
           "above another is better at every level of performance.", "", f"![performance-profile]({path.name})", ""]
    return md, per_metric, path
