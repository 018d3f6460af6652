"""IMPACT (Luo et al., ICLR 2020) for Nitro's learner: V-trace, the target-network surrogate, a
circular replay buffer, and ``ImpactLearner`` (a ``nitro.learners.OffPolicyLearner``). What it
shares with PPO (the exact KL penalty, the entropy bonus, the adaptive KL rule, forward passes,
reward scale, minibatches, checkpoint helpers) lives in ``nitro.learners.common``.

Read top to bottom. The pieces, and the choices behind them:

* ``vtrace`` / ``vtrace_returns``: V-trace targets (Espeholt et al. 2018, Eq. 1 and Remark 1) over
  one concatenated sequence, with truncated importance weights ``rho_t = min(rho_bar, pi/mu)`` and
  trace cutters ``c_i = lam * min(c_bar, pi/mu)``:

      delta_t = rho_t (r_t + gamma V(x_{t+1}) - V(x_t))
      v_s     = V(x_s) + sum_{t=s}^{e(s)} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t

  where ``e(s)`` is the end of the episode that contains s. The successor value of every step is
  given explicitly (``next_values``), with the conventions of ``common.values_and_successors``: 0 after a
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
  convention of ``nitro.learners.ppo.value_loss``, which vf_coef = 1.0 assumes).
* ``impact_policy_loss``: THE policy objective: impact_surrogate + kl_coef * KL(pi_target ||
  pi_theta) - entropy_coef * H (``common.penalised_policy_loss``: exact KL, entropy term only when
  its coefficient is > 0), with RLlib's adaptive coefficient (``common.adapt_kl_coef``, target
  ``kl_target``). Training, the gradient-noise-scale estimate and the detector's ``objective``
  all call it. ``impact_loss`` = ``impact_policy_loss`` + vf_coef * VF.

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

Every setting is an ``ImpactConfig`` field (``nitro/config.py`` documents each one).

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
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.distributions import Distribution

from nitro.config import ImpactConfig
from nitro.envs import EnvSpec
from nitro.learners import common
from nitro.learners.common import ActorCriticLearner, ArrayLike, Tensors
from nitro.models import Critic, Policy
from nitro.validation import BatchError, check_batch

log = logging.getLogger("nitro")
if TYPE_CHECKING:  # annotations only: nitro.learners re-exports this module's learner
    from nitro.learners import Batch


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
    mu, pi, r, v, nv = (common.as_float64(x) for x in (behaviour_logp, target_logp, rewards, values, next_values))
    term, end = common.as_bool(terminated), common.as_bool(episode_end).copy()
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


def vtrace(*args: Any, **kwargs: Any) -> tuple[ArrayLike, ArrayLike]:
    """(vs, pg_advantages) of ``vtrace_returns`` (same arguments); Espeholt et al.'s two outputs."""
    out = vtrace_returns(*args, **kwargs)
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
    """mean((V(x_s) - v_s)^2): regression on the V-trace targets (no 0.5, as ``ppo.value_loss``)."""
    return ((values - vs.detach()) ** 2).mean()


def impact_policy_loss(
    new_dist: Distribution,
    target_dist: Distribution,
    actions: torch.Tensor,
    logp_target: torch.Tensor,
    logp_behaviour: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip: float,
    rho_bar: float,
    kl_coef: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy objective, as a loss: impact_surrogate + kl_coef * KL(target || new)
    - entropy_coef * H (the H term only when entropy_coef > 0). Returns (loss, detached terms)."""
    logp_new = new_dist.log_prob(actions)
    surrogate = impact_surrogate(logp_new, logp_target, logp_behaviour, adv, clip, rho_bar)
    loss, terms = common.penalised_policy_loss(surrogate, new_dist, target_dist, kl_coef=kl_coef, entropy_coef=entropy_coef)
    return loss, {**terms, "clip_frac": common.clip_fraction(logp_new - logp_target, clip)}


def policy_inputs(
    data: Tensors, idx: torch.Tensor
) -> tuple[Distribution, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target_dist, actions, logp_target, logp_behaviour, adv) of ``impact_policy_loss`` for rows
    ``idx`` of a prepared batch; the advantages are normalised over those rows."""
    return (common.anchor_distribution(data, idx), data["actions"][idx], data["target_logp"][idx], data["logp"][idx],
            common.normalise_advantages(data["advantages"][idx]))


def impact_objective(
    policy: Policy, data: Tensors, indices: ArrayLike, *, clip: float, rho_bar: float, kl_coef: float,
    entropy_coef: float,
) -> Callable[[], torch.Tensor]:
    """``impact_policy_loss`` on rows ``indices`` of a prepared batch as a closure, a
    differentiable function of the policy's parameters (``common.policy_objective``: features
    once, no grad). The gradient noise scale and the boosting detector both differentiate it."""
    idx = common.as_indices(indices, data["obs"].device)
    inputs = policy_inputs(data, idx)
    return common.policy_objective(
        policy, data["obs"][idx],
        lambda dist: impact_policy_loss(dist, *inputs, clip=clip, rho_bar=rho_bar, kl_coef=kl_coef,
                                        entropy_coef=entropy_coef)[0],
    )


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
    """total = impact_policy_loss + vf_coef * VF. Returns (total, detached terms for logging)."""
    policy_loss, terms = impact_policy_loss(new_dist, target_dist, actions, logp_target, logp_behaviour, adv,
                                            clip=clip, rho_bar=rho_bar, kl_coef=kl_coef, entropy_coef=entropy_coef)
    vf = vtrace_value_loss(values, vs)
    return policy_loss + vf_coef * vf, {**terms, "vf_loss": vf.detach()}


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
    * ``admits(batch)``: whether ``check`` (``nitro.validation.check_batch`` for the learner's env)
      accepts it; a batch that fails is never stored nor restored (``n_rejected``), so a bad batch
      cannot come back through replay.
    """

    def __init__(self, capacity: int, max_reuse: int, check: Callable[[Mapping[str, np.ndarray]], None] | None = None):
        if capacity < 1 or max_reuse < 1:
            raise ValueError("ReplayBuffer: capacity and max_reuse must be >= 1")
        self.capacity, self.max_reuse = int(capacity), int(max_reuse)
        self.check = check
        self.n_rejected = 0
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

    def admits(self, batch: Mapping[str, np.ndarray]) -> bool:
        if self.check is None:
            return True
        try:
            self.check(batch)
        except BatchError as exc:
            self.n_rejected += 1
            log.warning("replay buffer: rejected a batch: %s", exc)
            return False
        return True

    def add(self, batch: dict[str, np.ndarray], uses: int = 0) -> int:
        """Store ``batch``; returns its arrival number, or -1 when ``check`` rejects it."""
        if not self.admits(batch):
            return -1
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
            if batches is not None and int(seq) in batches and self.admits(batches[int(seq)]):
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
    batches: Sequence[Batch],
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
    values (``common.values_and_successors``) come from ``critic(policy.features(.))`` (the current critic and normaliser); rho and c
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
        if len(batch["rewards"]) == 0:
            continue
        obs = torch.as_tensor(batch["obs"], device=device)
        actions = torch.as_tensor(batch["actions"], device=device)
        values, next_values, terminated, episode_end = common.values_and_successors(batch, obs, policy, critic)
        old = common.forward_dist_params(target, obs)
        with torch.no_grad():
            target_logp = common.dist_from_params(old).log_prob(actions).float()
        logp = torch.as_tensor(batch["logp"], dtype=torch.float32, device=device)
        rewards = common.training_rewards(batch["rewards"], is_atari, reward_scale)
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


class ImpactLearner(ActorCriticLearner):
    """The IMPACT learner: policy, critic, one Adam, adaptive KL coefficient and reward scale
    (``common.ActorCriticLearner``), plus the frozen target policy and the replay buffer. A
    ``nitro.learners.OffPolicyLearner``."""

    cfg: ImpactConfig

    def __init__(self, spec: EnvSpec, cfg: ImpactConfig, seed: int, device: str | torch.device = "cpu", **kwargs: Any):
        super().__init__(spec, cfg, seed, device, **kwargs)
        self.target: Policy = copy.deepcopy(self.policy)
        self.target.requires_grad_(False)
        self.replay = ReplayBuffer(cfg.replay_capacity, cfg.replay_max_reuse, check=self._check_batch)
        self.n_target_updates = 0  # (n_updates counts update() and replay_update() calls that trained)
        self.last_n_new_batches = 0
        self.replay_dropped_on_load = 0
        self._target_refreshed = False

    def _check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        check_batch(batch, self.spec)

    def prepare(self, batches: Sequence[Batch]) -> dict[str, torch.Tensor]:
        """``prepare_impact_batches`` with this learner's networks (current target) and settings."""
        cfg = self.cfg
        return prepare_impact_batches(batches, self.policy, self.target, self.critic, cfg.gamma, self.reward_scale,
                                      cfg.rho_bar, cfg.c_bar, cfg.vtrace_lambda)

    def _coefs(self) -> dict[str, float]:
        """``impact_policy_loss``'s coefficients, with the KL coefficient now in force."""
        cfg = self.cfg
        return {"clip": cfg.clip, "rho_bar": cfg.rho_bar, "kl_coef": self.kl_coef, "entropy_coef": cfg.entropy_coef}

    # -- the update -----------------------------------------------------------------------------

    def update(self, batches: Sequence[Batch]) -> dict[str, float]:
        """Train on new batches plus replayed ones (see the module docstring); returns metrics."""
        start = time.perf_counter()
        new = [b for b in batches if len(b["rewards"]) and self.replay.admits(b)]
        if not new:
            raise ValueError("ImpactLearner.update needs at least one non-empty, valid batch")
        self._maybe_refresh_target()
        n_replay = math.ceil(float(self.cfg.replay_ratio) * len(new))
        replayed = self.replay.take(n_replay)  # before adding: a new batch is never replayed in its own update
        for b in new:
            self.replay.add(b, uses=1)
        metrics = self._train(new, replayed)
        # Unlike PPO (whose clipping tolerates stale ratios), statistics are merged after training,
        # so that V-trace's weights compare the target policy with exactly the behaviour policy.
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

    def _train(self, new: list[Batch], replayed: list[Batch]) -> dict[str, float]:
        cfg = self.cfg
        self.policy.train()
        self.critic.train()
        data = self.prepare(new + replayed)
        n_new = int(sum(len(b["rewards"]) for b in new))
        n = len(data["rewards"])
        is_new = torch.zeros(n, dtype=torch.bool, device=self.device)
        is_new[:n_new] = True
        data["is_new"] = is_new

        def total_loss(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            feats = self.policy.features(data["obs"][idx])  # shared by the policy and the critic
            dist = self.policy.distribution_from_features(feats)
            return impact_loss(dist, *policy_inputs(data, idx), self.critic(feats), data["vs"][idx],
                               vf_coef=cfg.vf_coef, **self._coefs())

        metrics, n_steps = self._optimise(
            data, lambda idx: impact_objective(self.policy, data, idx, **self._coefs())(), total_loss,
            epochs=cfg.epochs,
        )
        drift = (data["logp"] - data["target_logp"]).abs()
        metrics.update({
            "explained_variance": common.explained_variance(data["values"], data["vs"]),
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

    # -- for the boosting detector --------------------------------------------------------------

    def objective(self, indices: ArrayLike) -> Callable[[], torch.Tensor]:
        """``impact_objective`` on ``indices`` of the last update's batch (new + replayed):
        impact_surrogate (ratio against the target policy stored as ``old_*``/``target_logp``,
        truncated weight against the behaviour ``logp``) + kl_coef * KL(target || current) -
        entropy_coef * H, a differentiable function of ``policy_parameters()``. Advantages are
        normalised over the subset; kl_coef is the one in force when the closure is made; features
        are computed once, with the normaliser as it is now."""
        return impact_objective(self.policy, self._require_batch(), indices, **self._coefs())

    # -- checkpoints ------------------------------------------------------------------------------

    def _modules(self) -> dict[str, nn.Module]:
        return {"policy": self.policy, "target": self.target, "critic": self.critic}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta) for ``dumps_tensors``. Tensors: ``policy.*``, ``target.*``, ``critic.*``,
        ``optim.{i}.{key}``, and ``replay.{seq}.{key}`` for the buffer's batches when they total at
        most ``replay_checkpoint_max_bytes`` (else none: see the module docstring)."""
        tensors = common.module_tensors(self._modules())
        optim, param_groups = common.optimizer_tensors(self.optimizer)
        tensors.update(optim)
        stored = self.replay.batches()
        nbytes = sum(np.asarray(a).nbytes for b in stored.values() for a in b.values())
        keep = nbytes <= int(self.cfg.replay_checkpoint_max_bytes)
        if keep:
            for seq, b in stored.items():
                for key, arr in b.items():
                    tensors[f"replay.{seq}.{key}"] = torch.from_numpy(np.ascontiguousarray(arr).copy())
        meta = {
            **self._common_meta("nitro.impact_learner/1"),
            "n_target_updates": self.n_target_updates,
            "last_n_new_batches": self.last_n_new_batches,
            "optim_param_groups": param_groups,
            "replay": self.replay.bookkeeping(),
            "replay_batches_included": keep,
            "replay_bytes": int(nbytes),
        }
        return tensors, json.loads(json.dumps(meta))

    def load_state_dict(self, tensors: Mapping[str, ArrayLike], meta: Mapping[str, Any]) -> None:
        """Inverse of ``state_dict``; ``meta`` values may be JSON strings, tensors numpy arrays."""
        t, meta = self._load_common(self._modules(), tensors, meta, fmt="nitro.impact_learner/1")
        self.n_target_updates = int(meta["n_target_updates"])
        self.last_n_new_batches = int(meta["last_n_new_batches"])
        batches: dict[int, dict[str, np.ndarray]] = {}
        for k, v in t.items():
            if k.startswith("replay."):
                _, seq, key = k.split(".", 2)
                batches.setdefault(int(seq), {})[key] = v.cpu().numpy().copy()
        self.replay = ReplayBuffer(self.cfg.replay_capacity, self.cfg.replay_max_reuse, check=self._check_batch)
        self.replay_dropped_on_load = self.replay.restore(meta["replay"], batches)
