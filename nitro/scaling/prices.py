"""What a round costs as a function of its actors, fitted from the run's own ledger.

A round with N actors costs about C(N) = c0 + c1 N dollars and takes about T(N) = s0 + s1 N
seconds on the run's clock: c0 what does not grow with the actors (the learner held while the
actors run, orchestration, a constant-steps update), c1 one actor's marginal cost, its invocation
and its share of the update that trains on its samples. In a sync round k the update trains on
round k-1's batches while round k's actors act, so the fit regresses each round's spend on both:

    usd_k = c0 + a N_k + u N_{k-1}         c1 = a + u  (what one more actor costs, all told)

by non-negative least squares (``scipy.optimize.nnls``: no price is negative, and where N never
changed the two columns are equal and only their sum is determined, which is what c1 is). Rounds
that evaluate are left out of the fit (their evaluation invocations cost the same whatever N) and
their excess over the fitted line is spread over all rounds as part of c0: evaluation is a cost
per round of the run, paid every ``eval.every_rounds``. Round 0 (no update yet), a budget run's
last round (no training actors) and rounds that also bill a dead attempt are left out.

Until the ledger determines a price the fit is seeded (``price_prior``):

* fewer than ``MIN_ROUNDS`` usable rounds: the prior line as it is;
* ``MIN_ROUNDS`` or more, but fewer than ``MIN_ROUNDS`` at each of two actor counts: c1 stays the
  prior's (one count says nothing about the slope) and c0 is fitted to the rounds' mean;
* ``MIN_ROUNDS`` rounds at each of two counts or more: both fitted.

``MIN_ROUNDS`` is 5: at a fixed count a round's spend varied with a coefficient of variation of
0.13 to 0.24 in docs/results/boost-equal-money (fixed-16 cells, Lambda-projected clock), so five
rounds put the level's standard error under 10%, about the switching threshold's size.

The prior (``price_prior``) prices a round from the config: the learner's hourly price on the
run's clock, an Adam step's and a sample's seconds in the update (PPO's epochs and minibatches,
so a constant-steps update lands in c0 and a per-sample one in c1), an actor invocation at
Lambda's rates or its share of a VM, Stellaris's learner functions per actor. Its constants were
measured on the 2x256 MLPs here (docs/results/boost-equal-money and boost-constant-steps: fitted
c1 2.3e-5 to 3.1e-5 dollars per actor for the tuned learner, c0 about 5e-5; 1.0e-5 to 1.6e-5 and
1.1e-4 to 1.6e-4 with constant steps); the fit replaces them once the ledger determines the line.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from nitro.config import NitroConfig
from nitro.learners.sgd import minibatch_count
from nitro.pricing.cost import ledger_from_config

MIN_ROUNDS = 5
ROUND_FIXED_S = 0.05  # learner-side steps that do not grow with the actors (publish, plan, record)
ADAM_STEP_S = 1.5e-3  # one Adam step of the 2x256 MLPs on one core, whatever its minibatch
SAMPLE_S = 2.3e-5  # one sample's forward and backward in a minibatch, per epoch
ACTOR_S_PER_STEP = 1.0e-3  # a MuJoCo env step with its policy's forward (Lambda, 1 GB: ~0.24 s per 256)

Source = Literal["prior", "level", "fit"]


@dataclass(frozen=True)
class Line:
    """y = fixed + per_actor x N."""

    fixed: float
    per_actor: float

    def at(self, n: float) -> float:
        return self.fixed + self.per_actor * n


@dataclass(frozen=True)
class RoundCharge:
    """One round of the ledger as the fit reads it."""

    round: int
    actors: float  # training actors launched this round (N_k)
    trained_actors: float  # the actors whose batches this round's update trained on (N_{k-1})
    usd: float  # spend_round_usd
    seconds: float  # round_billed_s: the seconds the learner was billed for, on the run's clock
    evaluated: bool  # the round ran evaluation invocations


@dataclass(frozen=True)
class PriceFit:
    """A line fitted to the ledger, how it was determined, and from how many rounds."""

    line: Line
    source: Source
    rounds: int


def _number(row: Mapping[str, float], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan


def ledger_rows(history: Sequence[Mapping[str, float]]) -> tuple[RoundCharge, ...]:
    """The usable rounds of the engine's per-round metrics (see the module docstring)."""
    out: list[RoundCharge] = []
    for prev, row in itertools.pairwise(history):
        n, n_prev = _number(row, "actors_launched"), _number(prev, "actors_launched")
        usd, seconds = _number(row, "spend_round_usd"), _number(row, "round_billed_s")
        if not all(math.isfinite(v) for v in (n, n_prev, usd, seconds)) or n <= 0:
            continue
        if _number(row, "spend_interrupted_usd") > 0:
            continue
        out.append(RoundCharge(int(_number(row, "round")) if math.isfinite(_number(row, "round")) else len(out),
                               n, n_prev, usd, seconds, _number(row, "eval_invocations") > 0))
    return tuple(out)


def fit_line(rows: Sequence[RoundCharge], prior: Line, what: Literal["usd", "seconds"]) -> PriceFit:
    """The line of ``what`` (dollars or seconds per round) against the actors, from ``rows``,
    seeded by ``prior`` until the rows determine it (module docstring)."""
    plain = [r for r in rows if not r.evaluated]
    if len(plain) < MIN_ROUNDS:
        return PriceFit(prior, "prior", len(plain))
    y = np.array([getattr(r, what) for r in plain])
    now = np.array([r.actors for r in plain])
    before = np.array([r.trained_actors for r in plain])
    counts = np.unique(now, return_counts=True)[1]
    source: Source
    if (counts >= MIN_ROUNDS).sum() >= 2:
        from scipy.optimize import nnls

        coef = nnls(np.column_stack([np.ones_like(y), now, before]), y)[0]
        line, source = Line(float(coef[0]), float(coef[1] + coef[2])), "fit"
    else:
        # The slope is the prior's; the level is the rounds' mean, each at its two counts' mean.
        fixed = float(np.mean(y - prior.per_actor * (now + before) / 2))
        line, source = Line(max(0.0, fixed), prior.per_actor), "level"
    evaluated = [r for r in rows if r.evaluated]
    if evaluated:
        excess = sum(getattr(r, what) - line.fixed - line.per_actor * (r.actors + r.trained_actors) / 2
                     for r in evaluated)
        line = Line(line.fixed + max(0.0, excess) / (len(plain) + len(evaluated)), line.per_actor)
    return PriceFit(line, source, len(plain))


# -- the prior -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PricePrior:
    """A round's dollars and seconds against its actors, from the config alone."""

    usd: Line
    seconds: Line


def update_seconds(config: NitroConfig, samples: int) -> float:
    """The prior's seconds of a sync update on ``samples`` samples: Adam steps plus sample passes."""
    if config.algo == "impact":
        c = config.impact
        samples = int(samples * (1 + c.replay_ratio))
        steps = c.epochs * minibatch_count(samples, c.minibatch_size)
        return steps * ADAM_STEP_S + c.epochs * samples * SAMPLE_S
    p = config.ppo
    steps = p.epochs * minibatch_count(max(1, samples), p.minibatch_size, p.minibatches)
    return steps * ADAM_STEP_S + p.epochs * samples * SAMPLE_S


def _round(config: NitroConfig, n: int) -> tuple[float, float]:
    """(dollars, seconds) of a round of ``n`` actors, as the prior prices it."""
    ledger = ledger_from_config(config)
    spa = config.steps_per_actor
    actor_s = spa * ACTOR_S_PER_STEP
    stellaris = config.learner.mode == "stellaris"
    functions = config.learner.functions_for(n) if stellaris else 0
    invocations = n + functions
    projected = config.clock.kind == "lambda" or config.backend.kind == "lambda"
    if projected:
        acting = invocations * config.clock.dispatch_s_per_invocation + config.clock.invoke_s + actor_s
    else:
        parallel = config.backend.workers or os.cpu_count() or 1
        acting = math.ceil(invocations / parallel) * actor_s
    update = 0.0 if stellaris else update_seconds(config, n * spa)
    seconds = ROUND_FIXED_S + acting + update
    usd = float(ledger.learner_cost(seconds))
    if ledger.vm is not None:  # one actor per vCPU, the instances up all round
        vm = ledger.vm.config
        usd += (n / (vm.vcpus or 1) + vm.min_instances) * (vm.per_hour or 0.0) * seconds / 3600
    else:
        usd += n * float(ledger.invocation_cost(actor_s * 1000))
    if stellaris:  # the gradients are computed on Lambda, billed like actors
        lat = config.learner.latency
        epochs = config.learner.epochs or config.ppo.epochs
        work_s = epochs * n * spa * lat.per_sample_s + functions * lat.warm_s
        usd += work_s * float(ledger.gb * ledger.rate_gb_s) + functions * float(ledger.rate_request)
    return usd, seconds


def price_prior(config: NitroConfig) -> PricePrior:
    """The line through the prior's prices at I_min and I_max (at I_min and I_min + 1 where they
    are equal): the seed of the fit, per learner and per actor pricing."""
    lo = config.scaler.i_min
    hi = max(config.scaler.i_max, lo + 1)
    (usd_lo, s_lo), (usd_hi, s_hi) = _round(config, lo), _round(config, hi)

    def line(y_lo: float, y_hi: float) -> Line:
        slope = max(0.0, (y_hi - y_lo) / (hi - lo))
        return Line(max(0.0, y_lo - slope * lo), slope)

    return PricePrior(line(usd_lo, usd_hi), line(s_lo, s_hi))
