"""``goodput``: each round's actor count from the measured gradient noise scale and the run's own
prices (Pollux's goodput, Qiao et al. 2021, per dollar; AdaptDL's ``adaptdl/goodput.py``).

A round of N actors brings B = N x steps_per_actor samples; as one step on B samples it makes
B / (B + phi) of an infinite batch's progress (McCandlish et al. 2018; phi from
``nitro.scaling.noise``, the policy loss's, in samples). It costs C(N) = c0 + c1 N dollars and
takes T(N) = s0 + s1 N seconds (``nitro.scaling.prices``, fitted from the run's ledger). The
scaler picks, among the counts in [I_min, I_max],

    objective money:  the N maximising  B / ((B + phi) C(N))      progress per dollar
    objective time:   the N maximising  B / ((B + phi) T(N))      progress per second

Per dollar the optimum is near B* = sqrt(phi c0 / c1): only a round's fixed cost makes more
samples pay, and a growing phi moves the optimum up late in a run. The scaler keeps its count
unless the best one is predicted to beat it by more than ``switch_gain`` (5%, AdaptDL's threshold
against flapping). Until the learner has measured ``MIN_MEASUREMENTS`` rounds it keeps I_min, and says so.
The budget cap is the engine's, after the scaler, as for every scaler.

Every decision records phi (policy and value), c0, c1, s0, s1, how the prices were determined,
the best count, the predicted gain of the chosen count over I_min and of the best over the
current, and the reason: ``round_metrics`` gives them to MLflow as ``goodput/*`` per round, and
``round_tags`` one line per switch. With ``scale_step`` the scaler also offers AdaScale's gain r
for a batch against I_min's (``step_gain``), the factor a learner may scale its step by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nitro.config import ScalerConfig
from nitro.scaling.base import RoundSignal, Scaler, clip_count
from nitro.scaling.noise import NoiseTracker, adascale_gain, efficiency
from nitro.scaling.prices import Line, PriceFit, PricePrior, fit_line

# Why a decision is what it is; the metric goodput/reason is the index.
NO_MEASUREMENT = "no noise measurement yet (the learner reports none): I_min"
BEST = "the current count is the best"
HELD = "held: the best count's predicted gain is under switch_gain"
SWITCHED = "switched to the best count"
WARMING_UP = "fewer than MIN_MEASUREMENTS rounds measured: I_min"
REASONS = (NO_MEASUREMENT, BEST, HELD, SWITCHED, WARMING_UP)
# Rounds of noise measurement before a decision reads phi: one round's |G|^2 is often a negative
# difference of noisy terms, clipped to phi's cap, and a Hopper run acted on such a first round
# with 64 actors (then 8 for the rest of the run, from a phi of 500-1500 samples).
MIN_MEASUREMENTS = 3
PRICE_SOURCES = ("prior", "level", "fit")


def progress_rate(n: int, phi: float, samples_per_actor: int, line: Line) -> float:
    """Predicted progress per unit of ``line`` (dollars or seconds) of a round of ``n`` actors."""
    return efficiency(n * samples_per_actor, phi) / max(line.at(n), 1e-300)


@dataclass(frozen=True)
class Choice:
    """One decision: the count asked for, the best count, and the predicted gains."""

    actors: int
    best: int
    gain_over_min: float  # predicted objective of ``actors`` over I_min's, minus 1
    gain_over_current: float  # predicted objective of ``best`` over the count held before, minus 1
    reason: str


def choose_count(current: int, phi: float, samples_per_actor: int, line: Line, lo: int, hi: int,
                 switch_gain: float) -> Choice:
    """The count to ask for: the best of [lo, hi] (the smallest where several tie) if it beats
    ``current`` by more than ``switch_gain``, else ``current`` (clipped to [lo, hi])."""
    current = clip_count(current, lo, hi)
    rates = {n: progress_rate(n, phi, samples_per_actor, line) for n in range(lo, hi + 1)}
    best = max(rates, key=lambda n: (rates[n], -n))
    gain = rates[best] / rates[current] - 1
    if best == current:
        actors, reason = current, BEST
    elif gain > switch_gain:
        actors, reason = best, SWITCHED
    else:
        actors, reason = current, HELD
    return Choice(actors, best, rates[actors] / rates[lo] - 1, gain, reason)


class GoodputScaler(Scaler):
    name = "goodput"

    def __init__(self, cfg: ScalerConfig, seed: int = 0, *, steps_per_actor: int, prior: PricePrior,
                 minibatches: Callable[[int], int] = lambda samples: 1):  # default: full-batch steps
        super().__init__(cfg, seed)
        self.steps_per_actor = int(steps_per_actor)
        self.minibatches = minibatches  # the learner's minibatches per epoch for a batch's samples
        self.prior = prior
        self.current = cfg.i_min
        self.policy = NoiseTracker(cfg.noise_decay)
        self.value = NoiseTracker(cfg.noise_decay)

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        cfg = self.cfg
        if signal.noise is not None:
            self.policy.update(signal.noise.policy)
            if signal.noise.value is not None:
                self.value.update(signal.noise.value)
        usd = fit_line(signal.ledger, self.prior.usd, "usd")
        seconds = fit_line(signal.ledger, self.prior.seconds, "seconds")
        noise, value = self.policy.estimate(), self.value.estimate()
        info: dict[str, Any] = {
            "measured": signal.noise is not None, "phi_value": value.phi if value else None,
            "c0_usd": usd.line.fixed, "c1_usd": usd.line.per_actor, "s0": seconds.line.fixed,
            "s1": seconds.line.per_actor, "prices": usd.source, "price_rounds": usd.rounds,
        }
        if noise is None or noise.measurements < MIN_MEASUREMENTS:
            self.current = cfg.i_min
            return self._record(round_idx, cfg.i_min, reason=NO_MEASUREMENT if noise is None else WARMING_UP,
                                phi=noise.phi if noise else None, best=None, gain_over_min=0.0,
                                gain_over_current=0.0, step_gain=1.0, **info)
        fit = usd if cfg.objective == "money" else seconds
        choice = choose_count(self.current, noise.phi, self.steps_per_actor, fit.line, cfg.i_min, cfg.i_max,
                              cfg.switch_gain)
        before, self.current = self.current, choice.actors
        return self._record(round_idx, choice.actors, reason=choice.reason, phi=noise.phi, phi_clipped=noise.clipped,
                            grad_sqnorm=noise.grad_sqnorm, trace_sigma=noise.trace_sigma, best=choice.best,
                            previous=before, gain_over_min=choice.gain_over_min,
                            gain_over_current=choice.gain_over_current, step_gain=self.step_gain(choice.actors),
                            line=_describe(fit, cfg.objective), **info)

    def step_gain(self, n_actors: int) -> float:
        """AdaScale's gain r for one step of an update over ``n_actors`` actors' batches against one
        of an update over I_min's, at the smoothed phi: the gain of the minibatch, the batch one
        step is on (``minibatches``: the learner's count for a batch's samples). With minibatches of
        a fixed size it is 1; with a fixed count (the constant-steps learner) a boosted round's
        bigger minibatches earn up to N / I_min. 1 with ``scale_step`` off or before a measurement."""
        noise = self.policy.estimate()
        if not self.cfg.scale_step or noise is None or n_actors < 1:
            return 1.0

        def minibatch(actors: int) -> float:
            samples = actors * self.steps_per_actor
            return samples / self.minibatches(samples)

        return adascale_gain(minibatch(n_actors), minibatch(self.cfg.i_min), noise.phi)

    def round_metrics(self, round_idx: int) -> dict[str, float]:
        last = self.last
        if last.get("round") != round_idx:
            return {}

        def num(key: str) -> float:
            v = last.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

        return {"goodput/phi": num("phi"), "goodput/phi_value": num("phi_value"),
                "goodput/c0_usd": num("c0_usd"), "goodput/c1_usd": num("c1_usd"), "goodput/s0": num("s0"),
                "goodput/s1": num("s1"), "goodput/best_actors": num("best"),
                "goodput/gain_over_min": num("gain_over_min"), "goodput/gain_over_current": num("gain_over_current"),
                "goodput/step_gain": num("step_gain"), "goodput/reason": float(REASONS.index(last["reason"])),
                "goodput/prices": float(PRICE_SOURCES.index(last["prices"])),
                "goodput/measured": float(bool(last.get("measured")))}

    def round_tags(self, round_idx: int) -> dict[str, str]:
        last = self.last
        if last.get("round") != round_idx or last.get("reason") != SWITCHED:
            return {}
        return {f"goodput.switch.round-{round_idx:05d}": (
            f"{last['previous']} -> {last['actors']} actors: predicted {last['gain_over_current']:+.1%} "
            f"progress per {'dollar' if self.cfg.objective == 'money' else 'second'} at phi {last['phi']:.4g} samples "
            f"({last['line']})")}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "current": self.current, "policy": self.policy.state_dict(),
                "value": self.value.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.current = int(state["current"])
        self.policy.load_state_dict(state["policy"])
        self.value.load_state_dict(state["value"])


def _describe(fit: PriceFit, objective: str) -> str:
    """The fitted line in one phrase, e.g. ``c0 $5e-05, c1 $2.6e-05 per actor, fit from 40 rounds``."""
    c, unit = ("c", "$") if objective == "money" else ("s", "s")
    return (f"{c}0 {unit}{fit.line.fixed:.3g}, {c}1 {unit}{fit.line.per_actor:.3g} per actor, "
            f"{fit.source} from {fit.rounds} rounds")
