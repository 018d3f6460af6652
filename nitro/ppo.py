"""PPO for Nitro's learner: small pure loss functions, batch preparation, and ``PPOLearner``.

Read top to bottom (CleanRL style). The pieces, and the choices behind them:

* ``compute_gae``: generalised advantage estimation over one concatenated sequence. The successor
  value of every step is given explicitly (``next_values``), so time-limit truncations and the end
  of a rollout bootstrap from the critic while terminations do not.
* ``clipped_surrogate``: the PPO clipped objective, negated (a loss to minimise).
* ``kl_penalty``: the EXACT KL(old || new) between action distributions, from
  ``torch.distributions.kl_divergence`` (RLlib's order: behaviour first). The old distribution's
  parameters are computed once, with no grad, by the pre-update policy in ``prepare_batches``.
  That pre-update policy is exactly the behaviour policy: the actors ran the weights and the
  observation statistics the learner published, and both stay frozen until this update ends.
  The exact KL is used rather than the sample estimator because it is smooth, never negative, and
  has a well-defined Hessian for the boosting detector (the detector differentiates it twice).
* ``adapt_kl_coef``: RLlib's rule: x1.5 above 2 x target, x0.5 below 0.5 x target.
* ``value_loss``: RLlib's (ray 1.x) clipped value loss, the PPO2 form: the larger of the plain
  squared error and the squared error of a value kept within ``vf_clip`` of its pre-update
  prediction. No 0.5 factor (RLlib's convention, which its vf_coef = 1.0 assumes).
* ``entropy_bonus``, ``ppo_loss``: total = surrogate + kl_coef*KL + vf_coef*VF - entropy_coef*H.

``prepare_batches`` turns actor batches (docs/ARCHITECTURE.md format) into training tensors.
``PPOLearner`` owns the policy, the critic, one Adam over both, the adaptive KL coefficient and the
reward-scale statistics; ``update`` runs epochs x minibatches and then folds the round's raw
observations into the policy's normaliser.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal, kl_divergence

from nitro.config import PPOConfig
from nitro.envs import EnvSpec
from nitro.models import Critic, Policy, build_critic, build_policy

ArrayLike = np.ndarray | torch.Tensor

# Forward passes over a whole round's batch are chunked so that Atari (84x84x4 frames through a
# CNN) never needs one giant activation tensor.
_FORWARD_CHUNK = 1024


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
    r, v, nv = (_np64(x) for x in (rewards, values, next_values))
    term, end = _np_bool(terminated), _np_bool(episode_end)
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


def kl_penalty(old_dist: Distribution, new_dist: Distribution) -> torch.Tensor:
    """Mean exact KL(old || new) over the states of the batch (see the module docstring)."""
    return kl_divergence(old_dist, new_dist).mean()


def adapt_kl_coef(kl_coef: float, kl: float, kl_target: float) -> float:
    """RLlib's adaptive KL rule: x1.5 if kl > 2 x target, x0.5 if kl < 0.5 x target, else keep."""
    if kl > 2.0 * kl_target:
        return kl_coef * 1.5
    if kl < 0.5 * kl_target:
        return kl_coef * 0.5
    return kl_coef


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


def entropy_bonus(dist: Distribution) -> torch.Tensor:
    """Mean entropy of the action distribution (subtracted from the loss, so it is a bonus)."""
    return dist.entropy().mean()


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
    """total = surrogate + kl_coef * KL + vf_coef * VF - entropy_coef * H. Returns (total, terms).

    ``logp_old`` is the behaviour log-probability the actor recorded (the importance weight's
    denominator); ``old_dist`` is the pre-update policy's distribution (the KL anchor). The two
    agree when the batch is fresh; ``terms`` are detached, for logging.
    """
    logp_new = new_dist.log_prob(actions)
    surrogate = clipped_surrogate(logp_new, logp_old, adv, clip)
    kl = kl_penalty(old_dist, new_dist)
    vf = value_loss(values, returns, old_values, vf_clip)
    entropy = entropy_bonus(new_dist)
    total = surrogate + kl_coef * kl + vf_coef * vf - entropy_coef * entropy
    with torch.no_grad():
        clip_frac = ((torch.exp(logp_new - logp_old) - 1.0).abs() > clip).float().mean()
    terms = {
        "policy_loss": surrogate.detach(),
        "kl": kl.detach(),
        "vf_loss": vf.detach(),
        "entropy": entropy.detach(),
        "clip_frac": clip_frac,
    }
    return total, terms


def explained_variance(values: ArrayLike, returns: ArrayLike) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 is a constant one."""
    v, r = _np64(values), _np64(returns)
    var_r = float(np.var(r))
    return float("nan") if var_r == 0.0 else 1.0 - float(np.var(r - v)) / var_r


def noise_scale_from_norms(
    small_sq_norm: float, big_sq_norm: float, b_small: float, b_big: float
) -> tuple[float, float, float]:
    """Gradient noise scale B_simple = tr(Sigma) / |G|^2 from two batch sizes (McCandlish et al.
    2018, appendix A). ``small_sq_norm``: mean |g|^2 of gradients over ``b_small`` samples;
    ``big_sq_norm``: |g|^2 of a gradient over ``b_big`` samples. Unbiased estimates:

        |G|^2     = (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
        tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1/b_small - 1/b_big)

    Returns (tr_sigma, g_sq, b_simple); b_simple is NaN when either estimate is <= 0 (too noisy to
    say). The two
    parts are returned too so that a consumer can average them over rounds before dividing, as the
    paper advises.
    """
    if b_big <= b_small:
        return float("nan"), float("nan"), float("nan")
    g_sq = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    tr_sigma = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    b_simple = tr_sigma / g_sq if (g_sq > 0 and tr_sigma > 0) else float("nan")
    return float(tr_sigma), float(g_sq), float(b_simple)


def training_rewards(rewards: np.ndarray, is_atari: bool, reward_scale: float) -> np.ndarray:
    """Rewards as the learner trains on them: sign-clipped on Atari (DQN/RLlib convention), then
    multiplied by the learner's reward scale (1 / running std of discounted returns)."""
    r = np.asarray(rewards, dtype=np.float64)
    if is_atari:
        r = np.sign(r)
    return r * reward_scale


def _np64(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _np_bool(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(bool)


# ---------------------------------------------------------------------------------------------
# 2. Distributions as tensors (so the pre-update policy's distribution is stored, not recomputed)
# ---------------------------------------------------------------------------------------------


def dist_params(dist: Distribution) -> dict[str, torch.Tensor]:
    """The tensors that define one of the policy's distributions (per sample)."""
    if isinstance(dist, Independent):
        base = dist.base_dist
        return {"old_loc": base.loc, "old_scale": base.scale}
    if isinstance(dist, Categorical):
        return {"old_logits": dist.logits}
    raise TypeError(f"unsupported action distribution {type(dist).__name__}")


def dist_from_params(params: dict[str, torch.Tensor]) -> Distribution:
    """Inverse of ``dist_params``; ``params`` may hold other keys (a whole batch dict)."""
    if "old_logits" in params:
        return Categorical(logits=params["old_logits"])
    return Independent(Normal(params["old_loc"], params["old_scale"]), 1)


# ---------------------------------------------------------------------------------------------
# 3. Batch preparation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _forward_values(policy: Policy, critic: Critic, obs: torch.Tensor) -> torch.Tensor:
    out = [critic(policy.features(chunk)) for chunk in torch.split(obs, _FORWARD_CHUNK)]
    return torch.cat(out) if out else torch.zeros(0, device=obs.device)


@torch.no_grad()
def _forward_dist_params(policy: Policy, obs: torch.Tensor) -> dict[str, torch.Tensor]:
    parts = [dist_params(policy.distribution(chunk)) for chunk in torch.split(obs, _FORWARD_CHUNK)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def successor_layout(
    T: int, terminated: np.ndarray, bootstrap_idx: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Check a batch's episode structure; return (episode_end, is_bootstrap), both (T,) bool.

    A step that is both terminated and listed for bootstrap counts as terminated (no successor).
    The last step must be terminated or bootstrapped, otherwise its successor is unknown.
    """
    term = np.asarray(terminated, dtype=bool)
    idx = np.asarray(bootstrap_idx, dtype=np.int64)
    if term.shape != (T,):
        raise ValueError(f"terminated has shape {term.shape}, expected ({T},)")
    if idx.size and (idx.min() < 0 or idx.max() >= T):
        raise ValueError(f"bootstrap_idx out of range for a batch of {T} steps")
    if len(np.unique(idx)) != len(idx):
        raise ValueError("bootstrap_idx has duplicates")
    is_boot = np.zeros(T, dtype=bool)
    is_boot[idx] = True
    if T and not (term[-1] or is_boot[-1]):
        raise ValueError("the batch's last step is neither terminated nor bootstrapped: its successor is unknown")
    return term | is_boot, is_boot & ~term


def prepare_batches(
    batches: Sequence[dict[str, np.ndarray]],
    policy: Policy,
    critic: Critic,
    gamma: float,
    lam: float,
    reward_scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Concatenate actor batches into training tensors, with values, GAE and the old policy.

    Each batch is its own independent sequence (its own actor, its own episodes): GAE never runs
    across two batches. For step t the successor value is 0 if terminated[t], V(bootstrap_obs[k])
    if bootstrap_idx[k] == t, else V(obs[t+1]). Values come from ``critic(policy.features(obs))``
    with the policy's current (frozen) normaliser. Returned keys: obs, actions, logp (behaviour),
    values (pre-update), advantages, returns, rewards (as trained on), and the pre-update policy's
    distribution parameters (``old_loc``/``old_scale`` or ``old_logits``).
    """
    if not batches:
        raise ValueError("prepare_batches needs at least one batch")
    device = next(policy.parameters()).device
    is_atari = policy.spec.is_atari
    cols: dict[str, list[Any]] = {k: [] for k in ("obs", "actions", "logp", "rewards", "values", "advantages", "returns")}
    for batch in batches:
        T = len(batch["rewards"])
        if T == 0:
            continue
        obs = torch.as_tensor(batch["obs"], device=device)
        episode_end, is_boot = successor_layout(T, batch["terminated"], batch["bootstrap_idx"])
        values = _forward_values(policy, critic, obs).double().cpu().numpy()
        next_values = np.zeros(T, dtype=np.float64)
        next_values[:-1] = values[1:]  # default successor: the next observation in the batch
        boot_idx = np.asarray(batch["bootstrap_idx"], dtype=np.int64)
        if boot_idx.size:
            boot_obs = torch.as_tensor(batch["bootstrap_obs"], device=device)
            next_values[boot_idx] = _forward_values(policy, critic, boot_obs).double().cpu().numpy()
        terminated = np.asarray(batch["terminated"], dtype=bool)
        next_values[terminated] = 0.0  # terminated wins over a bootstrap entry for the same step
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
    out.update(_forward_dist_params(policy, out["obs"]))
    return out


# ---------------------------------------------------------------------------------------------
# 4. The learner
# ---------------------------------------------------------------------------------------------


def minibatch_indices(n: int, minibatch_size: int, rng: np.random.Generator, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """A fresh permutation split into near-equal minibatches (no runt minibatch of 1 sample,
    whose advantage normalisation would be meaningless)."""
    n_mb = max(1, round(n / minibatch_size))
    perm = torch.as_tensor(rng.permutation(n), device=device)
    return list(torch.tensor_split(perm, n_mb))


def gradient_noise_scale(policy_loss: Callable[[torch.Tensor], torch.Tensor], params: Sequence[torch.Tensor],
                         minibatches: list[torch.Tensor]) -> dict[str, float]:
    """B_simple from per-minibatch policy gradients, all taken at the current (pre-update)
    parameters, so that parameter drift during the epochs is not mistaken for noise. One extra
    forward/backward per minibatch: about 1/epochs of an update's cost."""
    if len(minibatches) < 2:
        nan = float("nan")
        return {"grad_noise_scale": nan, "grad_noise_tr_sigma": nan, "grad_sq_norm": nan}
    total = [torch.zeros_like(p) for p in params]
    sq_norms = []
    for idx in minibatches:
        grads = torch.autograd.grad(policy_loss(idx), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        sq_norms.append(sum(float((g.double() ** 2).sum()) for g in grads))
        for acc, g in zip(total, grads):
            acc.add_(g)
    big_sq = sum(float(((acc / len(minibatches)).double() ** 2).sum()) for acc in total)
    b_small = float(np.mean([len(i) for i in minibatches]))
    b_big = float(sum(len(i) for i in minibatches))
    tr_sigma, g_sq, b_simple = noise_scale_from_norms(float(np.mean(sq_norms)), big_sq, b_small, b_big)
    return {"grad_noise_scale": b_simple, "grad_noise_tr_sigma": tr_sigma, "grad_sq_norm": g_sq}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An optimizer's state as flat ``optim.{i}.{key}`` tensors plus its (JSON-able) param groups."""
    opt = optimizer.state_dict()
    tensors = {f"optim.{i}.{key}": torch.as_tensor(v).detach().cpu().clone()
               for i, st in opt["state"].items() for key, v in st.items()}
    return tensors, opt["param_groups"]


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], param_groups: list[dict]) -> None:
    """Inverse of ``optimizer_tensors`` (param groups as JSON gave them back: betas as lists)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g) for g in param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


class RunningMeanStd:
    """Running mean/variance of scalars (parallel Welford merge), for the reward scale."""

    def __init__(self) -> None:
        # A tiny prior count: the first merge replaces the prior almost entirely, and before any
        # data the scale is 1 (var = 1), as in SB3's VecNormalize.
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def merge(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).ravel()
        if x.size == 0:
            return
        b_mean, b_var, b_count = float(x.mean()), float(x.var()), float(x.size)
        delta = b_mean - self.mean
        total = self.count + b_count
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.mean, self.var, self.count = self.mean + delta * b_count / total, m2 / total, total


def discounted_return_trace(rewards: np.ndarray, episode_end: np.ndarray, gamma: float) -> np.ndarray:
    """Forward running discounted return R_t = gamma * R_{t-1} + r_t, reset after an episode end.

    SB3 VecNormalize scales rewards by the std of exactly this quantity; each actor batch starts a
    fresh trace (actors reset their env at the start of every rollout).
    """
    out = np.empty(len(rewards), dtype=np.float64)
    running = 0.0
    for t, r in enumerate(np.asarray(rewards, dtype=np.float64)):
        running = gamma * running + r
        out[t] = running
        if episode_end[t]:
            running = 0.0
    return out


def merge_round_statistics(policy: Policy, reward_stats: "RunningMeanStd | None",
                           batches: Sequence[dict[str, np.ndarray]], is_atari: bool, gamma: float) -> None:
    """After an update: the batches' raw observations into the policy's normaliser, and their raw
    discounted returns (sign-clipped rewards on Atari) into the reward-scale statistics (None: no
    reward scaling)."""
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


class PPOLearner:
    """The PPO learner: policy, critic, one Adam over both, adaptive KL, reward scale."""

    def __init__(self, spec: EnvSpec, cfg: PPOConfig, seed: int, device: str | torch.device = "cpu"):
        self.spec, self.cfg, self.seed = spec, cfg, int(seed)
        self.device = torch.device(device)
        self.policy: Policy = build_policy(spec, seed).to(self.device)
        self.critic: Critic = build_critic(spec, seed).to(self.device)
        self.optimizer = torch.optim.Adam(
            [*self.policy_parameters(), *self.critic.parameters()], lr=cfg.lr, eps=1e-5  # eps as CleanRL/SB3
        )
        self.kl_coef: float = float(cfg.kl_coef)
        self.reward_stats = RunningMeanStd()
        self.n_updates = 0

    # -- what other modules read ----------------------------------------------------------------

    def policy_parameters(self) -> list[nn.Parameter]:
        """The trainable policy parameters (the normaliser's statistics are buffers, not these)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def weights(self) -> dict[str, torch.Tensor]:
        """policy.state_dict() (normaliser included), detached copies on the CPU, for publishing."""
        return {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}

    @property
    def reward_scale(self) -> float:
        if not self.cfg.normalize_rewards:
            return 1.0
        return 1.0 / math.sqrt(self.reward_stats.var + 1e-8)

    def prepare(self, batches: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """``prepare_batches`` with this learner's networks, gamma, lambda and reward scale."""
        return prepare_batches(batches, self.policy, self.critic, self.cfg.gamma, self.cfg.gae_lambda, self.reward_scale)

    # -- the update -----------------------------------------------------------------------------

    def _minibatches(self, n: int, rng: np.random.Generator) -> list[torch.Tensor]:
        return minibatch_indices(n, self.cfg.minibatch_size, rng, self.device)

    def _policy_loss(self, data: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        """Policy-only part of ppo_loss on a minibatch (advantages normalised within it)."""
        dist = self.policy.distribution(data["obs"][idx])
        old = dist_from_params({k: v[idx] for k, v in data.items() if k.startswith("old_")})
        adv = _normalise(data["advantages"][idx])
        surrogate = clipped_surrogate(dist.log_prob(data["actions"][idx]), data["logp"][idx], adv, self.cfg.clip)
        return surrogate + self.kl_coef * kl_penalty(old, dist) - self.cfg.entropy_coef * entropy_bonus(dist)

    def _grad_noise_scale(self, data: dict[str, torch.Tensor], minibatches: list[torch.Tensor]) -> dict[str, float]:
        return gradient_noise_scale(lambda idx: self._policy_loss(data, idx), self.policy_parameters(), minibatches)

    def update(self, batches: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
        """One PPO update on a round's batches; returns metrics (floats).

        Order matters: (1) prepare with the frozen normaliser and reward scale, (2) gradient noise
        scale at the pre-update parameters, (3) epochs x minibatches of Adam with per-minibatch
        advantage normalisation and gradient clipping, (4) exact KL of the final policy against the
        pre-update one on the whole batch -> adaptive KL coefficient, (5) only then fold the
        round's raw observations into policy.obs_norm and its discounted returns into the reward
        statistics, so the next round's actors and the next update see the new statistics together.
        """
        start = time.perf_counter()
        cfg = self.cfg
        self.policy.train()
        self.critic.train()
        data = self.prepare(batches)
        self.last_batch = data  # the boosting detector differentiates the surrogate on it
        n = len(data["rewards"])
        # Minibatch order: reproducible from (seed, update count), independent of torch's global RNG.
        rng = np.random.default_rng([self.seed, self.n_updates])

        first_epoch = self._minibatches(n, rng)
        metrics = self._grad_noise_scale(data, first_epoch)

        sums: dict[str, float] = {}
        n_steps = 0
        for epoch in range(cfg.epochs):
            for idx in first_epoch if epoch == 0 else self._minibatches(n, rng):
                obs = data["obs"][idx]
                dist = self.policy.distribution(obs)
                old = dist_from_params({k: v[idx] for k, v in data.items() if k.startswith("old_")})
                values = self.critic(self.policy.features(obs))
                total, terms = ppo_loss(
                    dist, old, data["actions"][idx], data["logp"][idx], _normalise(data["advantages"][idx]),
                    values, data["returns"][idx], data["values"][idx],
                    clip=cfg.clip, kl_coef=self.kl_coef, vf_clip=cfg.vf_clip, vf_coef=cfg.vf_coef,
                    entropy_coef=cfg.entropy_coef,
                )
                self.optimizer.zero_grad(set_to_none=True)
                total.backward()
                # Clipped separately: the critic's gradient (large while returns are being learnt)
                # must not shrink the policy's step through a shared global norm.
                nn.utils.clip_grad_norm_(self.policy_parameters(), cfg.max_grad_norm)
                nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                for k, v in terms.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                sums["loss"] = sums.get("loss", 0.0) + float(total.detach())
                n_steps += 1

        with torch.no_grad():  # the KL the adaptive rule reacts to: whole batch, final policy
            kl_final = float(
                sum(
                    kl_divergence(
                        dist_from_params({k: v[i] for k, v in data.items() if k.startswith("old_")}),
                        self.policy.distribution(data["obs"][i]),
                    ).sum()
                    for i in torch.split(torch.arange(n, device=self.device), _FORWARD_CHUNK)
                )
                / n
            )
        kl_coef_used = self.kl_coef
        self.kl_coef = adapt_kl_coef(self.kl_coef, kl_final, cfg.kl_target)

        self.optimizer.zero_grad(set_to_none=True)  # leave no .grad behind for the detector's autograd
        self._merge_statistics(batches)
        self.n_updates += 1

        metrics.update({k: v / n_steps for k, v in sums.items()})
        metrics.update(
            {
                "kl": kl_final,
                "kl_minibatch_mean": sums["kl"] / n_steps,
                "kl_coef_used": kl_coef_used,
                "kl_coef": self.kl_coef,
                "explained_variance": explained_variance(data["values"], data["returns"]),
                "logp_drift": float((data["logp"] - dist_from_params(data).log_prob(data["actions"])).abs().mean()),
                "reward_scale": self.reward_scale,
                "n_samples": float(n),
                "seconds": time.perf_counter() - start,
            }
        )
        return metrics

    def _merge_statistics(self, batches: Sequence[dict[str, np.ndarray]]) -> None:
        """After the update: raw observations into the policy's normaliser, raw discounted returns
        (sign-clipped rewards on Atari) into the reward-scale statistics."""
        merge_round_statistics(self.policy, self.reward_stats if self.cfg.normalize_rewards else None, batches,
                               self.spec.is_atari, self.cfg.gamma)

    # -- for the boosting detector --------------------------------------------------------------

    def surrogate_closure(self, batch_tensors: dict[str, torch.Tensor], indices: ArrayLike) -> Callable[[], torch.Tensor]:
        """A closure giving the policy-only PPO loss on ``indices`` of ``batch_tensors`` (from
        ``prepare``/``prepare_batches``) as a differentiable function of ``policy_parameters()``:
        clipped surrogate + kl_coef * KL(old || current) - entropy_coef * H (the entropy term is 0
        with the paper's entropy_coef = 0). Advantages are normalised over the subset; kl_coef is
        the one in force when the closure is made. Features are computed once (the normaliser has
        no parameters), so repeated calls (Hessian-vector products) only redo the policy head.
        """
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long, device=self.device)
        with torch.no_grad():
            feats = self.policy.features(batch_tensors["obs"][idx])
        actions = batch_tensors["actions"][idx]
        logp_old = batch_tensors["logp"][idx]
        adv = _normalise(batch_tensors["advantages"][idx])
        old = dist_from_params({k: v[idx] for k, v in batch_tensors.items() if k.startswith("old_")})
        kl_coef, clip, ent_coef = self.kl_coef, self.cfg.clip, self.cfg.entropy_coef
        policy = self.policy

        def closure() -> torch.Tensor:
            dist = policy.distribution_from_features(feats)
            loss = clipped_surrogate(dist.log_prob(actions), logp_old, adv, clip) + kl_coef * kl_penalty(old, dist)
            return loss - ent_coef * entropy_bonus(dist) if ent_coef else loss

        return closure

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta): flat named tensors and JSON-able scalars, ready for
        ``dumps_tensors(tensors, meta)``. Tensors: ``policy.*``, ``critic.*``, ``optim.{i}.{key}``
        (Adam's per-parameter state). Meta: kl_coef, reward statistics, update count, Adam's
        param groups, and the spec/seed for a sanity check on load."""
        tensors: dict[str, torch.Tensor] = {}
        for k, v in self.policy.state_dict().items():
            tensors[f"policy.{k}"] = v.detach().cpu().clone()
        for k, v in self.critic.state_dict().items():
            tensors[f"critic.{k}"] = v.detach().cpu().clone()
        optim, param_groups = optimizer_tensors(self.optimizer)
        tensors.update(optim)
        meta = {
            "format": "nitro.ppo_learner/1",
            "env_id": self.spec.env_id,
            "kl_coef": self.kl_coef,
            "reward_mean": self.reward_stats.mean,
            "reward_var": self.reward_stats.var,
            "reward_count": self.reward_stats.count,
            "n_updates": self.n_updates,
            "seed": self.seed,  # with n_updates, fixes the minibatch order of the next update
            "optim_param_groups": param_groups,
        }
        return tensors, json.loads(json.dumps(meta))  # proves it is JSON-able

    def load_state_dict(self, tensors: dict[str, ArrayLike], meta: dict[str, Any]) -> None:
        """Inverse of ``state_dict``. ``meta`` values may be JSON strings (as ``loads_tensors``
        returns them) or plain values; tensors may be numpy arrays."""
        meta = {k: _maybe_json(v) for k, v in meta.items()}
        if meta.get("env_id") != self.spec.env_id:
            raise ValueError(f"learner state is for {meta.get('env_id')!r}, this learner is for {self.spec.env_id!r}")
        t = {k: torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
        self.policy.load_state_dict({k[7:]: v for k, v in t.items() if k.startswith("policy.")}, strict=True)
        self.critic.load_state_dict({k[7:]: v for k, v in t.items() if k.startswith("critic.")}, strict=True)
        load_optimizer(self.optimizer, t, meta["optim_param_groups"])
        self.kl_coef = float(meta["kl_coef"])
        self.reward_stats.mean = float(meta["reward_mean"])
        self.reward_stats.var = float(meta["reward_var"])
        self.reward_stats.count = float(meta["reward_count"])
        self.n_updates = int(meta["n_updates"])
        self.seed = int(meta["seed"])


def _normalise(adv: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit std (population std, so a 1-sample minibatch gives 0, not NaN)."""
    return (adv - adv.mean()) / (adv.std(correction=0) + 1e-8)


def _maybe_json(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v
