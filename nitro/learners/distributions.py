"""The policy's action distributions as plain tensors, and the no-grad forward passes over a whole
batch that produce them and the critic's values.

A KL anchor (PPO's pre-update policy, IMPACT's target policy) is computed once per update, with no
grad, and kept as its parameters, one row per sample; a minibatch takes its rows and rebuilds the
distribution. Whole-batch forward passes run in chunks of ``FORWARD_CHUNK`` rows so that Atari
(84x84x4 frames through a CNN) never needs one giant activation tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributions import Categorical, Distribution, Independent, Normal

from nitro.models.networks import Critic, Policy, evaluate

FORWARD_CHUNK = 1024


class GaussianParams(NamedTuple):
    """A diagonal Gaussian per row (continuous actions)."""

    loc: torch.Tensor
    scale: torch.Tensor

    def rows(self, idx: torch.Tensor) -> GaussianParams:
        return GaussianParams(self.loc[idx], self.scale[idx])

    def distribution(self) -> Distribution:
        return Independent(Normal(self.loc, self.scale, validate_args=False), 1, validate_args=False)


class CategoricalParams(NamedTuple):
    """A categorical distribution per row (discrete actions)."""

    logits: torch.Tensor

    def rows(self, idx: torch.Tensor) -> CategoricalParams:
        return CategoricalParams(self.logits[idx])

    def distribution(self) -> Distribution:
        return Categorical(logits=self.logits, validate_args=False)


DistParams = GaussianParams | CategoricalParams


def dist_params(dist: Distribution) -> DistParams:
    """The tensors that define one of the policy's distributions (per sample)."""
    if isinstance(dist, Independent):
        base = dist.base_dist
        return GaussianParams(base.loc, base.scale)
    if isinstance(dist, Categorical):
        return CategoricalParams(dist.logits)
    raise TypeError(f"unsupported action distribution {type(dist).__name__}")


def concat_params(parts: Sequence[DistParams]) -> DistParams:
    """The parameters of consecutive row blocks, concatenated field by field."""
    return type(parts[0])(*(torch.cat(field) for field in zip(*parts)))


@torch.no_grad()
def forward_values(policy: Policy, critic: Critic, obs: torch.Tensor) -> torch.Tensor:
    """V(s) (``networks.evaluate``) in chunks of ``FORWARD_CHUNK``, with no grad."""
    out = [evaluate(policy, critic, policy.features(chunk))[1] for chunk in torch.split(obs, FORWARD_CHUNK)]
    return torch.cat(out) if out else torch.zeros(0, device=obs.device)


@torch.no_grad()
def forward_dist_params(policy: Policy, obs: torch.Tensor) -> DistParams:
    """``dist_params(policy.distribution(obs))`` in chunks, with no grad."""
    return concat_params([dist_params(policy.distribution(chunk)) for chunk in torch.split(obs, FORWARD_CHUNK)])
