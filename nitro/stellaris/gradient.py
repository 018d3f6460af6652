"""What one learner function computes: the PPO gradient of one slice of one actor batch, against
the policy and critic of one snapshot, with the ratio truncated across the live versions.

The batch is prepared exactly as the synchronous learner prepares it (``ppo_loss.prepare_batches``:
the snapshot's critic values, GAE within the batch, the snapshot's reward scale); the KL anchor is
the behaviour policy, the version the actor acted with. The loss and its gradients are PPO's own
(``ppo_loss.ppo_gradients``, what ``PPOLearner.compute_gradients`` runs at the learner's networks), at
the snapshot's networks and coefficients. Pure torch, no I/O: the function
(``nitro.stellaris.function``) and the tests call the same ``slice_gradient``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nitro.learners.contract import Batch
from nitro.learners.distributions import forward_dist_params
from nitro.learners.gradients import parameter_names
from nitro.learners.ppo_loss import ppo_gradients, prepare_batches
from nitro.models.networks import Critic, Policy


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
    def from_meta(cls, meta: Mapping[str, float | bool]) -> LossSettings:
        numbers = {name: float(meta[name]) for name in cls.__dataclass_fields__ if name != "is_truncation"}
        return cls(**numbers, is_truncation=bool(meta["is_truncation"]))


def slice_rows(n: int, slice_samples: int, seed: int, epoch: int, index: int) -> np.ndarray:
    """Rows of slice ``index`` in epoch ``epoch`` of an n-sample batch: a seeded shuffle per epoch,
    cut into ``slice_samples``-row slices (the last may be shorter; past the end: empty)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[index * slice_samples:(index + 1) * slice_samples]


def slice_gradient(policy: Policy, critic: Critic, behaviour: Policy, live: Sequence[Policy], batch: Batch,
                   rows: np.ndarray, settings: LossSettings) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(gradient by name, loss terms) of the PPO loss on ``rows`` of ``batch`` at the snapshot
    (``policy``, ``critic``). ``behaviour``: the policy that acted (the ratio's denominator is the
    batch's own log-probabilities; the KL anchor is this policy); ``live``: the other live
    versions, whose ratios truncate this one's when ``settings.is_truncation``. A parameter the
    loss does not reach travels as zeros: the wire carries every parameter."""
    if len(rows) == 0:
        raise ValueError("the slice is empty: it starts past the end of the batch")
    s = settings
    with torch.no_grad():
        data = prepare_batches([batch], policy, critic, s.gamma, s.gae_lambda, s.reward_scale)
        data = data._replace(anchor=forward_dist_params(behaviour, data.obs))
    got = ppo_gradients(policy, critic, data, torch.as_tensor(rows, dtype=torch.long), clip=s.clip,
                        kl_coef=s.kl_coef, vf_clip=s.vf_clip, vf_coef=s.vf_coef, entropy_coef=s.entropy_coef,
                        live=list(live) if s.is_truncation else None, is_ratio=s.is_ratio)
    out = {name: got.tensors[name].detach() if name in got.tensors else torch.zeros_like(p)
           for name, p in parameter_names(policy, critic).items()}
    metrics = {**got.terms, "loss": got.loss, "samples": float(got.samples)}
    metrics.setdefault("truncated_frac", 0.0)
    return out, metrics
