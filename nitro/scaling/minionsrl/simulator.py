"""The cheap training run MinionsRL's scheduler is pre-trained on (docs/decisions.md, "MinionsRL").

The scheduler code pre-trains on 100 whole DRL runs per environment; 100 x 50 Hopper rounds of up
to 64 actors is about 1.6M env steps a run, out of reach of a few cores. This surrogate keeps what
the scheduler's state and reward read, at no compute cost:

* a round with N actors gains ``peak_gain x exp(-((N - peak_actors) / width)^2)`` return, times
  (1 + noise); the mean return is the sum so far (an assumed shape, or one fitted from logged runs
  by ``nitro.scaling.minionsrl.fit``);
* its seconds follow the Lambda-projected clock (``nitro.pricing.clock``): the learner's
  ``learner_fixed_s + learner_s_per_sample x N x steps``, then all actors at once, each
  ``steps x actor_s_per_step``, plus the fan-out and invoke allowances;
* its dollars are the ledger's prices for those seconds: the learner instance, Lambda GB-s and
  requests, so the pre-training record says what the simulated runs would have cost for real;
* loss and KL are stand-ins that shrink over the run and grow with N, so the state has them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nitro.config import ClockConfig, PriceTable
from nitro.config.minionsrl import SimulatorConfig
from nitro.scaling.minionsrl.state import SchedulerObservation


@dataclass(frozen=True)
class SimulatedRound:
    """One simulated round: what it gained, took and cost."""

    gain: float
    learner_s: float
    actor_s: float
    round_s: float
    usd: float
    env_steps: int


class TrainingSimulator:
    """One simulated training run, round by round."""

    def __init__(self, config: SimulatorConfig, prices: PriceTable, clock: ClockConfig, budget_usd: float, seed: int):
        self.config, self.prices, self.clock = config, prices, clock
        self.budget_usd = float(budget_usd)
        self.rng = np.random.default_rng(seed)
        self.round_idx = 0
        self.mean_return = 0.0
        self.best_return = 0.0
        self.spent_usd = 0.0
        self.last: SimulatedRound | None = None

    def gain(self, actors: int) -> float:
        """The expected return a round with ``actors`` gains (no noise)."""
        c = self.config
        return c.peak_gain * math.exp(-(((actors - c.peak_actors) / c.width) ** 2))

    def observation(self) -> SchedulerObservation:
        last = self.last
        decay = 1.0 / (1.0 + self.round_idx)
        return SchedulerObservation(
            round_idx=float(self.round_idx), loss=decay, mean_return=self.mean_return,
            kl=0.01 * decay * (1.0 + (last.env_steps if last else 0) / 10_000.0),
            learner_s=last.learner_s if last else 0.0, actor_s=last.actor_s if last else 0.0,
            round_s=last.round_s if last else 0.0, budget_left_usd=self.budget_usd - self.spent_usd)

    def step(self, actors: int) -> SimulatedRound:
        c, p, clk = self.config, self.prices, self.clock
        steps = actors * c.steps_per_actor
        learner_s = c.learner_fixed_s + c.learner_s_per_sample * steps
        one_actor_s = c.steps_per_actor * c.actor_s_per_step
        actor_s = actors * clk.dispatch_s_per_invocation + clk.invoke_s + one_actor_s
        round_s = learner_s + actor_s
        gb_s = actors * one_actor_s * c.memory_mb / 1024
        usd = (p.learner_per_hour * round_s / 3600 + gb_s * p.lambda_gb_s_x86
               + actors * p.lambda_per_million_requests / 1e6)
        gain = self.gain(actors) * (1.0 + c.noise * float(self.rng.standard_normal()))
        self.mean_return += gain
        self.best_return = max(self.best_return, self.mean_return)
        self.spent_usd += usd
        self.round_idx += 1
        self.last = SimulatedRound(gain, learner_s, actor_s, round_s, usd, steps)
        return self.last

    @property
    def done(self) -> bool:
        return self.round_idx >= self.config.rounds or self.spent_usd >= self.budget_usd
