"""The field's statistics for an experiment's arms, through rliable (Agarwal et al. 2021, "Deep
Reinforcement Learning at the Edge of the Statistical Precipice"; github google-research/rliable).

A score matrix is (runs, tasks): seeds are the runs, the report's (env, algo) pairs the tasks.

- ``interval``: the interquartile mean (IQM: the mean of the middle half of all runs' scores) or
  the mean of per-task means, with rliable's stratified-bootstrap 95% CI: each task's runs are
  resampled with replacement within that task (tasks are the strata and are kept), percentile
  interval.
- ``improvement_probability``: P(X > Y) as rliable defines it: per task, the Mann-Whitney U of
  X's runs against Y's over runs_x x runs_y pairs (a tie counts half), averaged over tasks; its CI
  resamples each arm's runs on their own within each task (``StratifiedIndependentBootstrap``).
- ``performance_profiles``: per threshold tau, the fraction of all runs scoring above tau, with
  stratified-bootstrap 95% bands; ``plot_performance_profiles`` draws them with rliable's plotter.
- ``task_statistics``, ``across_tasks`` and ``across_section``: what the experiment report shows per
  task and arm and across tasks, for the late return (the mean of a run's last evaluations) and the
  final one.

The IQM, mean and P(X > Y) point estimates are rliable's own functions, and so are the bootstraps.
Inside the bootstraps' loops (and for the profile's curve) numpy twins of those statistics and of
its score distribution stand in for its scipy and per-threshold calls, which cost ten to fifty
times as much per resample; tests/test_report_stats.py checks that the twins give the same numbers.

Scores across tasks are on different scales, so the cross-task aggregates and the profile use
normalised scores (``normalisation``): 0 is where training started (the task's round-0
evaluation, the initialised policy, before any update) and 1 the best arm's mean on that task.
Per task, the raw returns are reported: there one scale serves every arm.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CONFIDENCE = 0.95
# Resamples per interval. rliable's own default is 50,000 for interval estimates; 5,000 puts a 95%
# bound's Monte-Carlo error (about 0.2 percentile points) well under the bootstrap's own width at
# these seed counts, and keeps a report of tens of intervals to seconds.
BOOTSTRAP_REPS = 5_000
PROFILE_REPS = 2_000  # rliable's default for performance profiles
BOOTSTRAP_SEED = 0
MIN_RUNS_FOR_CI = 3  # a bootstrap of 1-2 runs per task draws from 1-3 values: no interval at all
PROFILE_TAUS = 101


@dataclass(frozen=True)
class Estimate:
    """A point estimate and its 95% CI (NaN bounds where there are too few runs for one)."""

    value: float
    lo: float = math.nan
    hi: float = math.nan

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}


@contextlib.contextmanager
def _seeded_global_rng(seed: int) -> Iterator[None]:
    """rliable's stratified bootstraps draw their indices from numpy's global generator (their
    ``random_state`` reaches arch, not ``update_indices``): seeding it makes a report's intervals
    the same on every rebuild, and putting its state back leaves everyone else's draws alone."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def score_matrix(scores: Any) -> np.ndarray:
    """``scores`` as a float (runs, tasks) matrix; a 1-D sequence is one task's runs."""
    x = np.asarray(scores, dtype=float)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"scores must be a non-empty (runs, tasks) matrix, got shape {x.shape}")
    return x


def iqm(scores: Any) -> float:
    """The interquartile mean over all runs and tasks (rliable's ``aggregate_iqm``: scipy's 25%
    trimmed mean, which cuts int(n/4) scores off each end of the n sorted scores)."""
    from rliable import metrics

    return float(metrics.aggregate_iqm(score_matrix(scores)))


def mean(scores: Any) -> float:
    """The mean over tasks of each task's mean over runs (rliable's ``aggregate_mean``)."""
    from rliable import metrics

    return float(metrics.aggregate_mean(score_matrix(scores)))


def _iqm_fast(scores: np.ndarray) -> float:
    """``iqm`` to the last bit (scipy's trim_mean: cut int(n/4) sorted scores off each end, average
    the rest) in a tenth of its time: the bootstrap calls it once per resample."""
    flat = np.sort(scores, axis=None)
    cut = int(0.25 * flat.size)
    return float(flat[cut:flat.size - cut].mean())


def _mean_fast(scores: np.ndarray) -> float:
    return float(scores.mean(axis=0).mean())


def _improvement_fast(x: np.ndarray, y: np.ndarray) -> float:
    """rliable's ``probability_of_improvement`` without a scipy call per task: per task, the share of
    the runs_x x runs_y pairs that X wins, a tie counting half (which is Mann-Whitney's U over
    runs_x x runs_y, and 0.5 for identical arms by symmetry), averaged over tasks. The same number
    (tests/test_report_stats.py compares them), about 50 times faster inside the bootstrap's loop."""
    diff = x[:, None, :] - y[None, :, :]
    return float(((diff > 0).mean(axis=(0, 1)) + 0.5 * (diff == 0).mean(axis=(0, 1))).mean())


AGGREGATES: dict[str, Callable[[Any], float]] = {"IQM": iqm, "mean": mean}
# What the bootstrap evaluates per resample: the same statistics, on numpy alone.
_RESAMPLED: dict[str, Callable[[np.ndarray], float]] = {"IQM": _iqm_fast, "mean": _mean_fast}


def interval(scores: Any, statistic: str = "IQM", *, reps: int = BOOTSTRAP_REPS,
             seed: int = BOOTSTRAP_SEED) -> Estimate:
    """``statistic`` (``IQM`` or ``mean``) of a (runs, tasks) matrix with rliable's
    stratified-bootstrap 95% percentile CI; the bounds are NaN under ``MIN_RUNS_FOR_CI`` runs."""
    from rliable import library

    x = score_matrix(scores)
    point = AGGREGATES[statistic](x)
    if x.shape[0] < MIN_RUNS_FOR_CI:
        return Estimate(point)
    resampled = _RESAMPLED[statistic]
    with _seeded_global_rng(seed):
        _, cis = library.get_interval_estimates({"arm": x}, lambda m: np.array([resampled(m)]), reps=reps,
                                                confidence_interval_size=CONFIDENCE)
    lo, hi = (float(v) for v in np.asarray(cis["arm"]).reshape(2))
    return Estimate(point, lo, hi)


def improvement_probability(x: Any, y: Any, *, reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> Estimate:
    """P(X > Y) (rliable's ``probability_of_improvement``) of two (runs, tasks) matrices over the
    same tasks, their run counts free to differ, with a 95% CI from resampling each arm's runs on
    their own within each task; NaN bounds where either arm has under ``MIN_RUNS_FOR_CI`` runs."""
    from rliable import library, metrics

    a, b = score_matrix(x), score_matrix(y)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"the arms cover different numbers of tasks: {a.shape[1]} and {b.shape[1]}")

    def func(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        return np.array([_improvement_fast(p, q)])

    point = float(metrics.probability_of_improvement(a, b))
    if min(a.shape[0], b.shape[0]) < MIN_RUNS_FOR_CI:
        return Estimate(point)
    with _seeded_global_rng(seed):
        _, cis = library.get_interval_estimates({"pair": [a, b]}, func, reps=reps,
                                                confidence_interval_size=CONFIDENCE)
    lo, hi = (float(v) for v in np.asarray(cis["pair"]).reshape(2))
    return Estimate(point, lo, hi)


def profile_taus(scores: Mapping[str, Any], n: int = PROFILE_TAUS) -> np.ndarray:
    """Thresholds from min(0, lowest score) to max(1, highest score): the normalised scale's 0 and
    1 always on the axis."""
    values = np.concatenate([score_matrix(s).ravel() for s in scores.values()])
    return np.linspace(min(0.0, float(values.min())), max(1.0, float(values.max())), n)


def performance_profiles(scores: Mapping[str, Any], taus: np.ndarray, *, reps: int = PROFILE_REPS,
                         seed: int = BOOTSTRAP_SEED) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per arm, the fraction of its runs (over all tasks) scoring above each tau (rliable's score
    distribution), and its stratified-bootstrap 95% band as a (2, len(taus)) array."""
    from rliable import library

    with _seeded_global_rng(seed):
        profiles, cis = library.create_performance_profile({k: score_matrix(v) for k, v in scores.items()},
                                                           taus, custom_profile_func=_score_distribution,
                                                           reps=reps, confidence_interval_size=CONFIDENCE)
    return dict(profiles), dict(cis)


def _score_distribution(scores: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """rliable's score distribution (its ``score_distributions``: per tau, the mean of scores > tau
    over all runs and tasks) as one array comparison instead of a Python call per tau."""
    return (np.asarray(scores).reshape(-1, 1) > np.asarray(taus).reshape(1, -1)).mean(axis=0)


def plot_performance_profiles(panels: Mapping[str, Mapping[str, Any]], path: str | Path, *, title: str,
                              xlabel: str, reps: int = PROFILE_REPS, seed: int = BOOTSTRAP_SEED) -> Path:
    """One PNG: per panel (e.g. per metric) the arms' performance profiles with their 95% bands,
    drawn by rliable's ``plot_performance_profiles``, the arms in one colour each across panels."""
    import matplotlib

    matplotlib.use("Agg", force=False)  # as nitro.tracking.plots: no display needed
    import matplotlib.pyplot as plt
    from rliable import plot_utils

    path = Path(path)
    arms = list(dict.fromkeys(arm for scores in panels.values() for arm in scores))
    colours = dict(zip(arms, itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.5), squeeze=False)
    for ax, (name, scores) in zip(axes[0], panels.items()):
        taus = profile_taus(scores)
        profiles, cis = performance_profiles(scores, taus, reps=reps, seed=seed)
        plot_utils.plot_performance_profiles(profiles, taus, performance_profile_cis=cis, ax=ax,
                                             colors={a: colours[a] for a in profiles}, xlabel=xlabel,
                                             ylabel="fraction of runs with score > τ", labelsize="medium",
                                             ticklabelsize="medium")
        ax.set_title(name)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- what the experiment report shows ---------------------------------------------------------------

METRICS: tuple[tuple[str, str], ...] = (("late_return", "late return"), ("final_return", "final return"))
PROFILE_FILE = "performance-profile.png"


def _finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def start_return(history: Sequence[Mapping[str, Any]]) -> float:
    """The run's round-0 evaluation return: its initialised policy, before any update (every arm
    of a seed starts from the same weights); NaN where round 0 did not evaluate."""
    for h in history:
        if int(h["round"]) == 0 and _finite(h.get("eval_return_mean")):
            return float(h["eval_return_mean"])
    return math.nan


def _by_seed(rows: Sequence[Mapping[str, Any]], env: str, algo: str, label: str, metric: str) -> dict[int, float]:
    """{seed: score} of the arm's finished runs on the task that have the metric."""
    return {int(r["seed"]): float(r[metric]) for r in rows
            if (r["env"], r["algo"], r["label"]) == (env, algo, label) and r.get("status", "FINISHED") == "FINISHED"
            and _finite(r.get(metric))}


def _vector(scores: Mapping[int, float]) -> np.ndarray:
    return np.array([scores[s] for s in sorted(scores)], dtype=float)


def task_statistics(rows: Sequence[Mapping[str, Any]], env: str, algo: str, labels: Sequence[str], reference: str,
                    *, reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> list[dict[str, Any]]:
    """Per arm with finished runs on the task, for the late and the final return: the IQM and the
    mean over seeds of the raw returns, and P(arm > ``reference``), each with its 95% CI."""
    out = []
    ref = {m: _by_seed(rows, env, algo, reference, m) for m, _ in METRICS}
    for label in labels:
        entry: dict[str, Any] = {"env": env, "algo": algo, "label": label}
        for metric, _ in METRICS:
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
        if any(m in entry for m, _ in METRICS):
            out.append(entry)
    return out


def normalisation(rows: Sequence[Mapping[str, Any]], env: str, algo: str, labels: Sequence[str],
                  metric: str) -> dict[str, Any]:
    """The task's constants for (score - start) / (best - start): ``start`` the mean of its runs'
    round-0 evaluations, ``best`` the highest arm mean of ``metric``; or ``reason`` why the task
    cannot be normalised (no round-0 evaluation, or no arm's mean above the start)."""
    task = [r for r in rows if (r["env"], r["algo"]) == (env, algo)]
    starts = [float(r["start_return"]) for r in task if _finite(r.get("start_return"))]
    means = {lab: float(np.mean(list(s.values()))) for lab in labels
             if (s := _by_seed(rows, env, algo, lab, metric))}
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


def format_estimate(e: Mapping[str, float] | None, fmt: str) -> str:
    """``value (lo to hi)``; says so where there are too few seeds for an interval."""
    if not e or not _finite(e.get("value")):
        return "-"
    if not _finite(e.get("lo")):
        return f"{e['value']:{fmt}} (no CI: under {MIN_RUNS_FOR_CI} seeds)"
    return f"{e['value']:{fmt}} ({e['lo']:{fmt}} to {e['hi']:{fmt}})"


def format_task_table(stats: Sequence[Mapping[str, Any]], reference: str) -> str:
    """Per arm: seeds, then per metric IQM, mean and P(> reference), each with its 95% CI."""
    head = ["scaler"]
    for _, name in METRICS:
        head += [f"{name}: seeds", f"{name}: IQM (95% CI)", f"{name}: mean (95% CI)",
                 f"{name}: P(> {reference}) (95% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for s in stats:
        cells = [s["label"]]
        for metric, _ in METRICS:
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
    "evaluation. Finished runs only; an interval needs at least {min_runs} seeds.")


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


def task_block(env: str, algo: str, stats: Sequence[Mapping[str, Any]], reference: str, late_evaluations: int,
               reps: int = BOOTSTRAP_REPS) -> list[str]:
    """One task's statistics block: the note on how they are computed, then the per-arm table."""
    return statistics_block(task_name(env, algo), [statistics_note(reference, late_evaluations, reps), "",
                                                   format_task_table(stats, reference), ""])


def across_section(rows: Sequence[Mapping[str, Any]], tasks: Sequence[tuple[str, str]], labels: Sequence[str],
                   reference: str, out_dir: str | Path, *, reps: int = BOOTSTRAP_REPS,
                   profile_reps: int = PROFILE_REPS, seed: int = BOOTSTRAP_SEED,
                   ) -> tuple[list[str], list[dict[str, Any]], Path | None]:
    """The report's across-tasks section (Markdown lines), its numbers per metric, and the
    performance-profile PNG written to ``out_dir`` (None where no task can be normalised)."""
    per_metric = [across_tasks(rows, tasks, labels, reference, m, reps=reps, seed=seed) for m, _ in METRICS]
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
