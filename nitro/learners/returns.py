"""The critic's targets and the advantages over one actor batch: GAE for PPO, V-trace for IMPACT.

Both start from the batch's episode structure and the critic's value of every step and of its
successor (``values_and_successors``): the successor is worth 0 after a termination,
V(bootstrap_obs) at a time-limit truncation or at the end of the rollout, V(obs[t+1]) otherwise.
The chain of advantages (or of V-trace corrections) is cut at every episode end, because the next
step belongs to another episode. Each actor batch is its own sequence: neither recursion runs
across two batches. The recursions run in numpy float64 whatever they are given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from nitro.learners.arrays import ArrayLike, as_bool, as_float64
from nitro.learners.distributions import forward_values
from nitro.models.networks import Critic, Policy


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

    ``terminated[t]``: the successor is worth 0 (whatever ``next_values[t]`` holds).
    ``episode_end[t]``: terminated OR a bootstrap point (time-limit truncation, end of rollout);
    the chain is cut there. The last step is always a cut (nothing follows it).
    Works on numpy arrays or torch tensors; the result has the input's kind, computed in float64.
    """
    as_torch = isinstance(rewards, torch.Tensor)
    r, v, nv = (as_float64(x) for x in (rewards, values, next_values))
    term, end = as_bool(terminated), as_bool(episode_end)
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
    """V-trace (Espeholt et al. 2018, Eq. 1 and Remark 1) over one sequence of T steps, with
    truncated importance weights ``rho_t = min(rho_bar, pi/mu)`` and trace cutters
    ``c_i = lam * min(c_bar, pi/mu)``:

        delta_t = rho_t (r_t + gamma V(x_{t+1}) - V(x_t))
        v_s     = V(x_s) + sum_{t=s}^{e(s)} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t

    where ``e(s)`` is the end of the episode that contains s. Policy-gradient advantage:
    ``q_s = r_s + gamma v_{s+1}`` (``v_{s+1}``: the successor's target, the bootstrap value at a
    cut, 0 after a termination) and ``pg_advantages = rho_s (q_s - V(x_s))``.

    ``terminated[t]``: the successor is worth 0 whatever ``next_values[t]`` holds;
    ``episode_end[t]`` (terminated or a bootstrap point): the trace is cut after t. The last step
    is always a cut. Works on numpy arrays or torch tensors; computed in float64, returned in the
    input's kind."""
    as_torch = isinstance(rewards, torch.Tensor)
    mu, pi, r, v, nv = (as_float64(x) for x in (behaviour_logp, target_logp, rewards, values, next_values))
    term, end = as_bool(terminated), as_bool(episode_end).copy()
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
