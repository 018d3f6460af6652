"""What PPO and IMPACT share: the pieces of a learner that do not depend on the algorithm.

Read top to bottom (CleanRL style). The pieces, and the choices behind them:

* Array helpers (``as_float64``, ``as_bool``): the advantage and V-trace recursions run in numpy
  float64 whatever they are given (numpy arrays or torch tensors).
* ``explained_variance``, ``training_rewards``, ``discounted_return_trace``, ``RunningMeanStd``:
  the critic's diagnostic and the reward scale. Rewards are sign-clipped on Atari (DQN/RLlib
  convention), then divided by the running std of discounted returns (SB3's VecNormalize).
* ``successor_layout`` and ``values_and_successors``: a batch's episode structure (which steps end
  an episode, which bootstrap from ``bootstrap_obs``) and the critic's value of every step and of
  its successor: 0 after a termination, V(bootstrap_obs) at a time-limit truncation or at the end
  of the rollout, V(obs[t+1]) otherwise. GAE and V-trace both start from these.
* Forward passes over a whole round's batch (``forward_values``, ``forward_dist_params``) are
  chunked (``FORWARD_CHUNK``) so that Atari (84x84x4 frames through a CNN) never needs one giant
  activation tensor.
* Distributions as tensors (``dist_params`` / ``dist_from_params`` / ``anchor_distribution``): the
  KL anchor (PPO's pre-update policy, IMPACT's target policy) is stored in the batch as
  ``old_loc``/``old_scale`` or ``old_logits``, computed once with no grad, never recomputed.
* The policy objective's shared part (``kl_penalty``, ``entropy_bonus``, ``penalised_policy_loss``):
  each algorithm's surrogate + kl_coef * KL(anchor || current) - entropy_coef * H. The KL is the
  EXACT one from ``torch.distributions.kl_divergence`` (RLlib's order: anchor first) rather than the
  sample estimator, because it is smooth, never negative and has a well-defined Hessian for the
  boosting detector (which differentiates it twice). The entropy term enters the loss only when its
  coefficient is > 0 (the paper's PPO uses 0), so the detector's Hessian never pays for it.
* ``policy_objective``: the boosting detector's closure around an algorithm's policy loss; the
  features are computed once, with no grad (the normaliser has no parameters), so the repeated
  calls of the Hessian-vector products only redo the policy head.
* ``adapt_kl_coef`` (RLlib's rule) and ``whole_batch_kl`` (the KL it reacts to: final policy
  against the anchor, over the whole batch).
* ``normalise_advantages``, ``minibatch_indices``, ``clipped_step``: one SGD step's ingredients.
* ``gradient_noise_scale`` / ``noise_scale_from_norms``: McCandlish et al.'s B_simple, for the
  kungfu scaler.
* ``merge_round_statistics``: after an update, the round's raw observations into the policy's
  normaliser and its discounted returns into the reward statistics.
* Checkpoint helpers: ``optimizer_tensors`` / ``load_optimizer`` (Adam's state as flat tensors),
  ``reward_stats_meta`` / ``load_reward_stats``, ``module_tensors`` / ``load_module_tensors``,
  ``decode_meta`` (meta values arrive as JSON strings from ``loads_tensors``).
* ``ActorCriticLearner``: what both learners hold (policy, critic, one Adam, KL coefficient,
  reward statistics, the last update's batch) and the optimisation loop both run (``_optimise``:
  noise scale, epochs x minibatches of clipped steps, whole-batch KL -> adaptive coefficient).
  ``PPOLearner`` and ``ImpactLearner`` subclass it; each adds its batch preparation, its losses,
  its ``objective`` and its checkpoint format.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal, kl_divergence

from nitro.config import ImpactConfig, PPOConfig
from nitro.envs import EnvSpec
from nitro.models import Architecture, Critic, Policy, build_critic, build_policy

ArrayLike = np.ndarray | torch.Tensor
Tensors = Mapping[str, torch.Tensor]  # a prepared batch: one row per sample

FORWARD_CHUNK = 1024

log = logging.getLogger("nitro")


# ---------------------------------------------------------------------------------------------
# 1. Arrays, rewards, statistics
# ---------------------------------------------------------------------------------------------


def as_float64(x: ArrayLike) -> np.ndarray:
    """A numpy float64 copy-or-view of an array or (detached) tensor."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def as_bool(x: ArrayLike) -> np.ndarray:
    """A numpy bool array of an array or (detached) tensor."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(bool)


def explained_variance(values: ArrayLike, returns: ArrayLike) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 is a constant one."""
    v, r = as_float64(values), as_float64(returns)
    var_r = float(np.var(r))
    return float("nan") if var_r == 0.0 else 1.0 - float(np.var(r - v)) / var_r


def training_rewards(rewards: np.ndarray, is_atari: bool, reward_scale: float) -> np.ndarray:
    """Rewards as the learner trains on them: sign-clipped on Atari (DQN/RLlib convention), then
    multiplied by the learner's reward scale (1 / running std of discounted returns)."""
    r = np.asarray(rewards, dtype=np.float64)
    if is_atari:
        r = np.sign(r)
    return r * reward_scale


def discounted_return_trace(rewards: np.ndarray, episode_end: np.ndarray, gamma: float) -> np.ndarray:
    """Forward running discounted return R_t = gamma * R_{t-1} + r_t, reset after an episode end.

    SB3 VecNormalize scales rewards by the std of exactly this quantity. Each actor batch starts a
    fresh trace, also where its episode continues one an earlier invocation left unfinished
    (nitro/episodes.py): the trace of the steps before is not carried. Late in a run, when
    episodes span several batches, the std is therefore somewhat larger than SB3's over one
    unbroken trace (by about 1.3x for 256-step batches of steady reward inside 1000-step
    episodes), so the reward scale is smaller; advantages are normalised per minibatch, so only
    the scale of the critic's targets feels it.
    """
    out = np.empty(len(rewards), dtype=np.float64)
    running = 0.0
    for t, r in enumerate(np.asarray(rewards, dtype=np.float64)):
        running = gamma * running + r
        out[t] = running
        if episode_end[t]:
            running = 0.0
    return out


class RunningMeanStd:
    """Running mean/variance of scalars (parallel Welford merge), for the reward scale."""

    def __init__(self) -> None:
        # A tiny prior count: the first merge replaces the prior almost entirely, and before any
        # data the scale is 1 (var = 1), as in SB3's VecNormalize.
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def merge(self, x: np.ndarray) -> None:
        """Fold in the finite values of ``x``; a NaN or inf would make the scale NaN for good."""
        x = np.asarray(x, dtype=np.float64).ravel()
        x = x[np.isfinite(x)]
        if x.size == 0:
            return
        b_mean, b_var, b_count = float(x.mean()), float(x.var()), float(x.size)
        delta = b_mean - self.mean
        total = self.count + b_count
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.mean, self.var, self.count = self.mean + delta * b_count / total, m2 / total, total


# ---------------------------------------------------------------------------------------------
# 2. A batch's episode structure and the critic's values
# ---------------------------------------------------------------------------------------------


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


@torch.no_grad()
def forward_values(policy: Policy, critic: Critic, obs: torch.Tensor) -> torch.Tensor:
    """critic(policy.features(obs)) in chunks of ``FORWARD_CHUNK``, with no grad."""
    out = [critic(policy.features(chunk)) for chunk in torch.split(obs, FORWARD_CHUNK)]
    return torch.cat(out) if out else torch.zeros(0, device=obs.device)


def values_and_successors(
    batch: Mapping[str, np.ndarray], obs: torch.Tensor, policy: Policy, critic: Critic
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(values, next_values, terminated, episode_end) of one actor batch, float64 / bool numpy.

    For step t the successor value is 0 if terminated[t], V(bootstrap_obs[k]) if
    bootstrap_idx[k] == t, else V(obs[t+1]); ``obs`` is the batch's observations already on the
    learner's device."""
    T = len(batch["rewards"])
    episode_end, _ = successor_layout(T, batch["terminated"], batch["bootstrap_idx"])
    values = forward_values(policy, critic, obs).double().cpu().numpy()
    next_values = np.zeros(T, dtype=np.float64)
    next_values[:-1] = values[1:]  # default successor: the next observation in the batch
    boot_idx = np.asarray(batch["bootstrap_idx"], dtype=np.int64)
    if boot_idx.size:
        boot_obs = torch.as_tensor(batch["bootstrap_obs"], device=obs.device)
        next_values[boot_idx] = forward_values(policy, critic, boot_obs).double().cpu().numpy()
    terminated = np.asarray(batch["terminated"], dtype=bool)
    next_values[terminated] = 0.0  # terminated wins over a bootstrap entry for the same step
    return values, next_values, terminated, episode_end


# ---------------------------------------------------------------------------------------------
# 3. Distributions as tensors
# ---------------------------------------------------------------------------------------------


def dist_params(dist: Distribution) -> dict[str, torch.Tensor]:
    """The tensors that define one of the policy's distributions (per sample)."""
    if isinstance(dist, Independent):
        base = dist.base_dist
        return {"old_loc": base.loc, "old_scale": base.scale}
    if isinstance(dist, Categorical):
        return {"old_logits": dist.logits}
    raise TypeError(f"unsupported action distribution {type(dist).__name__}")


def dist_from_params(params: Mapping[str, torch.Tensor]) -> Distribution:
    """Inverse of ``dist_params``; ``params`` may hold other keys (a whole batch dict)."""
    if "old_logits" in params:
        return Categorical(logits=params["old_logits"], validate_args=False)
    return Independent(Normal(params["old_loc"], params["old_scale"], validate_args=False), 1, validate_args=False)


def anchor_distribution(data: Tensors, idx: torch.Tensor) -> Distribution:
    """The stored anchor distribution (``old_*`` keys) of rows ``idx`` of a prepared batch."""
    return dist_from_params({k: v[idx] for k, v in data.items() if k.startswith("old_")})


@torch.no_grad()
def forward_dist_params(policy: Policy, obs: torch.Tensor) -> dict[str, torch.Tensor]:
    """``dist_params(policy.distribution(obs))`` in chunks, with no grad."""
    parts = [dist_params(policy.distribution(chunk)) for chunk in torch.split(obs, FORWARD_CHUNK)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# ---------------------------------------------------------------------------------------------
# 4. The policy objective's shared part, the KL coefficient
# ---------------------------------------------------------------------------------------------


def kl_penalty(old_dist: Distribution, new_dist: Distribution) -> torch.Tensor:
    """Mean exact KL(old || new) over the states of the batch (see the module docstring)."""
    return kl_divergence(old_dist, new_dist).mean()


def entropy_bonus(dist: Distribution) -> torch.Tensor:
    """Mean entropy of the action distribution (subtracted from the loss, so it is a bonus)."""
    return dist.entropy().mean()


def penalised_policy_loss(
    surrogate: torch.Tensor, new_dist: Distribution, anchor: Distribution, *, kl_coef: float, entropy_coef: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """surrogate + kl_coef * KL(anchor || new) - entropy_coef * H(new), each term only when its
    coefficient is > 0. Returns (loss, detached terms: policy_loss, kl, entropy).

    A term whose coefficient is 0 is still computed for the log, but outside the autograd graph:
    adding 0 * KL changed no gradient and cost every SGD step a backward pass through the KL
    (about a fifth of a step's backward on the 2x256 MLPs)."""
    loss = surrogate
    with torch.set_grad_enabled(torch.is_grad_enabled() and kl_coef > 0):
        kl = kl_penalty(anchor, new_dist)
    if kl_coef:
        loss = loss + kl_coef * kl
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_coef > 0):
        entropy = entropy_bonus(new_dist)
    if entropy_coef:
        loss = loss - entropy_coef * entropy
    return loss, {"policy_loss": surrogate.detach(), "kl": kl.detach(), "entropy": entropy.detach()}


def clip_fraction(log_ratio: torch.Tensor, clip: float) -> torch.Tensor:
    """Share of samples whose probability ratio left [1 - clip, 1 + clip] (a diagnostic)."""
    with torch.no_grad():
        return ((torch.exp(log_ratio) - 1.0).abs() > clip).float().mean()


def policy_objective(
    policy: Policy, obs: torch.Tensor, policy_loss: Callable[[Distribution], torch.Tensor]
) -> Callable[[], torch.Tensor]:
    """A closure: ``policy_loss`` of the policy's current distribution on ``obs``, as a
    differentiable function of the policy's parameters. Features are computed once, with no grad
    (the normaliser has no parameters), so repeated calls only redo the policy head."""
    with torch.no_grad():
        feats = policy.features(obs)
    return lambda: policy_loss(policy.distribution_from_features(feats))


def as_indices(indices: ArrayLike, device: torch.device) -> torch.Tensor:
    """Row indices (a numpy array or a tensor) as a long tensor on ``device``."""
    if isinstance(indices, torch.Tensor):
        return indices.to(device=device, dtype=torch.long)
    return torch.as_tensor(np.asarray(indices), dtype=torch.long, device=device)


def annealed_lr(lr: float, k: int, rounds: int) -> float:
    """The learning rate of round k's update, decayed linearly over the run as CleanRL's PPO does.

    Round k (k >= 1) updates on round k-1's data, so a run of ``rounds`` rounds makes
    ``rounds - 1`` updates: the first (k = 1) at the full ``lr``, the last at ``lr / (rounds - 1)``,
    never 0 (a round past the planned end, in a resumed run, keeps that floor)."""
    updates = max(rounds - 1, 1)
    return lr * max(1.0 - (k - 1) / updates, 1.0 / updates)


def adapt_kl_coef(kl_coef: float, kl: float, kl_target: float) -> float:
    """RLlib's adaptive KL rule: x1.5 if kl > 2 x target, x0.5 if kl < 0.5 x target, else keep."""
    if kl > 2.0 * kl_target:
        return kl_coef * 1.5
    if kl < 0.5 * kl_target:
        return kl_coef * 0.5
    return kl_coef


@torch.no_grad()
def whole_batch_kl(policy: Policy, data: Tensors) -> float:
    """Mean exact KL(anchor || policy) over every row of a prepared batch, in chunks: the KL the
    adaptive coefficient reacts to (final policy, whole batch)."""
    n = len(data["rewards"])
    rows = torch.split(torch.arange(n, device=data["rewards"].device), FORWARD_CHUNK)
    total = sum(kl_divergence(anchor_distribution(data, i), policy.distribution(data["obs"][i])).sum() for i in rows)
    return float(total / n)


# ---------------------------------------------------------------------------------------------
# 5. SGD steps and the gradient noise scale
# ---------------------------------------------------------------------------------------------


def normalise_advantages(adv: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit std (population std, so a 1-sample minibatch gives 0, not NaN)."""
    return (adv - adv.mean()) / (adv.std(correction=0) + 1e-8)


def minibatch_indices(n: int, minibatch_size: int, rng: np.random.Generator, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """A fresh permutation split into near-equal minibatches (no runt minibatch of 1 sample,
    whose advantage normalisation would be meaningless)."""
    n_mb = max(1, round(n / minibatch_size))
    perm = torch.as_tensor(rng.permutation(n), device=device)
    return list(torch.tensor_split(perm, n_mb))


def clipped_step(
    optimizer: torch.optim.Optimizer, total: torch.Tensor, policy_params: Sequence[nn.Parameter],
    critic_params: Sequence[nn.Parameter], max_grad_norm: float,
) -> bool:
    """One optimizer step on ``total``; False (and no step) when the loss or a gradient is not
    finite. The check comes before the step: once Adam has taken a NaN gradient, the weights
    and its moments are NaN for good. The policy's and the critic's gradients are clipped
    separately: the critic's gradient (large while returns are being learnt) must not shrink the
    policy's step through a shared global norm."""
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(total.detach()):
        return False
    total.backward()
    norms = (nn.utils.clip_grad_norm_(policy_params, max_grad_norm),
             nn.utils.clip_grad_norm_(critic_params, max_grad_norm))
    if not all(torch.isfinite(n) for n in norms):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    return True


def accumulate(sums: dict[str, float], total: torch.Tensor, terms: Mapping[str, torch.Tensor]) -> None:
    """Add one step's loss terms (and its total as ``loss``) to running sums, for the metrics."""
    for k, v in terms.items():
        sums[k] = sums.get(k, 0.0) + float(v)
    sums["loss"] = sums.get("loss", 0.0) + float(total.detach())


def noise_scale_from_norms(
    small_sq_norm: float, big_sq_norm: float, b_small: float, b_big: float
) -> tuple[float, float, float]:
    """Gradient noise scale B_simple = tr(Sigma) / |G|^2 from two batch sizes (McCandlish et al.
    2018, appendix A). ``small_sq_norm``: mean |g|^2 of gradients over ``b_small`` samples;
    ``big_sq_norm``: |g|^2 of a gradient over ``b_big`` samples. Unbiased estimates:

        |G|^2     = (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
        tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1/b_small - 1/b_big)

    Returns (tr_sigma, g_sq, b_simple); b_simple is NaN when either estimate is <= 0 (too noisy to
    say). The two parts are returned too so that a consumer can average them over rounds before
    dividing, as the paper advises.
    """
    if b_big <= b_small:
        return float("nan"), float("nan"), float("nan")
    g_sq = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    tr_sigma = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    b_simple = tr_sigma / g_sq if (g_sq > 0 and tr_sigma > 0) else float("nan")
    return float(tr_sigma), float(g_sq), float(b_simple)


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


# ---------------------------------------------------------------------------------------------
# 6. After an update: the round's statistics
# ---------------------------------------------------------------------------------------------


def merge_round_statistics(policy: Policy, reward_stats: RunningMeanStd | None,
                           batches: Sequence[Mapping[str, np.ndarray]], is_atari: bool, gamma: float) -> None:
    """The batches' raw observations into the policy's normaliser, and their raw discounted
    returns (sign-clipped rewards on Atari) into the reward-scale statistics (None: no reward
    scaling). PPO calls it before its update, IMPACT after (``PPOLearner.update`` says why)."""
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


# ---------------------------------------------------------------------------------------------
# 7. Checkpoints
# ---------------------------------------------------------------------------------------------


def module_tensors(modules: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """``{prefix}.{key}`` detached CPU copies of each module's state dict."""
    return {f"{prefix}.{k}": v.detach().cpu().clone()
            for prefix, module in modules.items() for k, v in module.state_dict().items()}


def load_module_tensors(modules: Mapping[str, nn.Module], tensors: Mapping[str, torch.Tensor]) -> None:
    """Inverse of ``module_tensors`` (strict: every key of every module must be there)."""
    for prefix, module in modules.items():
        n = len(prefix) + 1
        module.load_state_dict({k[n:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}, strict=True)


def as_tensors(tensors: Mapping[str, ArrayLike]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors as torch tensors (``loads_tensors`` gives numpy arrays)."""
    return {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An optimizer's state as flat ``optim.{i}.{key}`` tensors plus its (JSON-able) param groups."""
    opt = optimizer.state_dict()
    tensors = {f"optim.{i}.{key}": torch.as_tensor(v).detach().cpu().clone()
               for i, st in opt["state"].items() for key, v in st.items()}
    return tensors, opt["param_groups"]


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], param_groups: list[dict]) -> None:
    """Inverse of ``optimizer_tensors`` (param groups as JSON gave them back: betas as lists)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g) for g in param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def reward_stats_meta(stats: RunningMeanStd) -> dict[str, float]:
    """The reward statistics as checkpoint meta (``reward_mean``/``reward_var``/``reward_count``)."""
    return {"reward_mean": stats.mean, "reward_var": stats.var, "reward_count": stats.count}


def load_reward_stats(stats: RunningMeanStd, meta: Mapping[str, Any]) -> None:
    """Inverse of ``reward_stats_meta``."""
    stats.mean, stats.var, stats.count = float(meta["reward_mean"]), float(meta["reward_var"]), float(meta["reward_count"])


def maybe_json(v: Any) -> Any:
    """A JSON string decoded, anything else (or a string that is not JSON) as it is."""
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def decode_meta(meta: Mapping[str, Any], env_id: str, fmt: str | None = None) -> dict[str, Any]:
    """Checkpoint meta with its values decoded (``loads_tensors`` returns them as JSON strings),
    after checking that it is in format ``fmt`` (when given) and for this environment."""
    out = {k: maybe_json(v) for k, v in meta.items()}
    if fmt is not None and out.get("format") != fmt:
        raise ValueError(f"not a {fmt} learner state (format {out.get('format')!r})")
    if out.get("env_id") != env_id:
        raise ValueError(f"learner state is for {out.get('env_id')!r}, this learner is for {env_id!r}")
    return out


# ---------------------------------------------------------------------------------------------
# 8. What both learners hold and how both optimise
# ---------------------------------------------------------------------------------------------


class ActorCriticLearner:
    """The part of ``PPOLearner`` and ``ImpactLearner`` that is not the algorithm: the policy, the
    critic, one Adam over both, the adaptive KL coefficient, the reward-scale statistics, the
    update count, the last update's prepared batch, and the optimisation loop they share
    (``_optimise``). A subclass prepares its batch, says what its losses are, and implements
    ``objective``."""

    def __init__(self, spec: EnvSpec, cfg: PPOConfig | ImpactConfig, seed: int, device: str | torch.device = "cpu",
                 arch: Architecture = Architecture(), noise_scale: bool = False):
        self.spec, self.cfg, self.seed = spec, cfg, int(seed)
        self.device = torch.device(device)
        self.policy: Policy = build_policy(spec, seed, arch).to(self.device)
        self.critic: Critic = build_critic(spec, seed, arch).to(self.device)
        # The gradient noise scale costs one extra backward per minibatch; only the kungfu scaler reads it.
        self.noise_scale = noise_scale
        # eps as CleanRL/SB3; fused: one kernel for the whole step (a third faster on a 64x64 MLP here)
        self.optimizer = torch.optim.Adam(
            [*self.policy_parameters(), *self.critic.parameters()], lr=cfg.lr, eps=1e-5, fused=True
        )
        self.kl_coef: float = float(cfg.kl_coef)
        self.reward_stats = RunningMeanStd()
        self.n_updates = 0
        # The last update's prepared batch (the subclass's ``prepare`` keys): what ``objective``
        # differentiates; None before the first update.
        self.trained_batch: dict[str, torch.Tensor] | None = None
        # A time.perf_counter() value by which an update stops taking minibatch steps: the budget
        # cap reserved only so much learner time for it (nitro/budget.py). None: no deadline.
        self.update_deadline: float | None = None

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate from the next update on; Adam's moments are kept."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)

    # -- what other modules read ----------------------------------------------------------------

    def policy_parameters(self) -> list[nn.Parameter]:
        """The trainable policy parameters (the normaliser's statistics are buffers, not these)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def weights(self) -> dict[str, torch.Tensor]:
        """policy.state_dict() (normaliser included), detached copies on the CPU, for publishing."""
        return {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}

    @property
    def reward_scale(self) -> float:
        """1 / std of the discounted returns seen so far; 1 when reward normalisation is off."""
        if not self.cfg.normalize_rewards:
            return 1.0
        return 1.0 / math.sqrt(self.reward_stats.var + 1e-8)

    def trained_samples(self) -> int:
        """Samples in the last update's batch; 0 before the first update."""
        return 0 if self.trained_batch is None else len(self.trained_batch["rewards"])

    def _require_batch(self) -> dict[str, torch.Tensor]:
        if self.trained_batch is None:
            raise RuntimeError(f"{type(self).__name__}.objective: no update has run yet")
        return self.trained_batch

    # -- the update -----------------------------------------------------------------------------

    def _minibatches(self, n: int, rng: np.random.Generator) -> list[torch.Tensor]:
        return minibatch_indices(n, self.cfg.minibatch_size, rng, self.device)

    def _optimise(
        self,
        data: dict[str, torch.Tensor],
        policy_loss: Callable[[torch.Tensor], torch.Tensor],
        total_loss: Callable[[torch.Tensor], tuple[torch.Tensor, Mapping[str, torch.Tensor]]],
        *,
        epochs: int,
    ) -> tuple[dict[str, float], int]:
        """Train on a prepared batch; returns (the metrics both algorithms report, SGD steps).

        (1) the gradient noise scale of ``policy_loss(minibatch)`` at the pre-update parameters
        (NaN unless ``self.noise_scale``), (2) ``epochs`` passes of shuffled minibatches, each one
        ``clipped_step`` on ``total_loss(minibatch)``, (3) the whole-batch KL of the final policy
        against the batch's anchor -> adaptive KL coefficient. The minibatch order is reproducible
        from (seed, update count), independent of torch's global RNG. Leaves no ``.grad`` behind
        (for the detector's autograd) and counts the update."""
        cfg = self.cfg
        self.trained_batch = data  # the boosting detector differentiates the policy loss on it
        n = len(data["rewards"])
        rng = np.random.default_rng([self.seed, self.n_updates])
        first_epoch = self._minibatches(n, rng)
        # Fewer than two minibatches: gradient_noise_scale reports NaN.
        metrics = gradient_noise_scale(policy_loss, self.policy_parameters(), first_epoch if self.noise_scale else first_epoch[:1])

        minibatches = (idx for epoch in range(epochs) for idx in (first_epoch if epoch == 0 else self._minibatches(n, rng)))
        sums, n_steps, skipped, cut = self._steps(minibatches, total_loss)

        kl_final = whole_batch_kl(self.policy, data)
        kl_coef_used = self.kl_coef
        self.kl_coef = adapt_kl_coef(self.kl_coef, kl_final, cfg.kl_target)
        self.optimizer.zero_grad(set_to_none=True)
        self.n_updates += 1

        metrics.update({k: v / max(n_steps, 1) for k, v in sums.items()})
        metrics.update({
            "kl": kl_final,
            "kl_minibatch_mean": sums.get("kl", 0.0) / max(n_steps, 1),
            "kl_coef_used": kl_coef_used,
            "kl_coef": self.kl_coef,
            "skipped_minibatches": float(skipped),
            "sgd_steps": float(n_steps),
            "update_cut_short": float(cut),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        })
        return metrics, n_steps

    def _steps(self, minibatches: Iterable[torch.Tensor],
               total_loss: Callable[[torch.Tensor], tuple[torch.Tensor, Mapping[str, torch.Tensor]]],
               ) -> tuple[dict[str, float], int, int, bool]:
        """``clipped_step`` on each minibatch until ``update_deadline``; a minibatch whose loss or
        gradient is not finite is skipped, not stepped on. Returns (loss sums, steps, skipped,
        whether the deadline cut the update short)."""
        sums: dict[str, float] = {}
        n_steps = skipped = 0
        policy_params, critic_params = self.policy_parameters(), list(self.critic.parameters())
        for idx in minibatches:
            if self.update_deadline is not None and time.perf_counter() > self.update_deadline:
                log.warning("%s: update stopped after %d minibatch steps at the budget's deadline", type(self).__name__, n_steps)
                return sums, n_steps, skipped, True
            total, terms = total_loss(idx)
            if clipped_step(self.optimizer, total, policy_params, critic_params, self.cfg.max_grad_norm):
                accumulate(sums, total, terms)
                n_steps += 1
            else:
                skipped += 1
        if skipped:
            log.warning("%s: skipped %d of %d minibatches with a non-finite loss or gradient",
                        type(self).__name__, skipped, skipped + n_steps)
        return sums, n_steps, skipped, False

    def _merge_statistics(self, batches: Sequence[Mapping[str, np.ndarray]]) -> None:
        """``merge_round_statistics`` on a round's new batches (never replayed ones), with this
        learner's reward statistics when it scales rewards."""
        stats = self.reward_stats if self.cfg.normalize_rewards else None
        merge_round_statistics(self.policy, stats, batches, self.spec.is_atari, self.cfg.gamma)

    # -- checkpoints ------------------------------------------------------------------------------

    def _common_meta(self, fmt: str) -> dict[str, Any]:
        """The checkpoint meta both learners write (format, env, KL coefficient, reward
        statistics, update count, seed)."""
        return {"format": fmt, "env_id": self.spec.env_id, "kl_coef": self.kl_coef, **reward_stats_meta(self.reward_stats),
                "n_updates": self.n_updates, "seed": self.seed}

    def _load_common(self, modules: Mapping[str, nn.Module], tensors: Mapping[str, ArrayLike],
                     meta: Mapping[str, Any], fmt: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Restore what ``_common_meta``, ``module_tensors(modules)`` and ``optimizer_tensors``
        wrote; returns the decoded (tensors, meta) for the subclass's own part."""
        meta = decode_meta(meta, self.spec.env_id, fmt)
        t = as_tensors(tensors)
        load_module_tensors(modules, t)
        load_optimizer(self.optimizer, t, meta["optim_param_groups"])
        self.kl_coef = float(meta["kl_coef"])
        load_reward_stats(self.reward_stats, meta)
        self.n_updates = int(meta["n_updates"])
        self.seed = int(meta["seed"])
        return t, meta
