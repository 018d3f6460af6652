"""MinionsRL's MDP as its scheduler code defines it: one episode is one training run, one step
one round (docs/decisions.md, "MinionsRL").

* **State**: 8 floats, in this order: round index, the learner's total loss, the mean episode
  return, the learner's KL, learner seconds, actor seconds, their sum, budget left (USD). Raw in
  the code; a running mean/std normalisation is an option (``StateNormaliser``).
* **Action**: one of ``n_actions`` logits, a -> N = a + 1 actors. The code's mask is all zeros
  and its env clips N to [I_min, I_max]; masking out-of-range counts instead is an option.
* **Reward**: ``-beta x seconds`` per round; at the last round, if the final return is below the
  target R*, plus (the best return so far - R*). Seconds on Nitro's clocks (the billed round),
  never the wall time of a few cores where local actors queue.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import numpy as np

FEATURES = ("round", "loss", "mean_return", "kl", "learner_s", "actor_s", "round_s", "budget_left_usd")


@dataclass(frozen=True)
class SchedulerObservation:
    """What the scheduler sees of a run before deciding a round (missing values as 0)."""

    round_idx: float
    loss: float
    mean_return: float
    kl: float
    learner_s: float
    actor_s: float
    round_s: float  # learner + actors (the code's "learner+actor time")
    budget_left_usd: float


def state_vector(obs: SchedulerObservation) -> np.ndarray:
    """The 8 features in the code's order; a NaN or infinite one reads 0."""
    return np.array([x if math.isfinite(x) else 0.0 for x in astuple(obs)], dtype=np.float32)


@dataclass
class StateNormaliser:
    """Running mean and variance of the features (Welford, merged per observation)."""

    mean: np.ndarray
    var: np.ndarray
    count: float = 0.0

    @classmethod
    def empty(cls) -> StateNormaliser:
        return cls(np.zeros(len(FEATURES), np.float64), np.zeros(len(FEATURES), np.float64), 0.0)

    def update(self, x: np.ndarray) -> None:
        self.count += 1.0
        delta = x - self.mean
        self.mean = self.mean + delta / self.count
        self.var = (self.var * (self.count - 1.0) + delta * (x - self.mean)) / self.count

    def __call__(self, x: np.ndarray) -> np.ndarray:
        var = self.var if self.count > 1 else np.ones_like(self.var)  # one observation has no spread
        return ((x - self.mean) / np.sqrt(var + 1e-8)).astype(np.float32)


def action_mask(n_actions: int, i_min: int, i_max: int, mask_out_of_range: bool) -> np.ndarray:
    """Which actions may be sampled: all (the code) or those whose N = a + 1 is in [I_min, I_max]."""
    if not mask_out_of_range:
        return np.ones(n_actions, dtype=bool)
    counts = np.arange(1, n_actions + 1)
    allowed = (counts >= i_min) & (counts <= i_max)
    if not allowed.any():  # a range beyond the network's counts: its nearest count
        allowed[min(max(i_min, 1), n_actions) - 1] = True
    return allowed


def actors_for_action(action: int, i_min: int, i_max: int) -> int:
    """N = a + 1, clipped to [I_min, I_max] (the code's env.step)."""
    return max(i_min, min(i_max, int(action) + 1))


def round_reward(seconds: float, beta: float, *, last: bool, final_return: float, best_return: float,
                 target_return: float) -> float:
    """The code's reward of one round (module docstring)."""
    reward = -beta * seconds
    if last and final_return < target_return:
        reward += best_return - target_return
    return reward
