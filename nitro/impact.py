"""IMPACT (Luo et al., ICLR 2020) for Nitro's learner: V-trace, the target-network surrogate, a
circular replay buffer, and ``ImpactLearner`` (the same interface as ``nitro.ppo.PPOLearner``).

Read top to bottom. The pieces, and the choices behind them:

* ``vtrace`` / ``vtrace_returns``: V-trace targets (Espeholt et al. 2018, Eq. 1 and Remark 1) over
  one concatenated sequence, with truncated importance weights ``rho_t = min(rho_bar, pi/mu)`` and
  trace cutters ``c_i = lam * min(c_bar, pi/mu)``:

      delta_t = rho_t (r_t + gamma V(x_{t+1}) - V(x_t))
      v_s     = V(x_s) + sum_{t=s}^{e(s)} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t

  where ``e(s)`` is the end of the episode that contains s. The successor value of every step is
  given explicitly (``next_values``), with the conventions of ``nitro.ppo.compute_gae``: 0 after a
  termination, the critic's value of ``bootstrap_obs`` at a time-limit truncation or at the end of
  the rollout, ``V(obs[t+1])`` otherwise. The chain is cut at every episode end.
  Policy-gradient advantage: ``q_s = r_s + gamma v_{s+1}`` (``v_{s+1}``: the successor's V-trace
  target, the bootstrap value at a cut, 0 after a termination) and
  ``pg_advantages = rho_s (q_s - V(x_s))``.
* ``impact_surrogate``: the IMPACT objective, negated (a loss). The ratio is taken against the
  TARGET network's policy and clipped, and the sample is importance-weighted from the behaviour
  policy to the target policy with a truncated weight:

      r = pi_theta / pi_target,   w = min(rho_bar, pi_target / mu)   (w carries no gradient)
      loss = -mean( w * min(r A, clip(r, 1-eps, 1+eps) A) )

  Since w >= 0 it multiplies both branches of the min alike; at theta = target (r = 1) the
  gradient is exactly the V-trace policy gradient ``rho_s grad log pi (q_s - V(x_s))``, because
  ``A = q_s - V(x_s)`` is passed UNWEIGHTED (the learner's ``advantages``) and w equals rho_s.
* ``vtrace_value_loss``: mean (V(x_s) - v_s)^2 against the V-trace targets, no 0.5 factor (the
  convention of ``nitro.ppo.value_loss``, which vf_coef = 1.0 assumes).
* The KL penalty is ``nitro.ppo.kl_penalty(target, current)`` (exact KL(pi_target || pi_theta)),
  with RLlib's adaptive coefficient (``nitro.ppo.adapt_kl_coef``, target ``kl_target``); the entropy
  bonus is ``nitro.ppo.entropy_bonus``. ``impact_loss`` combines them:
  total = surrogate + kl_coef * KL + vf_coef * VF - entropy_coef * H.

``ReplayBuffer`` is the paper's circular buffer: each stored batch is trained on at most K times
(``replay_max_reuse``), counting the update in which it arrived, then evicted; batches are handed
out round-robin in arrival order; when the buffer is full the oldest batch is overwritten.

``ImpactLearner``: which policy is which.

* mu (behaviour): the policy the actor ran; its log-probabilities are the batch's ``logp``.
* pi_target (the "clipped target network"): a frozen copy of the whole policy module (normaliser
  statistics included, so it is the same function of the raw observation that an actor holding
  those weights would compute). It is refreshed from the current policy at the START of every
  ``target_update_freq``-th update (``update`` and ``replay_update`` both count), before anything
  is computed. With the paper's value 1 the target is the pre-update policy, so for a fresh batch
  in synchronous rounds pi_target = mu (``logp_drift`` ~ 0) and the update is PPO-like; for
  replayed batches (and with freq > 1) the truncated weights correct for the staleness.
* V-trace uses pi = pi_target for rho and c, and the CURRENT critic (on the current policy's
  normalised features) for V, computed once per update on everything that update trains on
  (fresh and replayed batches are re-evaluated every time they are used, with the reward scale in
  force then). The surrogate's ratio and the KL are against pi_target too.

One ``update(batches)``: refresh the target if due; take up to ceil(replay_ratio * len(batches))
replayed batches from the buffer (round-robin, each gets a use); add the new batches to the buffer
with their first use counted; train ``epochs`` passes of shuffled minibatches over new + replayed
samples (advantages normalised per minibatch, Adam, policy and critic gradients clipped
separately, as in PPO); adapt the KL coefficient from the whole-batch KL(pi_target || pi_theta) of
the final policy; then merge the NEW batches' raw observations into ``policy.obs_norm`` and their
discounted returns into the reward statistics (replayed batches were merged when they were new).
``replay_update()``: the same on replayed batches only (paper §4: the learner replays old
trajectories while the cache is empty); None when no batch has a use left.

Optional settings, read from ``ImpactConfig`` when it has them (defaults in ``_DEFAULTS``):
``epochs``, ``replay_ratio``, ``vtrace_lambda``, ``normalize_rewards``, ``grad_noise_scale``,
``replay_checkpoint_max_bytes``.

Checkpoints (``state_dict``): policy, critic, target network, Adam state, KL coefficient, reward
statistics, update counters, seed, and the replay buffer's bookkeeping (arrival numbers, use
counts, round-robin cursor, counters). The buffer's batches themselves are included while they
total at most ``replay_checkpoint_max_bytes`` (64 MiB by default: a full Hopper buffer is ~1 MB);
beyond that (Atari frames) they are DROPPED and a resumed learner starts with an empty buffer
(``replay_dropped_on_load`` counts the uses lost), so its next updates replay less than an
uninterrupted run would.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.distributions import Distribution

from nitro.config import ImpactConfig
from nitro.envs import EnvSpec
from nitro.models import Critic, Policy, build_critic, build_policy
from nitro.ppo import (
    _FORWARD_CHUNK,
    RunningMeanStd,
    _forward_dist_params,
    _forward_values,
    _maybe_json,
    _normalise,
    _np64,
    _np_bool,
    adapt_kl_coef,
    dist_from_params,
    entropy_bonus,
    explained_variance,
    kl_penalty,
    gradient_noise_scale,
    load_optimizer,
    merge_round_statistics,
    optimizer_tensors,
    minibatch_indices,
    successor_layout,
    training_rewards,
)

ArrayLike = np.ndarray | torch.Tensor

# Settings that ImpactConfig may not (yet) have; read with getattr(cfg, name, default).
_DEFAULTS: dict[str, Any] = {
    "epochs": 2,  # SGD passes over one update's samples (new + replayed)
    "replay_ratio": 1.0,  # replayed batches per new batch in update()
    "vtrace_lambda": 1.0,  # Espeholt's lambda in c_i = lambda * min(c_bar, pi/mu); 1 = the paper
    "normalize_rewards": True,  # rewards / std of discounted returns, as PPOLearner
    "grad_noise_scale": True,  # B_simple for the kungfu scaler: one extra policy backward per minibatch
    "replay_checkpoint_max_bytes": 64 * 1024 * 1024,
}


def _setting(cfg: Any, name: str) -> Any:
    return getattr(cfg, name, _DEFAULTS[name])


# ---------------------------------------------------------------------------------------------
# 1. Pure functions
# ---------------------------------------------------------------------------------------------


class VTraceReturns(NamedTuple):
    vs: ArrayLike  # V-trace value targets v_s
    q: ArrayLike  # r_s + gamma * v_{s+1} (the successor's target; bootstrap value at a cut; 0 after termination)
    rho: ArrayLike  # truncated importance weights min(rho_bar, pi/mu)
    pg_advantages: ArrayLike  # rho_s * (q_s - V(x_s))


def vtrace_returns(
    behaviour_logp: ArrayLike,
    target_logp: ArrayLike,
    rewards: ArrayLike,
    values: ArrayLike,
    next_values: ArrayLike,
    terminated: ArrayLike,
    episode_end: ArrayLike,
    gamma: float,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> VTraceReturns:
    """V-trace over one sequence of T steps (see the module docstring). ``terminated[t]``: the
    successor is worth 0 whatever ``next_values[t]`` holds; ``episode_end[t]`` (terminated or a
    bootstrap point): the trace is cut after t. The last step is always a cut. Works on numpy
    arrays or torch tensors; computed in float64, returned in the input's kind."""
    as_torch = isinstance(rewards, torch.Tensor)
    mu, pi, r, v, nv = (_np64(x) for x in (behaviour_logp, target_logp, rewards, values, next_values))
    term, end = _np_bool(terminated), _np_bool(episode_end).copy()
    T = len(r)
    if not all(len(x) == T for x in (mu, pi, v, nv, term, end)):
        raise ValueError("vtrace: all inputs must have the same length")
    if rho_bar <= 0 or c_bar <= 0:
        raise ValueError("vtrace: rho_bar and c_bar must be positive")
    end = end | term
    if T:
        end[-1] = True
    log_ratio = pi - mu
    # min(bar, exp(x)) = exp(min(log bar, x)): no overflow for large ratios
    rho = np.exp(np.minimum(log_ratio, math.log(rho_bar)))
    c = lam * np.exp(np.minimum(log_ratio, math.log(c_bar)))
    succ = np.where(term, 0.0, nv)
    delta = rho * (r + gamma * succ - v)
    vs_minus_v = np.zeros(T, dtype=np.float64)
    acc = 0.0
    for t in range(T - 1, -1, -1):  # backwards: v_t - V_t = delta_t + gamma c_t (v_{t+1} - V_{t+1})
        acc = delta[t] + (0.0 if end[t] else gamma * c[t] * acc)
        vs_minus_v[t] = acc
    vs = v + vs_minus_v
    vs_next = np.empty(T, dtype=np.float64)
    vs_next[:-1] = vs[1:]
    vs_next = np.where(end, succ, vs_next)  # at a cut the successor is the bootstrap value (or 0)
    q = r + gamma * vs_next
    pg = rho * (q - v)
    if as_torch:
        device = rewards.device
        return VTraceReturns(*(torch.from_numpy(x).to(device) for x in (vs, q, rho, pg)))
    return VTraceReturns(vs, q, rho, pg)


def vtrace(
    behaviour_logp: ArrayLike,
    target_logp: ArrayLike,
    rewards: ArrayLike,
    values: ArrayLike,
    next_values: ArrayLike,
    terminated: ArrayLike,
    episode_end: ArrayLike,
    gamma: float,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> tuple[ArrayLike, ArrayLike]:
    """(vs, pg_advantages) of ``vtrace_returns``; Espeholt et al.'s two outputs."""
    out = vtrace_returns(behaviour_logp, target_logp, rewards, values, next_values, terminated, episode_end,
                         gamma, rho_bar, c_bar, lam)
    return out.vs, out.pg_advantages


def truncated_is_weight(logp_target: torch.Tensor, logp_behaviour: torch.Tensor, rho_bar: float = 1.0) -> torch.Tensor:
    """min(rho_bar, pi_target / mu), detached (neither policy is the one being trained)."""
    log_w = torch.clamp((logp_target - logp_behaviour).detach(), max=math.log(rho_bar))
    return torch.exp(log_w)


def impact_surrogate(
    logp_new: torch.Tensor,
    logp_target: torch.Tensor,
    logp_behaviour: torch.Tensor,
    adv: torch.Tensor,
    clip: float,
    rho_bar: float = 1.0,
) -> torch.Tensor:
    """-mean(w * min(r A, clip(r, 1-clip, 1+clip) A)), r = pi_new/pi_target, w = min(rho_bar, pi_target/mu).

    ``adv`` is the unweighted advantage q_s - V(x_s); the truncated weight is applied here."""
    w = truncated_is_weight(logp_target, logp_behaviour, rho_bar)
    ratio = torch.exp(logp_new - logp_target.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv
    return -(w * torch.min(unclipped, clipped)).mean()


def vtrace_value_loss(values: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """mean((V(x_s) - v_s)^2): regression on the V-trace targets (no 0.5, as nitro.ppo.value_loss)."""
    return ((values - vs.detach()) ** 2).mean()


def impact_loss(
    new_dist: Distribution,
    target_dist: Distribution,
    actions: torch.Tensor,
    logp_target: torch.Tensor,
    logp_behaviour: torch.Tensor,
    adv: torch.Tensor,
    values: torch.Tensor,
    vs: torch.Tensor,
    *,
    clip: float,
    rho_bar: float,
    kl_coef: float,
    vf_coef: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = impact_surrogate + kl_coef * KL(target || new) + vf_coef * VF - entropy_coef * H.
    Returns (total, detached terms for logging)."""
    logp_new = new_dist.log_prob(actions)
    surrogate = impact_surrogate(logp_new, logp_target, logp_behaviour, adv, clip, rho_bar)
    kl = kl_penalty(target_dist, new_dist)
    vf = vtrace_value_loss(values, vs)
    entropy = entropy_bonus(new_dist)
    total = surrogate + kl_coef * kl + vf_coef * vf - entropy_coef * entropy
    with torch.no_grad():
        clip_frac = ((torch.exp(logp_new - logp_target) - 1.0).abs() > clip).float().mean()
    terms = {
        "policy_loss": surrogate.detach(),
        "kl": kl.detach(),
        "vf_loss": vf.detach(),
        "entropy": entropy.detach(),
        "clip_frac": clip_frac,
    }
    return total, terms


# ---------------------------------------------------------------------------------------------
# 2. The circular replay buffer
# ---------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    seq: int  # arrival number (0, 1, 2, ... over the buffer's life)
    uses: int  # times trained on so far
    batch: dict[str, np.ndarray]


class ReplayBuffer:
    """At most ``capacity`` batches; each is trained on at most ``max_reuse`` (K) times, then evicted.

    * ``add(batch, uses=0)``: store a batch that has already been trained on ``uses`` times (the
      learner adds a fresh batch with ``uses=1``: the update it arrived in is its first use). If
      that already reaches K it is not stored. When full, the OLDEST batch is overwritten (the
      circular buffer), counted in ``n_dropped`` if it still had uses left.
    * ``take(n)``: up to n distinct batches, round-robin in arrival order starting after the last
      batch handed out; each gets one use, and a batch reaching K uses is evicted
      (``n_exhausted``). Returns [] when the buffer is empty.
    """

    def __init__(self, capacity: int, max_reuse: int):
        if capacity < 1 or max_reuse < 1:
            raise ValueError("ReplayBuffer: capacity and max_reuse must be >= 1")
        self.capacity, self.max_reuse = int(capacity), int(max_reuse)
        self._entries: list[_Entry] = []  # in arrival order
        self._next_seq = 0
        self._cursor = -1  # arrival number of the last batch handed out
        self.n_added = self.n_exhausted = self.n_dropped = self.n_replays = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def remaining_uses(self) -> int:
        return sum(self.max_reuse - e.uses for e in self._entries)

    def uses(self) -> list[tuple[int, int]]:
        """(arrival number, uses) of every stored batch, oldest first."""
        return [(e.seq, e.uses) for e in self._entries]

    def add(self, batch: dict[str, np.ndarray], uses: int = 0) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self.n_added += 1
        if uses >= self.max_reuse:
            self.n_exhausted += 1
            return seq
        if len(self._entries) >= self.capacity:
            self._entries.pop(0)
            self.n_dropped += 1  # every stored batch has a use left (spent ones are evicted at once)
        self._entries.append(_Entry(seq, int(uses), batch))
        return seq

    def take(self, n: int) -> list[dict[str, np.ndarray]]:
        if n <= 0 or not self._entries:
            return []
        after = [e for e in self._entries if e.seq > self._cursor]
        before = [e for e in self._entries if e.seq <= self._cursor]
        chosen = (after + before)[:n]
        for e in chosen:
            e.uses += 1
            self.n_replays += 1
        self._cursor = chosen[-1].seq
        spent = {id(e) for e in chosen if e.uses >= self.max_reuse}
        self.n_exhausted += len(spent)
        self._entries = [e for e in self._entries if id(e) not in spent]
        return [e.batch for e in chosen]

    # -- checkpoints ------------------------------------------------------------------------------

    def bookkeeping(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity, "max_reuse": self.max_reuse, "entries": [list(u) for u in self.uses()],
            "next_seq": self._next_seq, "cursor": self._cursor, "n_added": self.n_added,
            "n_exhausted": self.n_exhausted, "n_dropped": self.n_dropped, "n_replays": self.n_replays,
        }

    def batches(self) -> dict[int, dict[str, np.ndarray]]:
        return {e.seq: e.batch for e in self._entries}

    def restore(self, book: dict[str, Any], batches: dict[int, dict[str, np.ndarray]] | None) -> int:
        """Inverse of ``bookkeeping``/``batches``. Entries whose batch is missing are dropped;
        returns how many uses were lost that way."""
        self._next_seq, self._cursor = int(book["next_seq"]), int(book["cursor"])
        for k in ("n_added", "n_exhausted", "n_dropped", "n_replays"):
            setattr(self, k, int(book[k]))
        self._entries, lost = [], 0
        for seq, uses in book["entries"]:
            if batches is not None and int(seq) in batches:
                self._entries.append(_Entry(int(seq), int(uses), batches[int(seq)]))
            else:
                lost += self.max_reuse - int(uses)
        while len(self._entries) > self.capacity:
            self._entries.pop(0)
        return lost


# ---------------------------------------------------------------------------------------------
# 3. Batch preparation
# ---------------------------------------------------------------------------------------------


def prepare_impact_batches(
    batches: Sequence[dict[str, np.ndarray]],
    policy: Policy,
    target: Policy,
    critic: Critic,
    gamma: float,
    reward_scale: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Concatenate actor batches into training tensors with V-trace targets.

    Each batch is its own sequence (V-trace never runs across two batches). Values and successor
    values come from ``critic(policy.features(.))`` (the current critic and normaliser); rho and c
    from the target policy against the behaviour log-probabilities. Keys: obs, actions, logp
    (behaviour mu), rewards (as trained on), values, vs, advantages (q - V, UNweighted: the
    surrogate applies the truncated weight), pg_advantages (rho * (q - V)), rho, target_logp, and
    the target policy's distribution parameters ``old_loc``/``old_scale`` or ``old_logits``."""
    if not batches:
        raise ValueError("prepare_impact_batches needs at least one batch")
    device = next(policy.parameters()).device
    is_atari = policy.spec.is_atari
    keys = ("obs", "actions", "logp", "rewards", "values", "vs", "advantages", "pg_advantages", "rho", "target_logp")
    cols: dict[str, list[Any]] = {k: [] for k in keys}
    old_parts: list[dict[str, torch.Tensor]] = []
    for batch in batches:
        T = len(batch["rewards"])
        if T == 0:
            continue
        obs = torch.as_tensor(batch["obs"], device=device)
        actions = torch.as_tensor(batch["actions"], device=device)
        episode_end, _ = successor_layout(T, batch["terminated"], batch["bootstrap_idx"])
        values = _forward_values(policy, critic, obs).double().cpu().numpy()
        next_values = np.zeros(T, dtype=np.float64)
        next_values[:-1] = values[1:]
        boot_idx = np.asarray(batch["bootstrap_idx"], dtype=np.int64)
        if boot_idx.size:
            boot_obs = torch.as_tensor(batch["bootstrap_obs"], device=device)
            next_values[boot_idx] = _forward_values(policy, critic, boot_obs).double().cpu().numpy()
        terminated = np.asarray(batch["terminated"], dtype=bool)
        next_values[terminated] = 0.0
        old = _forward_dist_params(target, obs)
        with torch.no_grad():
            target_logp = dist_from_params(old).log_prob(actions).float()
        logp = torch.as_tensor(batch["logp"], dtype=torch.float32, device=device)
        rewards = training_rewards(batch["rewards"], is_atari, reward_scale)
        vt = vtrace_returns(logp.cpu().numpy(), target_logp.cpu().numpy(), rewards, values, next_values,
                            terminated, episode_end, gamma, rho_bar, c_bar, lam)
        cols["obs"].append(obs)
        cols["actions"].append(actions)
        cols["logp"].append(logp)
        cols["target_logp"].append(target_logp)
        old_parts.append(old)
        for key, arr in (("rewards", rewards), ("values", values), ("vs", vt.vs), ("advantages", vt.q - values),
                         ("pg_advantages", vt.pg_advantages), ("rho", vt.rho)):
            cols[key].append(torch.as_tensor(arr, dtype=torch.float32, device=device))
    if not cols["obs"]:
        raise ValueError("prepare_impact_batches got only empty batches")
    out = {k: torch.cat(v) for k, v in cols.items()}
    out.update({k: torch.cat([p[k] for p in old_parts]) for k in old_parts[0]})
    return out


# ---------------------------------------------------------------------------------------------
# 4. The learner
# ---------------------------------------------------------------------------------------------


class ImpactLearner:
    """The IMPACT learner: policy, frozen target policy, critic, one Adam, adaptive KL coefficient,
    reward scale and the replay buffer. Same interface as ``PPOLearner``."""

    def __init__(self, spec: EnvSpec, cfg: ImpactConfig, seed: int, device: str | torch.device = "cpu"):
        self.spec, self.cfg, self.seed = spec, cfg, int(seed)
        self.device = torch.device(device)
        self.policy: Policy = build_policy(spec, seed).to(self.device)
        self.critic: Critic = build_critic(spec, seed).to(self.device)
        self.target: Policy = copy.deepcopy(self.policy)
        self.target.requires_grad_(False)
        self.optimizer = torch.optim.Adam(
            [*self.policy_parameters(), *self.critic.parameters()], lr=cfg.lr, eps=1e-5  # eps as PPOLearner
        )
        self.kl_coef: float = float(cfg.kl_coef)
        self.reward_stats = RunningMeanStd()
        self.replay = ReplayBuffer(cfg.replay_capacity, cfg.replay_max_reuse)
        self.n_updates = 0  # update() and replay_update() calls that trained
        self.n_target_updates = 0
        self.last_n_new_batches = 0
        self.replay_dropped_on_load = 0
        self._target_refreshed = False
        self.last_batch: dict[str, torch.Tensor] | None = None

    # -- what other modules read ----------------------------------------------------------------

    def policy_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def weights(self) -> dict[str, torch.Tensor]:
        """policy.state_dict() (normaliser included), detached copies on the CPU, for publishing."""
        return {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}

    @property
    def reward_scale(self) -> float:
        if not _setting(self.cfg, "normalize_rewards"):
            return 1.0
        return 1.0 / math.sqrt(self.reward_stats.var + 1e-8)

    def prepare(self, batches: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """``prepare_impact_batches`` with this learner's networks (current target) and settings."""
        cfg = self.cfg
        return prepare_impact_batches(batches, self.policy, self.target, self.critic, cfg.gamma, self.reward_scale,
                                      cfg.rho_bar, cfg.c_bar, _setting(cfg, "vtrace_lambda"))

    # -- the update -----------------------------------------------------------------------------

    def update(self, batches: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
        """Train on new batches plus replayed ones (see the module docstring); returns metrics."""
        start = time.perf_counter()
        new = [b for b in batches if len(b["rewards"])]
        if not new:
            raise ValueError("ImpactLearner.update needs at least one non-empty batch")
        self._maybe_refresh_target()
        n_replay = math.ceil(float(_setting(self.cfg, "replay_ratio")) * len(new))
        replayed = self.replay.take(n_replay)  # before adding: a new batch is never replayed in its own update
        for b in new:
            self.replay.add(b, uses=1)
        metrics = self._train(new, replayed)
        self._merge_statistics(new)
        self.last_n_new_batches = len(new)
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    def replay_update(self, n_batches: int | None = None) -> dict[str, float] | None:
        """One update purely from the buffer (``n_batches``, default: as many as the last update()
        had new batches); None when no stored batch has a use left. The normaliser and reward
        statistics are not touched (nothing new was seen)."""
        start = time.perf_counter()
        if not len(self.replay):
            return None
        n = int(n_batches) if n_batches is not None else max(1, self.last_n_new_batches)
        self._maybe_refresh_target()
        replayed = self.replay.take(n)
        if not replayed:
            return None
        metrics = self._train([], replayed)
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    def _maybe_refresh_target(self) -> None:
        if self.n_updates % self.cfg.target_update_freq == 0:
            self.target.load_state_dict(self.policy.state_dict())
            self.n_target_updates += 1
            self._target_refreshed = True
        else:
            self._target_refreshed = False

    def _minibatches(self, n: int, rng: np.random.Generator) -> list[torch.Tensor]:
        return minibatch_indices(n, self.cfg.minibatch_size, rng, self.device)

    def _policy_loss(self, data: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        """Policy-only part of impact_loss on a minibatch."""
        dist = self.policy.distribution(data["obs"][idx])
        old = dist_from_params({k: v[idx] for k, v in data.items() if k.startswith("old_")})
        adv = _normalise(data["advantages"][idx])
        surrogate = impact_surrogate(dist.log_prob(data["actions"][idx]), data["target_logp"][idx], data["logp"][idx],
                                     adv, self.cfg.clip, self.cfg.rho_bar)
        return surrogate + self.kl_coef * kl_penalty(old, dist) - self.cfg.entropy_coef * entropy_bonus(dist)

    def _grad_noise_scale(self, data: dict[str, torch.Tensor], minibatches: list[torch.Tensor]) -> dict[str, float]:
        if not _setting(self.cfg, "grad_noise_scale"):
            minibatches = minibatches[:1]  # fewer than two: reported as NaN
        return gradient_noise_scale(lambda idx: self._policy_loss(data, idx), self.policy_parameters(), minibatches)

    def _train(self, new: list[dict[str, np.ndarray]], replayed: list[dict[str, np.ndarray]]) -> dict[str, float]:
        cfg = self.cfg
        self.policy.train()
        self.critic.train()
        data = self.prepare(new + replayed)
        n_new = int(sum(len(b["rewards"]) for b in new))
        n = len(data["rewards"])
        is_new = torch.zeros(n, dtype=torch.bool, device=self.device)
        is_new[:n_new] = True
        data["is_new"] = is_new
        self.last_batch = data  # the boosting detector differentiates the surrogate on it
        rng = np.random.default_rng([self.seed, self.n_updates])  # reproducible from (seed, update count)

        first_epoch = self._minibatches(n, rng)
        metrics = self._grad_noise_scale(data, first_epoch)
        sums: dict[str, float] = {}
        n_steps = 0
        for epoch in range(int(_setting(cfg, "epochs"))):
            for idx in first_epoch if epoch == 0 else self._minibatches(n, rng):
                feats = self.policy.features(data["obs"][idx])
                dist = self.policy.distribution_from_features(feats)
                target = dist_from_params({k: v[idx] for k, v in data.items() if k.startswith("old_")})
                total, terms = impact_loss(
                    dist, target, data["actions"][idx], data["target_logp"][idx], data["logp"][idx],
                    _normalise(data["advantages"][idx]), self.critic(feats), data["vs"][idx],
                    clip=cfg.clip, rho_bar=cfg.rho_bar, kl_coef=self.kl_coef, vf_coef=cfg.vf_coef,
                    entropy_coef=cfg.entropy_coef,
                )
                self.optimizer.zero_grad(set_to_none=True)
                total.backward()
                nn.utils.clip_grad_norm_(self.policy_parameters(), cfg.max_grad_norm)
                nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                for k, v in terms.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                sums["loss"] = sums.get("loss", 0.0) + float(total.detach())
                n_steps += 1

        with torch.no_grad():  # KL(target || final policy) over the whole batch: drives the adaptive coefficient
            kl_final = float(
                sum(
                    kl_penalty(
                        dist_from_params({k: v[i] for k, v in data.items() if k.startswith("old_")}),
                        self.policy.distribution(data["obs"][i]),
                    ) * len(i)
                    for i in torch.split(torch.arange(n, device=self.device), _FORWARD_CHUNK)
                )
                / n
            )
        kl_coef_used = self.kl_coef
        self.kl_coef = adapt_kl_coef(self.kl_coef, kl_final, cfg.kl_target)
        self.optimizer.zero_grad(set_to_none=True)  # no .grad left behind for the detector's autograd
        self.n_updates += 1

        drift = (data["logp"] - data["target_logp"]).abs()
        metrics.update({k: v / max(n_steps, 1) for k, v in sums.items()})
        metrics.update({
            "kl": kl_final,
            "kl_minibatch_mean": sums.get("kl", 0.0) / max(n_steps, 1),
            "kl_coef_used": kl_coef_used,
            "kl_coef": self.kl_coef,
            "explained_variance": explained_variance(data["values"], data["vs"]),
            "logp_drift": float(drift[:n_new].mean()) if n_new else float("nan"),  # mu vs target on new data
            "logp_drift_replay": float(drift[n_new:].mean()) if n > n_new else float("nan"),
            "is_weight_mean": float(data["rho"].mean()),
            "is_truncated_frac": float((data["target_logp"] - data["logp"] > math.log(cfg.rho_bar)).float().mean()),
            "reward_scale": self.reward_scale,
            "n_samples": float(n),
            "n_new_samples": float(n_new),
            "n_replay_samples": float(n - n_new),
            "n_new_batches": float(len(new)),
            "n_replay_batches": float(len(replayed)),
            "replay_buffer_batches": float(len(self.replay)),
            "replay_remaining_uses": float(self.replay.remaining_uses),
            "target_refreshed": float(self._target_refreshed),
            "sgd_steps": float(n_steps),
        })
        return metrics

    def _merge_statistics(self, batches: Sequence[dict[str, np.ndarray]]) -> None:
        """After the update, NEW batches only: raw observations into the policy's normaliser,
        discounted raw returns (sign-clipped on Atari) into the reward-scale statistics."""
        stats = self.reward_stats if _setting(self.cfg, "normalize_rewards") else None
        merge_round_statistics(self.policy, stats, batches, self.spec.is_atari, self.cfg.gamma)

    # -- for the boosting detector --------------------------------------------------------------

    def surrogate_closure(self, batch_tensors: dict[str, torch.Tensor], indices: ArrayLike) -> Callable[[], torch.Tensor]:
        """A closure giving the policy-only IMPACT LOSS on ``indices`` of ``batch_tensors`` (from
        ``prepare`` / ``last_batch``) as a differentiable function of ``policy_parameters()``:
        impact_surrogate (ratio against the target policy stored as ``old_*``/``target_logp``,
        truncated weight against the behaviour ``logp``) + kl_coef * KL(target || current) -
        entropy_coef * H. Advantages are normalised over the subset; kl_coef is the one in force
        when the closure is made. Features are computed once (the normaliser has no parameters)."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long, device=self.device)
        with torch.no_grad():
            feats = self.policy.features(batch_tensors["obs"][idx])
        actions = batch_tensors["actions"][idx]
        logp_b = batch_tensors["logp"][idx]
        adv = _normalise(batch_tensors["advantages"][idx])
        old = dist_from_params({k: v[idx] for k, v in batch_tensors.items() if k.startswith("old_")})
        if "target_logp" in batch_tensors:
            logp_t = batch_tensors["target_logp"][idx]
        else:
            with torch.no_grad():
                logp_t = old.log_prob(actions)
        kl_coef, clip, rho_bar, ent_coef = self.kl_coef, self.cfg.clip, self.cfg.rho_bar, self.cfg.entropy_coef
        policy = self.policy

        def closure() -> torch.Tensor:
            dist = policy.distribution_from_features(feats)
            loss = impact_surrogate(dist.log_prob(actions), logp_t, logp_b, adv, clip, rho_bar) + kl_coef * kl_penalty(old, dist)
            return loss - ent_coef * entropy_bonus(dist) if ent_coef else loss

        return closure

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta) for ``dumps_tensors``. Tensors: ``policy.*``, ``target.*``, ``critic.*``,
        ``optim.{i}.{key}``, and ``replay.{seq}.{key}`` for the buffer's batches when they total at
        most ``replay_checkpoint_max_bytes`` (else none: see the module docstring)."""
        tensors: dict[str, torch.Tensor] = {}
        for prefix, module in (("policy", self.policy), ("target", self.target), ("critic", self.critic)):
            for k, v in module.state_dict().items():
                tensors[f"{prefix}.{k}"] = v.detach().cpu().clone()
        optim, param_groups = optimizer_tensors(self.optimizer)
        tensors.update(optim)
        stored = self.replay.batches()
        nbytes = sum(np.asarray(a).nbytes for b in stored.values() for a in b.values())
        keep = nbytes <= int(_setting(self.cfg, "replay_checkpoint_max_bytes"))
        if keep:
            for seq, b in stored.items():
                for key, arr in b.items():
                    tensors[f"replay.{seq}.{key}"] = torch.from_numpy(np.ascontiguousarray(arr).copy())
        meta = {
            "format": "nitro.impact_learner/1",
            "env_id": self.spec.env_id,
            "kl_coef": self.kl_coef,
            "reward_mean": self.reward_stats.mean,
            "reward_var": self.reward_stats.var,
            "reward_count": self.reward_stats.count,
            "n_updates": self.n_updates,
            "n_target_updates": self.n_target_updates,
            "last_n_new_batches": self.last_n_new_batches,
            "seed": self.seed,
            "optim_param_groups": param_groups,
            "replay": self.replay.bookkeeping(),
            "replay_batches_included": keep,
            "replay_bytes": int(nbytes),
        }
        return tensors, json.loads(json.dumps(meta))

    def load_state_dict(self, tensors: dict[str, ArrayLike], meta: dict[str, Any]) -> None:
        """Inverse of ``state_dict``; ``meta`` values may be JSON strings, tensors numpy arrays."""
        meta = {k: _maybe_json(v) for k, v in meta.items()}
        if meta.get("format") != "nitro.impact_learner/1":
            raise ValueError(f"not an IMPACT learner state (format {meta.get('format')!r})")
        if meta.get("env_id") != self.spec.env_id:
            raise ValueError(f"learner state is for {meta.get('env_id')!r}, this learner is for {self.spec.env_id!r}")
        t = {k: torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
        for prefix, module in (("policy", self.policy), ("target", self.target), ("critic", self.critic)):
            n = len(prefix) + 1
            module.load_state_dict({k[n:]: v for k, v in t.items() if k.startswith(prefix + ".")}, strict=True)
        load_optimizer(self.optimizer, t, meta["optim_param_groups"])
        self.kl_coef = float(meta["kl_coef"])
        self.reward_stats.mean = float(meta["reward_mean"])
        self.reward_stats.var = float(meta["reward_var"])
        self.reward_stats.count = float(meta["reward_count"])
        self.n_updates = int(meta["n_updates"])
        self.n_target_updates = int(meta["n_target_updates"])
        self.last_n_new_batches = int(meta["last_n_new_batches"])
        self.seed = int(meta["seed"])
        batches: dict[int, dict[str, np.ndarray]] = {}
        for k, v in t.items():
            if k.startswith("replay."):
                _, seq, key = k.split(".", 2)
                batches.setdefault(int(seq), {})[key] = v.cpu().numpy().copy()
        self.replay = ReplayBuffer(self.cfg.replay_capacity, self.cfg.replay_max_reuse)
        self.replay_dropped_on_load = self.replay.restore(meta["replay"], batches)
