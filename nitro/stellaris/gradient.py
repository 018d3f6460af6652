"""What one learner function computes: the PPO gradient of one slice of one actor batch, against
the policy and critic of one snapshot, with the ratio truncated across the live versions.

The batch is prepared exactly as the synchronous learner prepares it (``ppo.prepare_batches``:
the snapshot's critic values, GAE within the batch, the snapshot's reward scale); the KL anchor is
the behaviour policy, the version the actor acted with. Pure torch, no I/O: the function
(``nitro.stellaris.function``) and the tests call the same ``slice_gradient``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nitro.learners.contract import Batch
from nitro.learners.distributions import forward_dist_params
from nitro.learners.objective import clip_fraction, penalised_policy_loss
from nitro.learners.ppo import ppo_minibatch, prepare_batches, value_loss
from nitro.models import Critic, Policy
from nitro.stellaris.truncation import clipped_surrogate_of_ratio, truncated_ratio


@dataclass(frozen=True)
class LossSettings:
    """The PPO loss's coefficients as the snapshot states them (they travel in its metadata)."""

    gamma: float
    gae_lambda: float
    reward_scale: float
    clip: float
    kl_coef: float
    entropy_coef: float
    vf_clip: float
    vf_coef: float
    is_truncation: bool
    is_ratio: float

    def to_meta(self) -> dict[str, float | bool]:
        return dict(self.__dict__)

    @classmethod
    def from_meta(cls, meta: Mapping[str, object]) -> "LossSettings":
        return cls(**{name: (bool(meta[name]) if name == "is_truncation" else float(meta[name]))  # type: ignore[arg-type]
                      for name in cls.__dataclass_fields__})


def slice_rows(n: int, slice_samples: int, seed: int, epoch: int, index: int) -> np.ndarray:
    """Rows of slice ``index`` in epoch ``epoch`` of an n-sample batch: a seeded shuffle per epoch,
    cut into ``slice_samples``-row slices (the last may be shorter; past the end: empty)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[index * slice_samples:(index + 1) * slice_samples]


def gradient_names(policy: Policy, critic: Critic) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters a gradient carries, by the name it travels under."""
    named = {f"policy.{k}": p for k, p in policy.named_parameters() if p.requires_grad}
    named.update({f"critic.{k}": p for k, p in critic.named_parameters()})
    return named


def slice_gradient(policy: Policy, critic: Critic, behaviour: Policy, live: Sequence[Policy], batch: Batch,
                   rows: np.ndarray, settings: LossSettings) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(gradient by name, loss terms) of the PPO loss on ``rows`` of ``batch`` at the snapshot
    (``policy``, ``critic``). ``behaviour``: the policy that acted (the ratio's denominator is the
    batch's own log-probabilities; the KL anchor is this policy); ``live``: the other live
    versions, whose ratios truncate this one's when ``settings.is_truncation``."""
    if len(rows) == 0:
        raise ValueError("the slice is empty: it starts past the end of the batch")
    s = settings
    with torch.no_grad():
        data = prepare_batches([batch], policy, critic, s.gamma, s.gae_lambda, s.reward_scale)
        data = data._replace(anchor=forward_dist_params(behaviour, data.obs))
    mb = ppo_minibatch(data, torch.as_tensor(rows, dtype=torch.long))
    feats = policy.features(mb.obs)
    dist = policy.distribution_from_features(feats)
    logp_new = dist.log_prob(mb.actions)
    live_logps = []
    if s.is_truncation:
        with torch.no_grad():
            live_logps = [other.distribution(mb.obs).log_prob(mb.actions) for other in live]
        ratio = truncated_ratio(logp_new, mb.logp_old, live_logps, s.is_ratio)
    else:
        ratio = torch.exp(logp_new - mb.logp_old)
    surrogate = clipped_surrogate_of_ratio(ratio, mb.advantages, s.clip)
    policy_loss, terms = penalised_policy_loss(surrogate, dist, mb.anchor, kl_coef=s.kl_coef, entropy_coef=s.entropy_coef)
    vf = value_loss(critic(feats), mb.returns, mb.old_values, s.vf_clip)
    total = policy_loss + s.vf_coef * vf
    named = gradient_names(policy, critic)
    grads = torch.autograd.grad(total, list(named.values()), allow_unused=True)
    out = {name: (torch.zeros_like(p) if g is None else g.detach()) for (name, p), g in zip(named.items(), grads)}
    with torch.no_grad():
        truncated = float((ratio.detach() < torch.exp(logp_new - mb.logp_old).detach() - 1e-12).float().mean())
    metrics = {k: float(v) for k, v in terms.items()} | {
        "loss": float(total.detach()), "vf_loss": float(vf.detach()),
        "clip_frac": float(clip_fraction(logp_new.detach() - mb.logp_old, s.clip)),
        "truncated_frac": truncated, "samples": float(len(rows)),
    }
    return out, metrics
