"""PNG plots of training runs (matplotlib, Agg backend; no display needed): one run's return,
actors and spend per round, and several runs grouped (e.g. by scaler) as the mean over seeds with
a 95% confidence band, against round or cumulative spend.

Inputs are per-round rows: dicts keyed by the metric names of ``nitro.tracking.metrics``
(``round``, ``eval_return_mean``, ``spend_total_usd``, ...). Missing keys or NaN values are skipped.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

__all__ = [
    "mean_ci95",
    "plot_actors",
    "plot_group_bars",
    "plot_group_curves",
    "plot_return",
    "plot_spend",
    "series",
    "write_run_plots",
]

Rows = Sequence[Mapping[str, Any]]

# Two-sided 97.5% Student-t quantiles for df = 1..30 (beyond that the normal 1.96 is close).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)


def _t975(df: int) -> float:
    if df <= 0:
        return float("nan")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t confidence interval); half-width is NaN for one value."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    if x.size == 1:
        return float(x[0]), float("nan")
    sem = x.std(ddof=1) / math.sqrt(x.size)
    return float(x.mean()), float(_t975(x.size - 1) * sem)


def finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def series(rows: Rows, y_key: str, x_key: str = "round") -> tuple[np.ndarray, np.ndarray]:
    """(x, y) arrays of the rows where both values are finite, sorted by x."""
    pts = [
        (float(r.get(x_key, i)), float(r[y_key]))
        for i, r in enumerate(rows)
        if y_key in r and finite(r[y_key]) and (x_key not in r or finite(r[x_key]))
    ]
    pts.sort()
    if not pts:
        return np.empty(0), np.empty(0)
    x, y = zip(*pts)
    return np.asarray(x), np.asarray(y)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for ax in fig.axes:
        if ax.get_xlabel() == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def _save_with_legend(fig, ax, path: str | Path) -> Path:
    """``_save``, with ``ax``'s legend where it has labelled series (a plot with no data has none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return _save(fig, path)


def plot_return(rows: Rows, path: str | Path, title: str = "Episodic return per round") -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("eval_return_mean", "evaluation, mean action", "-"),
                              ("eval_stochastic_return_mean", "evaluation, sampled actions", "-."),
                              ("train_return_mean", "training episodes", ":")):
        x, y = series(rows, key)
        if x.size:
            ax.plot(x, y, style, marker="o", markersize=3, label=label)
    ax.set(xlabel="round", ylabel="episodic return", title=title)
    ax.grid(alpha=0.3)
    return _save_with_legend(fig, ax, path)


def plot_actors(rows: Rows, path: str | Path, title: str = "Actors per round") -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    x, launched = series(rows, "actors_launched")
    if x.size:
        ax.bar(x, launched, width=0.8, label="launched", color="tab:blue")
    xf, failed = series(rows, "actors_failed")
    if xf.size and np.any(failed > 0):
        ax.bar(xf, failed, width=0.8, label="failed", color="tab:red")
    ax.set(xlabel="round", ylabel="actors", title=title)
    ax.grid(alpha=0.3, axis="y")
    return _save_with_legend(fig, ax, path)


def plot_spend(rows: Rows, path: str | Path, title: str = "Spend per round (USD)") -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    x, per_round = series(rows, "spend_round_usd")
    if x.size:
        ax.bar(x, per_round, width=0.8, color="tab:orange", label="round")
    ax.set(xlabel="round", ylabel="USD per round", title=title)
    ax.grid(alpha=0.3, axis="y")
    xt, total = series(rows, "spend_total_usd")
    if not xt.size and x.size:
        xt, total = x, np.cumsum(per_round)
    handles, labels = ax.get_legend_handles_labels()
    if xt.size:
        ax2 = ax.twinx()
        ax2.plot(xt, total, "-", color="tab:green", marker="o", markersize=3, label="cumulative")
        ax2.set_ylabel("USD cumulative")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper left")
    return _save(fig, path)


def write_run_plots(rows: Rows, out_dir: str | Path, title_prefix: str = "") -> dict[str, Path]:
    """return.png, actors.png, spend.png in ``out_dir``; returns {name: path}."""
    out = Path(out_dir)
    p = f"{title_prefix}: " if title_prefix else ""
    return {
        "return": plot_return(rows, out / "return.png", f"{p}episodic return per round"),
        "actors": plot_actors(rows, out / "actors.png", f"{p}actors per round"),
        "spend": plot_spend(rows, out / "spend.png", f"{p}spend per round (USD)"),
    }


# -- several runs: mean ± 95% CI over seeds ---------------------------------------------------


def _aligned(runs: Sequence[Rows], x_key: str, y_key: str, grid_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack the runs' y on a common x. Rounds: their union (NaN where a run has none).
    Anything else (e.g. cumulative spend): linear interpolation on a grid up to the smallest
    of the runs' last x, so every point averages over all runs."""
    curves = [series(r, y_key, x_key) for r in runs]
    curves = [(x, y) for x, y in curves if x.size]
    if not curves:
        return np.empty(0), np.empty((0, 0))
    if x_key == "round":
        grid = np.unique(np.concatenate([x for x, _ in curves]))
        ys = np.full((len(curves), grid.size), np.nan)
        for i, (x, y) in enumerate(curves):
            ys[i, np.searchsorted(grid, x)] = y
        return grid, ys
    lo = max(x[0] for x, _ in curves)
    hi = min(x[-1] for x, _ in curves)
    if hi <= lo:
        hi = max(x[-1] for x, _ in curves)
    grid = np.linspace(lo, hi, grid_points)
    ys = np.vstack([np.interp(grid, x, y, left=np.nan, right=np.nan) for x, y in curves])
    return grid, ys


def plot_group_curves(
    groups: Mapping[str, Sequence[Rows]],
    path: str | Path,
    *,
    x_key: str = "round",
    y_key: str = "eval_return_mean",
    title: str = "",
    xlabel: str | None = None,
    ylabel: str | None = None,
    grid_points: int = 100,
) -> Path:
    """Per group (label -> list of runs' rows, one per seed): mean curve with a 95% CI band.

    ``x_key="spend_total_usd"`` gives return against cumulative spend; ``y_key="actors_launched"``
    gives actors per round.
    """
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, runs in groups.items():
        grid, ys = _aligned(runs, x_key, y_key, grid_points)
        if not grid.size:
            continue
        ys = np.where(np.isfinite(ys), ys, np.nan)
        n = np.sum(np.isfinite(ys), axis=0)
        with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns / one run
            mean = np.nanmean(ys, axis=0)
            sd = np.nanstd(ys, axis=0, ddof=1)
            half = np.array([_t975(int(k) - 1) for k in n]) * sd / np.sqrt(np.maximum(n, 1))
        (line,) = ax.plot(grid, mean, label=f"{label} (n={len(runs)})")
        ok = np.isfinite(half)
        if ok.any():
            ax.fill_between(grid[ok], (mean - half)[ok], (mean + half)[ok], alpha=0.2, color=line.get_color())
    ax.set(
        xlabel=xlabel or x_key.replace("_", " "),
        ylabel=ylabel or y_key.replace("_", " "),
        title=title or f"{y_key} vs {x_key} (mean ± 95% CI over seeds)",
    )
    ax.grid(alpha=0.3)
    return _save_with_legend(fig, ax, path)


def plot_group_bars(
    values: Mapping[str, Sequence[float]], path: str | Path, *, title: str = "", ylabel: str = ""
) -> Path:
    """One bar per group: mean with a 95% CI error bar (e.g. final return per scaler)."""
    labels = list(values)
    stats = [mean_ci95(values[k]) for k in labels]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(labels) + 2), 4))
    means = [m for m, _ in stats]
    errs = [0.0 if not np.isfinite(h) else h for _, h in stats]
    ax.bar(range(len(labels)), means, yerr=errs, capsize=5, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_probe(rows: Rows, path: str | Path, x_key: str, x_label: str, name: str) -> Path:
    """The boostability probe (nitro.experiments.probe): each branch round's gain of boosting against its
    signal, both evaluation modes, one point per (seed, round), labelled with the round."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, marker in (("gain", "gain, mean action", "o"), ("gain_stochastic", "gain, sampled actions", "^")):
        pts = [(float(r[x_key]), float(r[key]), r["round"]) for r in rows
               if finite(r.get(x_key)) and finite(r.get(key))]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label, alpha=0.8)
            if key == "gain":
                for x, y, k in pts:
                    ax.annotate(f"k={k}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set(xlabel=x_label, ylabel="evaluation return, boost - plain", title=f"Gain of boosting vs {name}")
    ax.grid(alpha=0.3)
    return _save_with_legend(fig, ax, path)


def plot_probe_trunk(histories: Mapping[int, Rows], branch_rounds: Sequence[int], path: str | Path) -> Path:
    """R per round of each probe trunk (one line per seed), the branch rounds marked."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, rows in sorted(histories.items()):
        x, y = series(rows, "hessian_R")
        if x.size:
            ax.plot(x, y, marker="o", markersize=3, label=f"trunk, seed {seed}")
    for k in branch_rounds:
        ax.axvline(k, color="grey", lw=0.6, ls=":")
    ax.set(xlabel="round", ylabel="R = |lambda_min / lambda_max|", title="R over the trunk (dotted: branch rounds)")
    ax.grid(alpha=0.3)
    return _save_with_legend(fig, ax, path)
