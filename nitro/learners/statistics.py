"""What a learner learns about its data besides the policy: the observation normaliser's and the
reward scale's running statistics, the rewards as they are trained on, and the critic's
explained variance.

Rewards are sign-clipped on Atari (DQN/RLlib convention), then divided by the running std of
discounted returns (SB3's VecNormalize). Only a round's new batches feed the statistics, never
replayed ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from nitro.learners.arrays import ArrayLike, as_float64
from nitro.learners.returns import successor_layout
from nitro.models.networks import Policy


def explained_variance(values: ArrayLike, returns: ArrayLike) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 is a constant one."""
    v, r = as_float64(values), as_float64(returns)
    var_r = float(np.var(r))
    return float("nan") if var_r == 0.0 else 1.0 - float(np.var(r - v)) / var_r


def action_std(policy: Policy) -> dict[str, float]:
    """{"action_std": a Gaussian policy's standard deviation, the mean over action dimensions}, as
    SB3 logs ``train/std``: how far exploration has narrowed; {} for a categorical policy."""
    log_std = getattr(policy, "log_std", None)
    return {} if log_std is None else {"action_std": float(log_std.detach().exp().mean())}


def training_rewards(rewards: np.ndarray, is_atari: bool, reward_scale: float) -> np.ndarray:
    """Rewards as the learner trains on them: sign-clipped on Atari (DQN/RLlib convention), then
    multiplied by the learner's reward scale (1 / running std of discounted returns)."""
    r = np.asarray(rewards, dtype=np.float64)
    if is_atari:
        r = np.sign(r)
    return r * reward_scale


def discounted_return_trace(rewards: np.ndarray, episode_end: np.ndarray, gamma: float) -> np.ndarray:
    """Forward running discounted return R_t = gamma * R_{t-1} + r_t, reset after an episode end.

    SB3 VecNormalize scales rewards by the std of exactly this quantity. Each actor batch starts a
    fresh trace, also where its episode continues one an earlier invocation left unfinished
    (nitro/actors/episodes.py): the trace of the steps before is not carried. Late in a run, when
    episodes span several batches, the std is therefore somewhat larger than SB3's over one
    unbroken trace (by about 1.3x for 256-step batches of steady reward inside 1000-step
    episodes), so the reward scale is smaller; advantages are normalised per minibatch, so only
    the scale of the critic's targets feels it.
    """
    out = np.empty(len(rewards), dtype=np.float64)
    running = 0.0
    for t, r in enumerate(np.asarray(rewards, dtype=np.float64)):
        running = gamma * running + r
        out[t] = running
        if episode_end[t]:
            running = 0.0
    return out


class RunningMeanStd:
    """Running mean/variance of scalars (parallel Welford merge), for the reward scale."""

    def __init__(self) -> None:
        # A tiny prior count: the first merge replaces the prior almost entirely, and before any
        # data the scale is 1 (var = 1), as in SB3's VecNormalize.
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def merge(self, x: np.ndarray) -> None:
        """Fold in the finite values of ``x``; a NaN or inf would make the scale NaN for good."""
        x = np.asarray(x, dtype=np.float64).ravel()
        x = x[np.isfinite(x)]
        if x.size == 0:
            return
        b_mean, b_var, b_count = float(x.mean()), float(x.var()), float(x.size)
        delta = b_mean - self.mean
        total = self.count + b_count
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.mean, self.var, self.count = self.mean + delta * b_count / total, m2 / total, total


def merge_round_statistics(policy: Policy, reward_stats: RunningMeanStd | None,
                           batches: Sequence[Mapping[str, np.ndarray]], is_atari: bool, gamma: float) -> None:
    """The batches' raw observations into the policy's normaliser, and their raw discounted
    returns (sign-clipped rewards on Atari) into the reward-scale statistics (None: no reward
    scaling). PPO calls it before its update, IMPACT after (each learner's ``update`` says why)."""
    if policy.obs_norm is not None:
        for b in batches:
            if len(b["obs"]):
                policy.obs_norm.merge(b["obs"])
    if reward_stats is not None:
        for b in batches:
            T = len(b["rewards"])
            if T == 0:
                continue
            episode_end, _ = successor_layout(T, b["terminated"], b["bootstrap_idx"])
            raw = training_rewards(b["rewards"], is_atari, 1.0)
            reward_stats.merge(discounted_return_trace(raw, episode_end, gamma))
