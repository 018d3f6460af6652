"""PPO for Nitro's learner: small pure loss functions, batch preparation, and ``PPOLearner``.

Read top to bottom (CleanRL style). What PPO shares with IMPACT (the exact KL penalty, the entropy
bonus, the adaptive KL rule, forward passes, reward scale, minibatches, checkpoint helpers) lives in
``nitro.learners.common``; this module holds what is PPO's own:

* ``compute_gae``: generalised advantage estimation over one concatenated sequence. The successor
  value of every step is given explicitly (``next_values``), so time-limit truncations and the end
  of a rollout bootstrap from the critic while terminations do not.
* ``clipped_surrogate``: the PPO clipped objective, negated (a loss to minimise).
* ``ppo_policy_loss``: THE policy objective: clipped surrogate + kl_coef * KL(old || new)
  - entropy_coef * H (``common.penalised_policy_loss``). Training, the gradient-noise-scale
  estimate and the boosting detector's ``objective`` all call it. The KL anchor ``old`` is the
  pre-update policy, whose distribution parameters ``prepare_batches`` computes once, with no
  grad. That pre-update policy is exactly the behaviour policy: the actors ran the weights and the
  observation statistics the learner published, and both stay frozen until this update ends.
* ``value_loss``: RLlib's (ray 1.x) clipped value loss, the PPO2 form: the larger of the plain
  squared error and the squared error of a value kept within ``vf_clip`` of its pre-update
  prediction. No 0.5 factor (RLlib's convention, which its vf_coef = 1.0 assumes).
* ``ppo_loss``: total = ``ppo_policy_loss`` + vf_coef * VF.

``prepare_batches`` turns actor batches (docs/ARCHITECTURE.md format) into training tensors.
``PPOLearner`` (a ``nitro.learners.Learner``) owns the policy, the critic, one Adam over both, the
adaptive KL coefficient and the reward-scale statistics; ``update`` runs epochs x minibatches and
then folds the round's raw observations into the policy's normaliser. It keeps the update's
prepared batch, on which ``objective(indices)`` gives the detector its closure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Distribution

from nitro.config import PPOConfig
from nitro.learners import common
from nitro.learners.common import ActorCriticLearner, ArrayLike, Tensors
from nitro.models import Critic, Policy

if TYPE_CHECKING:  # annotations only: nitro.learners re-exports this module's learner
    from nitro.learners import Batch

# ---------------------------------------------------------------------------------------------
# 1. Pure functions
# ---------------------------------------------------------------------------------------------


def compute_gae(
    rewards: ArrayLike,
    values: ArrayLike,
    next_values: ArrayLike,
    terminated: ArrayLike,
    episode_end: ArrayLike,
    gamma: float,
    lam: float,
) -> tuple[ArrayLike, ArrayLike]:
    """GAE(gamma, lambda) over one sequence of T steps. Returns (advantages, returns).

    delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t
    A_t     = delta_t + gamma * lam * (1 - episode_end_t) * A_{t+1}
    returns = A + values   (the critic's regression target, TD(lambda))

    ``terminated[t]``: the episode ended by termination, so the successor is worth 0 (whatever
    ``next_values[t]`` holds). ``episode_end[t]``: terminated OR a bootstrap point (time-limit
    truncation, end of rollout); the chain of advantages is cut there, because step t+1 belongs to
    another episode. The last step is always treated as a cut (nothing follows it).
    Works on numpy arrays or torch tensors; the result has the input's kind, computed in float64.
    """
    as_torch = isinstance(rewards, torch.Tensor)
    r, v, nv = (common.as_float64(x) for x in (rewards, values, next_values))
    term, end = common.as_bool(terminated), common.as_bool(episode_end)
    T = len(r)
    if not (len(v) == len(nv) == len(term) == len(end) == T):
        raise ValueError("compute_gae: all inputs must have the same length")
    deltas = r + gamma * np.where(term, 0.0, nv) - v
    adv = np.zeros(T, dtype=np.float64)
    running = 0.0
    for t in range(T - 1, -1, -1):  # backwards: A_t needs A_{t+1}
        carry = 0.0 if (end[t] or t == T - 1) else gamma * lam * running
        running = deltas[t] + carry
        adv[t] = running
    ret = adv + v
    if as_torch:
        device = rewards.device
        return torch.from_numpy(adv).to(device), torch.from_numpy(ret).to(device)
    return adv, ret


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """-mean(min(rho * A, clip(rho, 1-clip, 1+clip) * A)), rho = pi_new(a|s) / pi_old(a|s)."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv
    return -torch.min(unclipped, clipped).mean()


def ppo_policy_loss(
    new_dist: Distribution,
    old_dist: Distribution,
    actions: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip: float,
    kl_coef: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy objective, as a loss: clipped surrogate + kl_coef * KL(old || new)
    - entropy_coef * H (the H term only when entropy_coef > 0). Returns (loss, detached terms).

    ``logp_old`` is the behaviour log-probability the actor recorded (the importance weight's
    denominator); ``old_dist`` is the pre-update policy's distribution (the KL anchor). The two
    agree when the batch is fresh."""
    logp_new = new_dist.log_prob(actions)
    surrogate = clipped_surrogate(logp_new, logp_old, adv, clip)
    loss, terms = common.penalised_policy_loss(surrogate, new_dist, old_dist, kl_coef=kl_coef, entropy_coef=entropy_coef)
    return loss, {**terms, "clip_frac": common.clip_fraction(logp_new - logp_old, clip)}


def policy_inputs(data: Tensors, idx: torch.Tensor) -> tuple[Distribution, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old_dist, actions, logp_old, adv) of ``ppo_policy_loss`` for rows ``idx`` of a prepared
    batch; the advantages are normalised over those rows."""
    return (common.anchor_distribution(data, idx), data["actions"][idx], data["logp"][idx],
            common.normalise_advantages(data["advantages"][idx]))


def ppo_objective(
    policy: Policy, data: Tensors, indices: ArrayLike, *, clip: float, kl_coef: float, entropy_coef: float
) -> Callable[[], torch.Tensor]:
    """``ppo_policy_loss`` on rows ``indices`` of a prepared batch as a closure, a differentiable
    function of the policy's parameters (``common.policy_objective``: features once, no grad).
    The gradient noise scale and the boosting detector both differentiate it."""
    idx = common.as_indices(indices, data["obs"].device)
    inputs = policy_inputs(data, idx)
    return common.policy_objective(
        policy, data["obs"][idx],
        lambda dist: ppo_policy_loss(dist, *inputs, clip=clip, kl_coef=kl_coef, entropy_coef=entropy_coef)[0],
    )


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, vf_clip: float) -> torch.Tensor:
    """RLlib / PPO2 clipped value loss: mean(max((V - R)^2, (V_old + clip(V - V_old, +-vf_clip) - R)^2)).

    The clipped branch only ever makes the loss larger (pessimistic), so it stops the critic from
    moving more than ``vf_clip`` (in scaled reward units) away from its pre-update prediction in
    one round when that move is what reduces the error.
    """
    unclipped = (values - returns) ** 2
    v_clipped = old_values + torch.clamp(values - old_values, -vf_clip, vf_clip)
    clipped = (v_clipped - returns) ** 2
    return torch.max(unclipped, clipped).mean()


def ppo_loss(
    new_dist: Distribution,
    old_dist: Distribution,
    actions: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    *,
    clip: float,
    kl_coef: float,
    vf_clip: float,
    vf_coef: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = ppo_policy_loss + vf_coef * VF. Returns (total, detached terms, for logging)."""
    policy_loss, terms = ppo_policy_loss(new_dist, old_dist, actions, logp_old, adv,
                                         clip=clip, kl_coef=kl_coef, entropy_coef=entropy_coef)
    vf = value_loss(values, returns, old_values, vf_clip)
    return policy_loss + vf_coef * vf, {**terms, "vf_loss": vf.detach()}


# ---------------------------------------------------------------------------------------------
# 2. Batch preparation
# ---------------------------------------------------------------------------------------------


def prepare_batches(
    batches: Sequence[Batch],
    policy: Policy,
    critic: Critic,
    gamma: float,
    lam: float,
    reward_scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Concatenate actor batches into training tensors, with values, GAE and the old policy.

    Each batch is its own independent sequence (its own actor, its own episodes): GAE never runs
    across two batches. Successor values follow ``common.values_and_successors``. Values come from
    ``critic(policy.features(obs))`` with the policy's current (frozen) normaliser. Returned keys:
    obs, actions, logp (behaviour), values (pre-update), advantages, returns, rewards (as trained
    on), and the pre-update policy's distribution parameters (``old_loc``/``old_scale`` or
    ``old_logits``).
    """
    if not batches:
        raise ValueError("prepare_batches needs at least one batch")
    device = next(policy.parameters()).device
    is_atari = policy.spec.is_atari
    cols: dict[str, list[Any]] = {k: [] for k in ("obs", "actions", "logp", "rewards", "values", "advantages", "returns")}
    for batch in batches:
        if len(batch["rewards"]) == 0:
            continue
        obs = torch.as_tensor(batch["obs"], device=device)
        values, next_values, terminated, episode_end = common.values_and_successors(batch, obs, policy, critic)
        rewards = common.training_rewards(batch["rewards"], is_atari, reward_scale)
        adv, ret = compute_gae(rewards, values, next_values, terminated, episode_end, gamma, lam)
        cols["obs"].append(obs)
        cols["actions"].append(torch.as_tensor(batch["actions"], device=device))
        cols["logp"].append(torch.as_tensor(batch["logp"], dtype=torch.float32, device=device))
        for key, arr in (("rewards", rewards), ("values", values), ("advantages", adv), ("returns", ret)):
            cols[key].append(torch.as_tensor(arr, dtype=torch.float32, device=device))
    if not cols["obs"]:
        raise ValueError("prepare_batches got only empty batches")
    out = {k: torch.cat(v) for k, v in cols.items()}
    out.update(common.forward_dist_params(policy, out["obs"]))
    return out


# ---------------------------------------------------------------------------------------------
# 3. The learner
# ---------------------------------------------------------------------------------------------


class PPOLearner(ActorCriticLearner):
    """The PPO learner: policy, critic, one Adam over both, adaptive KL, reward scale
    (``common.ActorCriticLearner``), trained on each round's fresh batches."""

    cfg: PPOConfig


    def prepare(self, batches: Sequence[Batch]) -> dict[str, torch.Tensor]:
        """``prepare_batches`` with this learner's networks, gamma, lambda and reward scale."""
        return prepare_batches(batches, self.policy, self.critic, self.cfg.gamma, self.cfg.gae_lambda, self.reward_scale)

    def _coefs(self) -> dict[str, float]:
        """``ppo_policy_loss``'s coefficients, with the KL coefficient now in force."""
        return {"clip": self.cfg.clip, "kl_coef": self.kl_coef, "entropy_coef": self.cfg.entropy_coef}

    # -- the update -----------------------------------------------------------------------------

    def update(self, batches: Sequence[Batch]) -> dict[str, float]:
        """One PPO update on a round's batches; returns metrics (floats).

        Order matters: (1) fold the round's raw observations into policy.obs_norm and its
        discounted returns into the reward statistics, then prepare the batch with them, frozen
        for the update; (2) gradient noise scale at the pre-update parameters (kungfu only);
        (3) epochs x minibatches of Adam with per-minibatch advantage normalisation and gradient
        clipping; (4) exact KL of the final policy against the pre-update one on the whole batch
        -> adaptive KL coefficient (2-4: ``_optimise``).
        Merging first means the actors acted under slightly older statistics than the update
        sees, so the first epoch's ratios start a little off 1 (``logp_drift`` reports by how
        much; clipping bounds it). Merging after the update instead keeps them at exactly 1 but
        trains every round on features and value targets one round stale, and on the first round
        on the prior (mean 0, variance 1). Merging first was the best of the three orders tried
        on Hopper-v5 (docs/tuning.md has the numbers).
        """
        start = time.perf_counter()
        cfg = self.cfg
        self.policy.train()
        self.critic.train()
        self._merge_statistics(batches)
        data = self.prepare(batches)

        def total_loss(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            feats = self.policy.features(data["obs"][idx])  # shared by the policy and the critic
            dist = self.policy.distribution_from_features(feats)
            values = self.critic(feats)
            return ppo_loss(dist, *policy_inputs(data, idx), values, data["returns"][idx], data["values"][idx],
                            vf_clip=cfg.vf_clip, vf_coef=cfg.vf_coef, **self._coefs())

        metrics, _ = self._optimise(data, lambda idx: ppo_objective(self.policy, data, idx, **self._coefs())(),
                                    total_loss, epochs=cfg.epochs)
        metrics.update(
            {
                "explained_variance": common.explained_variance(data["values"], data["returns"]),
                "logp_drift": float((data["logp"] - common.dist_from_params(data).log_prob(data["actions"])).abs().mean()),
                "reward_scale": self.reward_scale,
                "n_samples": float(len(data["rewards"])),
                "seconds": time.perf_counter() - start,
            }
        )
        return metrics

    # -- for the boosting detector --------------------------------------------------------------

    def objective(self, indices: ArrayLike) -> Callable[[], torch.Tensor]:
        """``ppo_objective`` on ``indices`` of the last update's batch: clipped surrogate +
        kl_coef * KL(old || current) - entropy_coef * H (the entropy term is absent with the
        paper's entropy_coef = 0), a differentiable function of ``policy_parameters()``.
        Advantages are normalised over the subset; kl_coef is the one in force when the closure is
        made; features are computed once, with the normaliser as it is now (after the update's
        statistics merge)."""
        return ppo_objective(self.policy, self._require_batch(), indices, **self._coefs())

    # -- checkpoints ------------------------------------------------------------------------------

    def _modules(self) -> dict[str, nn.Module]:
        return {"policy": self.policy, "critic": self.critic}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta): flat named tensors and JSON-able scalars, ready for
        ``dumps_tensors(tensors, meta)``. Tensors: ``policy.*``, ``critic.*``, ``optim.{i}.{key}``
        (Adam's per-parameter state). Meta: kl_coef, reward statistics, update count, Adam's
        param groups, and the spec/seed for a sanity check on load (the seed, with n_updates,
        fixes the minibatch order of the next update)."""
        tensors = common.module_tensors(self._modules())
        optim, param_groups = common.optimizer_tensors(self.optimizer)
        tensors.update(optim)
        meta = {**self._common_meta("nitro.ppo_learner/1"), "optim_param_groups": param_groups}
        return tensors, json.loads(json.dumps(meta))  # proves it is JSON-able

    def load_state_dict(self, tensors: Mapping[str, ArrayLike], meta: Mapping[str, Any]) -> None:
        """Inverse of ``state_dict``. ``meta`` values may be JSON strings (as ``loads_tensors``
        returns them) or plain values; tensors may be numpy arrays."""
        self._load_common(self._modules(), tensors, meta)
