"""PPO's loss and the batch it is computed on: a round's actor batches as training tensors (values,
GAE, the pre-update policy), and the loss of one minibatch of them.

The loss (RLlib's PPO with the paper's settings): the clipped surrogate against the behaviour
log-probabilities, plus kl_coef * the exact KL from the pre-update policy, minus entropy_coef * H
(``nitro.learners.objective``), plus vf_coef * RLlib's clipped value loss. The KL anchor, the
pre-update policy, is exactly the behaviour policy: the actors ran the weights and observation
statistics the learner published, and both stay frozen until this update ends. The learner that
trains on it is ``nitro.learners.ppo``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributions import Distribution

from nitro.learners.arrays import ArrayLike, as_indices
from nitro.learners.contract import Batch
from nitro.learners.distributions import DistParams, forward_dist_params
from nitro.learners.gradients import Gradients, gradients_of, parameter_names
from nitro.learners.objective import clip_fraction, penalised_policy_loss, policy_objective
from nitro.learners.returns import compute_gae, values_and_successors
from nitro.learners.sgd import normalise_advantages
from nitro.learners.statistics import training_rewards
from nitro.learners.truncation import clipped_surrogate_of_ratio, truncated_ratio
from nitro.models.networks import Critic, Policy, evaluate


class PPOBatch(NamedTuple):
    """A round's actor batches as training tensors, one row per sample."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp: torch.Tensor  # behaviour log-probabilities, as the actors recorded them
    rewards: torch.Tensor  # as trained on (sign-clipped on Atari, scaled)
    values: torch.Tensor  # the pre-update critic's
    advantages: torch.Tensor  # GAE
    returns: torch.Tensor  # the critic's targets: advantages + values
    anchor: DistParams  # the pre-update policy: the KL anchor


class PPOMinibatch(NamedTuple):
    """The rows of a ``PPOBatch`` that one loss evaluation sees."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp_old: torch.Tensor
    advantages: torch.Tensor  # normalised over these rows
    returns: torch.Tensor
    old_values: torch.Tensor
    anchor: Distribution


def ppo_minibatch(batch: PPOBatch, idx: torch.Tensor) -> PPOMinibatch:
    """Rows ``idx`` of a prepared batch, advantages normalised over them."""
    return PPOMinibatch(obs=batch.obs[idx], actions=batch.actions[idx], logp_old=batch.logp[idx],
                        advantages=normalise_advantages(batch.advantages[idx]), returns=batch.returns[idx],
                        old_values=batch.values[idx], anchor=batch.anchor.rows(idx).distribution())


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """-mean(min(rho * A, clip(rho, 1-clip, 1+clip) * A)), rho = pi_new(a|s) / pi_old(a|s)."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv
    return -torch.min(unclipped, clipped).mean()


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, vf_clip: float) -> torch.Tensor:
    """RLlib / PPO2 clipped value loss: mean(max((V - R)^2, (V_old + clip(V - V_old, +-vf_clip) - R)^2)).

    The clipped branch only ever makes the loss larger (pessimistic), so it stops the critic from
    moving more than ``vf_clip`` (in scaled reward units) away from its pre-update prediction in
    one round when that move is what reduces the error. No 0.5 factor (RLlib's convention, which
    its vf_coef = 1.0 assumes).
    """
    unclipped = (values - returns) ** 2
    v_clipped = old_values + torch.clamp(values - old_values, -vf_clip, vf_clip)
    clipped = (v_clipped - returns) ** 2
    return torch.max(unclipped, clipped).mean()


def ppo_policy_loss(
    dist: Distribution, mb: PPOMinibatch, *, clip: float, kl_coef: float, entropy_coef: float,
    live_logps: Sequence[torch.Tensor] | None = None, is_ratio: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy objective, as a loss: clipped surrogate + kl_coef * KL(anchor || dist)
    - entropy_coef * H (the H term only when entropy_coef > 0). Returns (loss, detached terms).
    Training, the gradient noise scale and the boosting detector all differentiate it.

    ``mb.logp_old`` is the behaviour log-probability (the importance weight's denominator);
    ``mb.anchor`` the pre-update policy. The two agree when the batch is fresh. ``live_logps``
    (Stellaris): the live versions' log-probabilities, which truncate the ratio with floor
    ``is_ratio`` (``truncation.truncated_ratio``)."""
    logp_new = dist.log_prob(mb.actions)
    extra = {}
    if live_logps is None:
        surrogate = clipped_surrogate(logp_new, mb.logp_old, mb.advantages, clip)
    else:
        ratio = truncated_ratio(logp_new, mb.logp_old, live_logps, is_ratio)
        surrogate = clipped_surrogate_of_ratio(ratio, mb.advantages, clip)
        plain = torch.exp(logp_new - mb.logp_old).detach()
        extra["truncated_frac"] = (ratio.detach() < plain - 1e-12).float().mean()
    loss, terms = penalised_policy_loss(surrogate, dist, mb.anchor, kl_coef=kl_coef, entropy_coef=entropy_coef)
    return loss, {**terms, "clip_frac": clip_fraction(logp_new - mb.logp_old, clip), **extra}


def ppo_loss(
    dist: Distribution, values: torch.Tensor, mb: PPOMinibatch, *,
    clip: float, kl_coef: float, vf_clip: float, vf_coef: float, entropy_coef: float,
    live_logps: Sequence[torch.Tensor] | None = None, is_ratio: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = ppo_policy_loss + vf_coef * value_loss, for the current policy's ``dist`` and the
    current critic's ``values`` on ``mb``. Returns (total, detached terms, for logging)."""
    policy_loss, terms = ppo_policy_loss(dist, mb, clip=clip, kl_coef=kl_coef, entropy_coef=entropy_coef,
                                         live_logps=live_logps, is_ratio=is_ratio)
    vf = value_loss(values, mb.returns, mb.old_values, vf_clip)
    return policy_loss + vf_coef * vf, {**terms, "vf_loss": vf.detach()}


def ppo_minibatch_loss(policy: Policy, critic: Critic, data: PPOBatch, rows: torch.Tensor, *, clip: float,
                       kl_coef: float, vf_clip: float, vf_coef: float, entropy_coef: float,
                       live: Sequence[Policy] | None = None,
                       is_ratio: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``ppo_loss`` on ``rows`` of a prepared batch at (``policy``, ``critic``): the function a
    learner may compile (``compiled.CompiledOrEager``). ``live`` (Stellaris): the other live
    versions, whose ratios truncate this one's."""
    mb = ppo_minibatch(data, rows)
    dist, values = evaluate(policy, critic, policy.features(mb.obs))
    live_logps = None
    if live is not None:
        with torch.no_grad():
            live_logps = [other.distribution(mb.obs).log_prob(mb.actions) for other in live]
    return ppo_loss(dist, values, mb, clip=clip, kl_coef=kl_coef,
                    vf_clip=vf_clip, vf_coef=vf_coef, entropy_coef=entropy_coef, live_logps=live_logps,
                    is_ratio=is_ratio)


def ppo_gradients(policy: Policy, critic: Critic, data: PPOBatch, rows: torch.Tensor, *, clip: float,
                  kl_coef: float, vf_clip: float, vf_coef: float, entropy_coef: float,
                  live: Sequence[Policy] | None = None, is_ratio: float = 1.0,
                  loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = ppo_minibatch_loss) -> Gradients:
    """The gradients of ``ppo_minibatch_loss``: what a learner function computes at its
    snapshot's networks, and ``PPOLearner.compute_gradients`` at the learner's own, through
    ``loss`` (the same function, compiled where the learner compiles it)."""
    total, terms = loss(policy, critic, data, rows, clip=clip, kl_coef=kl_coef, vf_clip=vf_clip,
                        vf_coef=vf_coef, entropy_coef=entropy_coef, live=live, is_ratio=is_ratio)
    return gradients_of(total, terms, parameter_names(policy, critic), len(rows))


def ppo_objective(
    policy: Policy, data: PPOBatch, indices: ArrayLike, *, clip: float, kl_coef: float, entropy_coef: float
) -> Callable[[], torch.Tensor]:
    """``ppo_policy_loss`` on rows ``indices`` of a prepared batch as a closure, a differentiable
    function of the policy's parameters (``objective.policy_objective``: features once, no grad)."""
    mb = ppo_minibatch(data, as_indices(indices, data.obs.device))
    return policy_objective(
        policy, mb.obs, lambda dist: ppo_policy_loss(dist, mb, clip=clip, kl_coef=kl_coef, entropy_coef=entropy_coef)[0]
    )


# ---------------------------------------------------------------------------------------------
# Batch preparation
# ---------------------------------------------------------------------------------------------


def prepare_batches(
    batches: Sequence[Batch],
    policy: Policy,
    critic: Critic,
    gamma: float,
    lam: float,
    reward_scale: float = 1.0,
) -> PPOBatch:
    """Concatenate actor batches into training tensors, with values, GAE and the old policy.

    Each batch is its own sequence (its own actor, its own episodes): GAE never runs across two
    batches. Successor values follow ``returns.values_and_successors``; values come from the current
    critic (``distributions.forward_values``) with the policy's current (frozen) normaliser."""
    if not batches:
        raise ValueError("prepare_batches needs at least one batch")
    device = next(policy.parameters()).device
    is_atari = policy.spec.is_atari
    names = ("obs", "actions", "logp", "rewards", "values", "advantages", "returns")
    cols: dict[str, list[Any]] = {k: [] for k in names}
    for batch in batches:
        if len(batch["rewards"]) == 0:
            continue
        obs = torch.as_tensor(batch["obs"], device=device)
        values, next_values, terminated, episode_end = values_and_successors(batch, obs, policy, critic)
        rewards = training_rewards(batch["rewards"], is_atari, reward_scale)
        adv, ret = compute_gae(rewards, values, next_values, terminated, episode_end, gamma, lam)
        cols["obs"].append(obs)
        cols["actions"].append(torch.as_tensor(batch["actions"], device=device))
        cols["logp"].append(torch.as_tensor(batch["logp"], dtype=torch.float32, device=device))
        for key, arr in (("rewards", rewards), ("values", values), ("advantages", adv), ("returns", ret)):
            cols[key].append(torch.as_tensor(arr, dtype=torch.float32, device=device))
    if not cols["obs"]:
        raise ValueError("prepare_batches got only empty batches")
    out = {k: torch.cat(v) for k, v in cols.items()}
    return PPOBatch(**out, anchor=forward_dist_params(policy, out["obs"]))
