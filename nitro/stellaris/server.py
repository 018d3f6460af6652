"""The parameter server: the learner process under Stellaris. It no longer computes gradients; it
hands each group of landed gradients (what the aggregation trigger collects) to the PPO learner's
``apply_gradients`` (one Adam step on their mean, weighted by samples and staleness) and publishes
one new version of the policy and critic per group as a snapshot for the next functions.

The learner keeps its optimiser, its learning-rate schedule and its statistics, so a checkpoint,
the boosting detector and the published actor weights see one policy whichever mode trained it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nitro.cache import TrajectoryCache
from nitro.config.learner import LearnerConfig
from nitro.learners import Progress
from nitro.learners.ppo import PPOLearner
from nitro.stellaris.aggregation import staleness_weight
from nitro.stellaris.gradient import LossSettings
from nitro.stellaris.jobs import snapshot_key
from nitro.stellaris.wire import Gradient, snapshot_payload


@dataclass(frozen=True)
class Landed:
    """A gradient as the parameter server applies it: the gradient and its staleness s = v_PS - v_k."""

    gradient: Gradient
    staleness: int


@dataclass
class Served:
    """What serving a round's gradients did, for the update report."""

    batches: dict[str, dict]  # actor id -> the batch that passed the door
    missing: list[str]
    corrupt: dict[str, str]  # actor id -> why its batch was dropped
    lost: dict[str, str]  # gradient job id -> why its gradient was not applied
    staleness: list[int]
    adam_steps: int
    metrics: dict[str, float]
    versions: int = 0  # versions published: one per group applied
    # the busy seconds by part: receiving, landing, stepping, publishing, closing
    busy_parts: dict[str, float] = field(default_factory=dict)

    @property
    def busy_s(self) -> float:
        """The parameter server's busy time: every part together."""
        return sum(self.busy_parts.values())

    def count(self, part: str, since: float) -> None:
        """Add the seconds from ``since`` to now to the parameter server's busy time, under ``part``."""
        self.busy_parts[part] = self.busy_parts.get(part, 0.0) + time.perf_counter() - since


class ParameterServer:
    """Applies groups of gradients through ``learner`` and publishes versions (``version`` counts them)."""

    def __init__(self, learner: PPOLearner, config: LearnerConfig, cache: TrajectoryCache):
        self.learner, self.config, self.cache = learner, config, cache
        self.version = 0

    @property
    def expected_shapes(self) -> dict[str, torch.Size]:
        return {name: p.shape for name, p in self.learner.parameter_names().items()}

    def settings(self) -> LossSettings:
        """The loss as the functions compute it now: the PPO config, its KL coefficient in force, the
        reward scale (frozen for the round) and the truncation."""
        cfg, lr = self.learner.cfg, self.config
        return LossSettings(gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, reward_scale=self.learner.reward_scale,
                            clip=cfg.clip, kl_coef=self.learner.kl_coef, entropy_coef=cfg.entropy_coef,
                            vf_clip=cfg.vf_clip, vf_coef=cfg.vf_coef, is_truncation=lr.is_truncation,
                            is_ratio=lr.is_ratio)

    def publish(self, round_idx: int, attempt: str) -> str:
        """The current version as a snapshot under round ``round_idx``'s prefix and this ``attempt``
        at the round (SET NX: a version is written once); returns its key."""
        key = snapshot_key(self.cache, round_idx, attempt, self.version)
        payload = snapshot_payload(self.learner.policy, self.learner.critic, env_id=self.learner.spec.env_id,
                                   version=self.version, arch=self.learner.policy.arch, settings=self.settings())
        self.cache.client.set(key, payload, nx=True, ex=self.cache.ttl_s)
        return key

    def apply(self, landed: Sequence[Landed], progress: Progress) -> int:
        """Apply one aggregation event's group in one optimiser step and advance the version (an
        empty group too: no job waits for a gradient that will not come); returns the steps taken
        (0 or 1). Each gradient counts by its samples and its staleness weight w(s): the step is
        on sum(n_i w_i g_i) / sum(n_i w_i) at lr * sum(n_i w_i) / sum(n_i), so one gradient alone
        steps at lr * w(s), as the official code's per-gradient steps would."""
        took = False
        if landed:
            weights = [staleness_weight(x.staleness, self.config.weighting, self.config.kappa) for x in landed]
            took = self.learner.apply_gradients([x.gradient.gradients() for x in landed], weights=weights,
                                                progress=progress)
        self.version += 1
        return int(took)
