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
- ``format_estimate``: an estimate and its interval as the reports print them.

What an experiment's report shows of its arms' scores, per task and across tasks, is
``nitro.experiments.scores``.

The IQM, mean and P(X > Y) point estimates are rliable's own functions, and so are the bootstraps.
Inside the bootstraps' loops (and for the profile's curve) numpy twins of those statistics and of
its score distribution stand in for its scipy and per-threshold calls, which cost ten to fifty
times as much per resample; tests/test_report_stats.py checks that the twins give the same numbers.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nitro.experiments.stats import finite

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


def format_estimate(e: Mapping[str, float] | None, fmt: str) -> str:
    """``value (lo to hi)``; says so where there are too few seeds for an interval."""
    if not e or not finite(e.get("value")):
        return "-"
    if not finite(e.get("lo")):
        return f"{e['value']:{fmt}} (no CI: under {MIN_RUNS_FOR_CI} seeds)"
    return f"{e['value']:{fmt}} ({e['lo']:{fmt}} to {e['hi']:{fmt}})"
