"""The parameter server: the learner process under Stellaris. It no longer computes gradients; it
applies the ones learner functions send, each weighted by its staleness, and publishes each new
version of the policy and critic as a snapshot for the next functions.

It trains the PPO learner's own networks and Adam, so a checkpoint, the boosting detector and the
published actor weights see one policy whichever mode trained it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nitro.cache import TrajectoryCache
from nitro.config_learner import LearnerConfig
from nitro.learners.ppo import PPOLearner
from nitro.stellaris.aggregation import staleness_weight
from nitro.stellaris.gradient import LossSettings, gradient_names
from nitro.stellaris.jobs import snapshot_key
from nitro.stellaris.wire import Gradient, snapshot_payload


@dataclass(frozen=True)
class Landed:
    """A gradient as the parameter server applies it: the gradient and its staleness s = v_PS - v_k."""

    gradient: Gradient
    staleness: int


class ParameterServer:
    """Applies gradients to ``learner``'s networks and publishes versions (``version`` counts them)."""

    def __init__(self, learner: PPOLearner, config: LearnerConfig, cache: TrajectoryCache):
        self.learner, self.config, self.cache = learner, config, cache
        self.version = 0
        self.named = gradient_names(learner.policy, learner.critic)
        self.policy_params = [p for n, p in self.named.items() if n.startswith("policy.")]
        self.critic_params = [p for n, p in self.named.items() if n.startswith("critic.")]

    @property
    def expected_shapes(self) -> dict[str, torch.Size]:
        return {name: p.shape for name, p in self.named.items()}

    def settings(self) -> LossSettings:
        """The loss as the functions compute it now: the PPO config, its KL coefficient in force, the
        reward scale (frozen for the round) and the truncation."""
        cfg, lr = self.learner.cfg, self.config
        return LossSettings(gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, reward_scale=self.learner.reward_scale,
                            clip=cfg.clip, kl_coef=self.learner.kl_coef, entropy_coef=cfg.entropy_coef,
                            vf_clip=cfg.vf_clip, vf_coef=cfg.vf_coef, is_truncation=lr.is_truncation,
                            is_ratio=lr.is_ratio)

    def publish(self, round_idx: int) -> str:
        """The current version as a snapshot under round ``round_idx``'s prefix (SET NX: a version is
        written once); returns its key."""
        key = snapshot_key(self.cache, round_idx, self.version)
        payload = snapshot_payload(self.learner.policy, self.learner.critic, env_id=self.learner.spec.env_id,
                                   version=self.version, arch=self.learner.policy.arch, settings=self.settings())
        self.cache.client.set(key, payload, nx=True, ex=self.cache.ttl_s)
        return key

    def apply(self, landed: Sequence[Landed]) -> int:
        """Apply one aggregation event's gradients and advance the version; returns the Adam steps
        taken. ``sequential``: each gradient its own step at lr * w(s); ``weighted_mean``: one step
        on sum(w_i g_i) / sum(w_i). Each step clips the policy's and the critic's gradients
        separately, as the synchronous learner does."""
        steps = 0
        if landed:
            weights = [staleness_weight(x.staleness, self.config.weighting, self.config.kappa) for x in landed]
            if self.config.apply == "sequential":
                for x, w in zip(landed, weights):
                    steps += self._step(x.gradient.tensors, w)
            else:
                total = sum(weights)
                mean = {name: sum(w * x.gradient.tensors[name] for x, w in zip(landed, weights)) / total
                        for name in self.named}
                steps += self._step(mean, 1.0)
        self.version += 1
        return steps

    def _step(self, grads: dict[str, torch.Tensor], lr_factor: float) -> int:
        opt = self.learner.optimizer
        base = [g["lr"] for g in opt.param_groups]
        for name, p in self.named.items():
            p.grad = grads[name].to(p.device, p.dtype).clone()
        norms = (nn.utils.clip_grad_norm_(self.policy_params, self.learner.cfg.max_grad_norm),
                 nn.utils.clip_grad_norm_(self.critic_params, self.learner.cfg.max_grad_norm))
        took = all(torch.isfinite(n) for n in norms)
        if took:
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr * lr_factor
            opt.step()
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        return int(took)
