"""The part of the policy objective that PPO and IMPACT share, and the adaptive KL coefficient.

Each algorithm's policy loss is its surrogate + kl_coef * KL(anchor || current) - entropy_coef * H.
The KL is the exact one (``exact_kl``: the closed form ``torch.distributions.kl_divergence``
gives; RLlib's order, anchor first) rather than the sample estimator, because it is smooth, never
negative and has a well-defined Hessian for the boosting detector, which differentiates it twice.
The entropy term enters the loss only when its coefficient is > 0, so the detector's Hessian does
not pay for it otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributions import Categorical, Distribution, Independent, Normal

from nitro.learners.distributions import FORWARD_CHUNK, DistParams
from nitro.models.networks import Policy


def exact_kl(old: Distribution, new: Distribution) -> torch.Tensor:
    """KL(old || new) per state for the policy's two families (a diagonal Gaussian, a categorical):
    the closed forms ``torch.distributions.kl_divergence`` dispatches to, written out because
    ``torch.compile`` cannot trace that dispatch: its registry lookup broke the compiled loss into
    pieces with eager PyTorch between them, no faster than eager alone."""
    if isinstance(old, Independent) and isinstance(new, Independent):
        p, q = old.base_dist, new.base_dist
        assert isinstance(p, Normal) and isinstance(q, Normal)
        var_ratio = (p.scale / q.scale) ** 2
        shift = ((p.loc - q.loc) / q.scale) ** 2
        return (0.5 * (var_ratio + shift - 1.0 - var_ratio.log())).sum(-1)
    if isinstance(old, Categorical) and isinstance(new, Categorical):
        return (old.probs * (old.logits - new.logits)).sum(-1)
    raise TypeError(f"exact_kl: no closed form for {type(old).__name__} against {type(new).__name__}")


def kl_penalty(old_dist: Distribution, new_dist: Distribution) -> torch.Tensor:
    """Mean exact KL(old || new) over the states of the batch (see the module docstring)."""
    return exact_kl(old_dist, new_dist).mean()


def entropy_bonus(dist: Distribution) -> torch.Tensor:
    """Mean entropy of the action distribution (subtracted from the loss, so it is a bonus)."""
    return dist.entropy().mean()


def penalised_policy_loss(
    surrogate: torch.Tensor, new_dist: Distribution, anchor: Distribution, *, kl_coef: float, entropy_coef: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """surrogate + kl_coef * KL(anchor || new) - entropy_coef * H(new), each term only when its
    coefficient is > 0 (the configs keep both >= 0). Returns (loss, detached terms: policy_loss,
    kl, entropy).

    A term whose coefficient is 0 is still computed for the log, but outside the autograd graph:
    adding 0 * KL changes no gradient and costs every SGD step a backward pass through the KL
    (about a fifth of a step's backward on the 2x256 MLPs). The choice is an ``if`` on the
    coefficient, which ``torch.compile`` turns into a guard, where ``set_grad_enabled(kl_coef > 0)``
    would need the coefficient as a constant and fail once the adaptive coefficient changes."""
    loss = surrogate
    if kl_coef > 0:
        kl = kl_penalty(anchor, new_dist)
        loss = loss + kl_coef * kl
    else:
        with torch.no_grad():
            kl = kl_penalty(anchor, new_dist)
    if entropy_coef > 0:
        entropy = entropy_bonus(new_dist)
        loss = loss - entropy_coef * entropy
    else:
        with torch.no_grad():
            entropy = entropy_bonus(new_dist)
    return loss, {"policy_loss": surrogate.detach(), "kl": kl.detach(), "entropy": entropy.detach()}


def clip_fraction(log_ratio: torch.Tensor, clip: float) -> torch.Tensor:
    """Share of samples whose probability ratio left [1 - clip, 1 + clip] (a diagnostic)."""
    with torch.no_grad():
        return ((torch.exp(log_ratio) - 1.0).abs() > clip).float().mean()


def policy_objective(
    policy: Policy, obs: torch.Tensor, policy_loss: Callable[[Distribution], torch.Tensor]
) -> Callable[[], torch.Tensor]:
    """A closure: ``policy_loss`` of the policy's current distribution on ``obs``, as a
    differentiable function of the policy's parameters, for the gradient noise scale and the
    boosting detector. Features are computed once, with no grad (the normaliser has no
    parameters), so the repeated calls of Hessian-vector products only redo the policy head."""
    with torch.no_grad():
        feats = policy.features(obs)
    return lambda: policy_loss(policy.distribution_from_features(feats))


def adapt_kl_coef(kl_coef: float, kl: float, kl_target: float) -> float:
    """RLlib's adaptive KL rule: x1.5 if kl > 2 x target, x0.5 if kl < 0.5 x target, else keep."""
    if kl > 2.0 * kl_target:
        return kl_coef * 1.5
    if kl < 0.5 * kl_target:
        return kl_coef * 0.5
    return kl_coef


@torch.no_grad()
def whole_batch_kl(policy: Policy, obs: torch.Tensor, anchor: DistParams) -> float:
    """Mean exact KL(anchor || policy) over every row of a prepared batch, in chunks: the KL the
    adaptive coefficient reacts to (final policy, whole batch)."""
    n = len(obs)
    rows = torch.split(torch.arange(n, device=obs.device), FORWARD_CHUNK)
    total = sum(exact_kl(anchor.rows(i).distribution(), policy.distribution(obs[i])).sum() for i in rows)
    return float(total / n)
