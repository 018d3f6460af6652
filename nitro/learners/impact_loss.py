"""IMPACT's loss (Luo et al., ICLR 2020) and the batch it is computed on: V-trace targets over new
and replayed batches, and the clipped surrogate against the target network.

Three policies meet in it: mu, the behaviour policy the actor ran (the batch's ``logp``); pi_target,
the frozen target network (the KL anchor); pi_theta, the policy being trained. V-trace takes rho
and c from pi_target against mu; the surrogate's ratio and the KL are against pi_target:

    r = pi_theta / pi_target,   w = min(rho_bar, pi_target / mu)   (w carries no gradient)
    loss = -mean( w * min(r A, clip(r, 1-eps, 1+eps) A) ) + kl_coef * KL(pi_target || pi_theta) - entropy_coef * H

Since w >= 0 it multiplies both branches of the min alike; at theta = target the gradient is
exactly the V-trace policy gradient ``rho_s grad log pi (q_s - V(x_s))``, because the advantage
``A = q_s - V(x_s)`` is stored unweighted and w equals rho_s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributions import Distribution

from nitro.learners.arrays import ArrayLike, as_indices
from nitro.learners.contract import Batch
from nitro.learners.distributions import DistParams, concat_params, forward_dist_params
from nitro.learners.objective import clip_fraction, penalised_policy_loss, policy_objective
from nitro.learners.returns import values_and_successors, vtrace_returns
from nitro.learners.sgd import normalise_advantages
from nitro.learners.statistics import training_rewards
from nitro.models.networks import Critic, Policy


class ImpactBatch(NamedTuple):
    """New and replayed actor batches as training tensors, one row per sample."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp: torch.Tensor  # behaviour (mu) log-probabilities
    rewards: torch.Tensor  # as trained on (sign-clipped on Atari, scaled)
    values: torch.Tensor  # the current critic's
    vs: torch.Tensor  # V-trace targets
    advantages: torch.Tensor  # q - V, unweighted: the surrogate applies the truncated weight
    pg_advantages: torch.Tensor  # rho * (q - V)
    rho: torch.Tensor  # truncated importance weights
    target_logp: torch.Tensor  # pi_target's log-probabilities of the actions
    anchor: DistParams  # pi_target: the KL anchor


class ImpactMinibatch(NamedTuple):
    """The rows of an ``ImpactBatch`` that one loss evaluation sees."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp_target: torch.Tensor
    logp_behaviour: torch.Tensor
    advantages: torch.Tensor  # normalised over these rows
    vs: torch.Tensor
    anchor: Distribution


def impact_minibatch(batch: ImpactBatch, idx: torch.Tensor) -> ImpactMinibatch:
    """Rows ``idx`` of a prepared batch, advantages normalised over them."""
    return ImpactMinibatch(obs=batch.obs[idx], actions=batch.actions[idx], logp_target=batch.target_logp[idx],
                           logp_behaviour=batch.logp[idx], advantages=normalise_advantages(batch.advantages[idx]),
                           vs=batch.vs[idx], anchor=batch.anchor.rows(idx).distribution())


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def truncated_is_weight(logp_target: torch.Tensor, logp_behaviour: torch.Tensor, rho_bar: float = 1.0) -> torch.Tensor:
    """min(rho_bar, pi_target / mu), detached (neither policy is the one being trained)."""
    log_w = torch.clamp((logp_target - logp_behaviour).detach(), max=math.log(rho_bar))
    return torch.exp(log_w)


def impact_surrogate(logp_new: torch.Tensor, logp_target: torch.Tensor, logp_behaviour: torch.Tensor,
                     adv: torch.Tensor, clip: float, rho_bar: float = 1.0) -> torch.Tensor:
    """-mean(w * min(r A, clip(r, 1-clip, 1+clip) A)), r = pi_new/pi_target, w = min(rho_bar, pi_target/mu).

    ``adv`` is the unweighted advantage q_s - V(x_s); the truncated weight is applied here."""
    w = truncated_is_weight(logp_target, logp_behaviour, rho_bar)
    ratio = torch.exp(logp_new - logp_target.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv
    return -(w * torch.min(unclipped, clipped)).mean()


def vtrace_value_loss(values: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """mean((V(x_s) - v_s)^2): regression on the V-trace targets (no 0.5, as ``ppo.value_loss``)."""
    return ((values - vs.detach()) ** 2).mean()


def impact_policy_loss(
    dist: Distribution, mb: ImpactMinibatch, *, clip: float, rho_bar: float, kl_coef: float, entropy_coef: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy objective, as a loss: impact_surrogate + kl_coef * KL(target || dist)
    - entropy_coef * H (the H term only when entropy_coef > 0). Returns (loss, detached terms).
    Training, the gradient noise scale and the boosting detector all differentiate it."""
    logp_new = dist.log_prob(mb.actions)
    surrogate = impact_surrogate(logp_new, mb.logp_target, mb.logp_behaviour, mb.advantages, clip, rho_bar)
    loss, terms = penalised_policy_loss(surrogate, dist, mb.anchor, kl_coef=kl_coef, entropy_coef=entropy_coef)
    return loss, {**terms, "clip_frac": clip_fraction(logp_new - mb.logp_target, clip)}


def impact_loss(
    dist: Distribution, values: torch.Tensor, mb: ImpactMinibatch, *,
    clip: float, rho_bar: float, kl_coef: float, vf_coef: float, entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = impact_policy_loss + vf_coef * vtrace_value_loss, for the current policy's
    ``dist`` and the current critic's ``values`` on ``mb``. Returns (total, detached terms)."""
    policy_loss, terms = impact_policy_loss(dist, mb, clip=clip, rho_bar=rho_bar, kl_coef=kl_coef,
                                            entropy_coef=entropy_coef)
    vf = vtrace_value_loss(values, mb.vs)
    return policy_loss + vf_coef * vf, {**terms, "vf_loss": vf.detach()}


def impact_objective(policy: Policy, data: ImpactBatch, indices: ArrayLike, *, clip: float, rho_bar: float,
                     kl_coef: float, entropy_coef: float) -> Callable[[], torch.Tensor]:
    """``impact_policy_loss`` on rows ``indices`` of a prepared batch as a closure, a
    differentiable function of the policy's parameters (``objective.policy_objective``)."""
    mb = impact_minibatch(data, as_indices(indices, data.obs.device))
    return policy_objective(policy, mb.obs, lambda dist: impact_policy_loss(
        dist, mb, clip=clip, rho_bar=rho_bar, kl_coef=kl_coef, entropy_coef=entropy_coef)[0])


# ---------------------------------------------------------------------------------------------
# Batch preparation
# ---------------------------------------------------------------------------------------------


def prepare_impact_batches(
    batches: Sequence[Batch], policy: Policy, target: Policy, critic: Critic, gamma: float,
    reward_scale: float = 1.0, rho_bar: float = 1.0, c_bar: float = 1.0, lam: float = 1.0,
) -> ImpactBatch:
    """Concatenate actor batches into training tensors with V-trace targets.

    Each batch is its own sequence (V-trace never runs across two batches). Values and successor
    values (``returns.values_and_successors``) come from ``distributions.forward_values``, the
    current critic and normaliser; rho and c from the target policy against the behaviour
    log-probabilities."""
    if not batches:
        raise ValueError("prepare_impact_batches needs at least one batch")
    device = next(policy.parameters()).device
    is_atari = policy.spec.is_atari
    keys = ("obs", "actions", "logp", "rewards", "values", "vs", "advantages", "pg_advantages", "rho", "target_logp")
    cols: dict[str, list[Any]] = {k: [] for k in keys}
    anchors: list[DistParams] = []
    for batch in batches:
        if len(batch["rewards"]) == 0:
            continue
        obs = torch.as_tensor(batch["obs"], device=device)
        actions = torch.as_tensor(batch["actions"], device=device)
        values, next_values, terminated, episode_end = values_and_successors(batch, obs, policy, critic)
        anchor = forward_dist_params(target, obs)
        with torch.no_grad():
            target_logp = anchor.distribution().log_prob(actions).float()
        logp = torch.as_tensor(batch["logp"], dtype=torch.float32, device=device)
        rewards = training_rewards(batch["rewards"], is_atari, reward_scale)
        vt = vtrace_returns(logp.cpu().numpy(), target_logp.cpu().numpy(), rewards, values, next_values,
                            terminated, episode_end, gamma, rho_bar, c_bar, lam)
        cols["obs"].append(obs)
        cols["actions"].append(actions)
        cols["logp"].append(logp)
        cols["target_logp"].append(target_logp)
        anchors.append(anchor)
        for key, arr in (("rewards", rewards), ("values", values), ("vs", vt.vs), ("advantages", vt.q - values),
                         ("pg_advantages", vt.pg_advantages), ("rho", vt.rho)):
            cols[key].append(torch.as_tensor(arr, dtype=torch.float32, device=device))
    if not cols["obs"]:
        raise ValueError("prepare_impact_batches got only empty batches")
    return ImpactBatch(**{k: torch.cat(v) for k, v in cols.items()}, anchor=concat_params(anchors))
