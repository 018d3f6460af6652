"""The training simulator fitted from logged runs (``nitro minionsrl pretrain --fit-from``).

The rows are an experiment report's ``rounds.csv`` (docs/results/hopper-lambda/rounds.csv): one
per round of each run, with ``run_name``, ``round``, ``train_return_mean`` (the training return of
the episodes that ended in the round; NaN where none did; ``return_mean`` in reports written before
evaluations had their own column), ``actors_launched``, ``env_steps_total`` and ``round_s``. From
them:

* the return a round gains: ``train_return_mean[k + 1] - train_return_mean[k]`` within a run,
  paired with the actors of round ``k`` (whose trajectories the update of round ``k`` trained on);
  the simulator's Gaussian bump is fitted to the pairs by least squares, a grid over
  ``peak_actors`` (inside the observed actor range) and ``width`` with the closed-form best
  ``peak_gain`` at each, because the logged gains are noisy enough that a gradient fit wanders off
  to a spike on a few points;
* ``noise``: the residuals' RMS over the fitted gain's RMS, the simulator's multiplicative noise
  measured where the gains are, so that actor counts far from the peak do not blow it up;
* ``learner_fixed_s`` and ``learner_s_per_sample``: a least-squares line of ``round_s`` against the
  round's samples (the difference of ``env_steps_total``), clipped to >= 0.
"""

from __future__ import annotations

import csv
import gzip
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nitro.config.minionsrl import SimulatorConfig

MIN_PAIRS = 5


@dataclass(frozen=True)
class FitReport:
    """What the fit used and gave."""

    pairs: int  # (actors, gain) pairs the bump was fitted to
    runs: int  # runs that gave at least one pair
    rmse: float  # of the fitted gain against the pairs' gains
    peak_actors: float
    peak_gain: float
    width: float
    noise: float
    timed_rounds: int  # rounds with a round_s that the time line was fitted to (0: the base's times kept)
    learner_fixed_s: float
    learner_s_per_sample: float

    def summary(self) -> str:
        return (f"fitted on {self.pairs} round gains of {self.runs} runs: peak {self.peak_actors:.1f} actors, "
                f"gain {self.peak_gain:.2f}, width {self.width:.1f}, noise {self.noise:.2f} (rmse {self.rmse:.2f}); "
                f"learner {self.learner_fixed_s:.3f} s + {self.learner_s_per_sample:.2e} s/sample "
                f"({self.timed_rounds} rounds)")


def read_rounds(path: str | Path) -> list[dict[str, str]]:
    """The rows of a ``rounds.csv`` (or of a large report's ``rounds.csv.gz``); ValueError (one line)
    when it is missing."""
    try:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "rt", newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        raise ValueError(f"no rounds file at {path} (an experiment report's rounds.csv)") from None


def fit_simulator(rows: Iterable[Mapping[str, Any]], base: SimulatorConfig) -> tuple[SimulatorConfig, FitReport]:
    """``base`` with the gain curve, noise and learner times fitted from logged rounds (module
    docstring); ValueError (one line) when the rows cannot support a bump."""
    runs: dict[str, list[tuple[int, float, float, float, float]]] = {}
    for row in rows:
        k = _num(row.get("round"))
        if not math.isfinite(k):
            continue
        runs.setdefault(str(row.get("run_name", "")), []).append((int(k), _train_return(row),
                                         _num(row.get("actors_launched")), _num(row.get("env_steps_total")),
                                         _num(row.get("round_s"))))
    actors: list[float] = []
    gains: list[float] = []
    samples: list[float] = []
    seconds: list[float] = []
    used_runs = 0
    for series in runs.values():
        series.sort()
        before = len(gains)
        prev_steps = 0.0
        for i, (k, ret, n, steps, round_s) in enumerate(series):
            if math.isfinite(steps) and math.isfinite(round_s) and steps >= prev_steps:
                samples.append(steps - prev_steps)
                seconds.append(round_s)
            prev_steps = steps if math.isfinite(steps) else prev_steps
            # A round without actors gains nothing the simulator can be asked for (it runs >= 1).
            if i + 1 < len(series) and series[i + 1][0] == k + 1 and math.isfinite(n) and n >= 1:
                nxt = series[i + 1][1]
                if math.isfinite(ret) and math.isfinite(nxt):
                    actors.append(n)
                    gains.append(nxt - ret)
        used_runs += len(gains) > before
    if len(gains) < MIN_PAIRS:
        raise ValueError(f"too few round gains to fit the simulator: {len(gains)} (need {MIN_PAIRS}: consecutive "
                         "rounds of a run with a finite train_return_mean and actors_launched >= 1)")
    x, y = np.asarray(actors, np.float64), np.asarray(gains, np.float64)
    if not np.any(y > 0):
        raise ValueError(f"no round of the {len(y)} gained return: a bump with a positive peak cannot be fitted")
    peak, gain, width, rmse = _fit_bump(x, y)
    fitted = gain * np.exp(-(((x - peak) / width) ** 2))
    noise = float(np.sqrt(np.mean((y - fitted) ** 2) / max(float(np.mean(fitted ** 2)), 1e-12)))
    fixed_s, per_sample = base.learner_fixed_s, base.learner_s_per_sample
    if len(seconds) >= 2 and np.ptp(samples) > 0:
        slope, intercept = np.polyfit(np.asarray(samples, np.float64), np.asarray(seconds, np.float64), 1)
        fixed_s, per_sample = max(0.0, float(intercept)), max(0.0, float(slope))
    else:
        seconds = []
    config = base.model_copy(update={"peak_actors": peak, "peak_gain": gain, "width": width, "noise": noise,
                                     "learner_fixed_s": fixed_s, "learner_s_per_sample": per_sample})
    report = FitReport(len(y), used_runs, rmse, peak, gain, width, noise, len(seconds), fixed_s, per_sample)
    return SimulatorConfig.model_validate(config.model_dump()), report


def _fit_bump(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    """Least squares of ``g exp(-((x - p) / w)^2)``: p on a grid over [min x, max x], w on a
    geometric grid from a quarter actor to four times the range (a flat curve where the data has
    no peak), g in closed form (sum y f / sum f^2, at least 0) at each."""
    lo, hi = float(x.min()), float(x.max())
    span = max(hi - lo, 1.0)
    peaks = np.linspace(lo, hi, 161) if hi > lo else np.array([lo])
    widths = np.geomspace(0.25, 4.0 * span, 160)
    best = (math.inf, lo, 0.0, float(widths[-1]))
    for peak in peaks:  # one peak at a time keeps the (widths x pairs) array small
        f = np.exp(-(((x[None, :] - peak) / widths[:, None]) ** 2))
        g = np.maximum((f * y).sum(-1) / np.maximum((f * f).sum(-1), 1e-300), 0.0)
        sse = ((g[:, None] * f - y) ** 2).sum(-1)
        j = int(np.argmin(sse))
        if sse[j] < best[0]:
            best = (float(sse[j]), float(peak), float(g[j]), float(widths[j]))
    sse_min, peak, gain, width = best
    return peak, gain, width, math.sqrt(sse_min / len(y))


def _train_return(row: Mapping[str, Any]) -> float:
    """The round's training return: ``train_return_mean``, or ``return_mean`` in older reports."""
    return _num(row["train_return_mean"] if "train_return_mean" in row else row.get("return_mean"))


def _num(value: Any) -> float:
    """A csv cell as a float: empty or unreadable is NaN."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
