"""The actor's work: roll a policy out in one environment for a fixed number of steps, or play
whole episodes to evaluate it.

``rollout`` is a pure function of (weights, env id, seed, n_steps, the episode it continues):
the same inputs give the same batch, bit for bit. Local worker processes and the Lambda handler
both call it unchanged. It may be handed an env and a policy object to reuse across warm
invocations; it reseeds (or restores) and reloads them, so reuse never changes the result.

Episodes outlive an invocation (``nitro/episodes.py``): a rollout may start from the snapshot of
an episode that an earlier invocation left unfinished, and it returns the snapshot of its own
unfinished episode (``RolloutResult.carry``) for a later one to continue. An episode's return is
reported once, by the rollout that sees it end, and it is the return of the whole episode.

Episode ends are handled by hand (no autoreset): a terminated step has no successor, a
time-limit truncation and the rollout's last step record the observation to bootstrap from
(see the batch table in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch

from nitro.envs import env_spec, make_env
from nitro.episodes import EpisodeSnapshot, can_snapshot, restore_snapshot, take_snapshot
from nitro.models import Architecture, Policy, acting_policy, build_policy
from nitro.serialization import loads_tensors


@dataclass
class RolloutSummary:
    steps: int
    episode_returns: list[float] = field(default_factory=list)  # whole episodes that ended here
    episode_lengths: list[int] = field(default_factory=list)
    duration_s: float = 0.0


@dataclass
class RolloutResult:
    batch: dict[str, np.ndarray]
    summary: RolloutSummary
    carry: EpisodeSnapshot | None = None  # the unfinished episode, for a later invocation


def load_weights(policy: Policy, weights: dict[str, np.ndarray] | bytes) -> None:
    """Load a published state dict (arrays, or the bytes of ``dumps_tensors``) into ``policy``."""
    if isinstance(weights, (bytes, bytearray, memoryview)):
        weights, _ = loads_tensors(weights, expect_format="nitro.policy/1")
    state = {k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()}
    policy.load_state_dict(state, strict=True)


def _prepare(weights, env_id: str, arch: Architecture, policy: Policy | None, env: gym.Env | None):
    spec = env_spec(env_id)
    policy = policy if policy is not None else build_policy(spec, arch=arch)
    load_weights(policy, weights)
    policy.eval()
    return spec, acting_policy(policy), (env if env is not None else make_env(env_id))


def rollout(
    weights: dict[str, np.ndarray] | bytes,
    env_id: str,
    seed: int,
    n_steps: int,
    *,
    resume: EpisodeSnapshot | None = None,
    arch: Architecture = Architecture(),
    policy: Policy | None = None,
    env: gym.Env | None = None,
) -> RolloutResult:
    """Collect ``n_steps`` transitions with the given policy weights, continuing ``resume`` if
    given (its RNG states replace ``seed``'s), else starting a fresh episode from ``seed``.
    ``arch``: the policy's shape (from the weights' metadata), unless ``policy`` is given."""
    start = time.perf_counter()
    spec, actor, env = _prepare(weights, env_id, arch, policy, env)

    if resume is not None:
        obs, rng = restore_snapshot(env, resume)
        ep_return, ep_length = resume.episode_return, resume.episode_length
    else:
        env_seed, noise_seed = np.random.SeedSequence(seed).generate_state(2)
        rng = np.random.default_rng(noise_seed)
        obs, _ = env.reset(seed=int(env_seed))
        ep_return, ep_length = 0.0, 0
    if spec.continuous:
        low, high = env.action_space.low, env.action_space.high

    obs_dtype = np.uint8 if spec.obs_dtype == "uint8" else np.float32
    obs_buf = np.empty((n_steps, *spec.obs_shape), dtype=obs_dtype)
    actions = np.empty((n_steps, spec.action_dim), np.float32) if spec.continuous else np.empty(n_steps, np.int64)
    logp = np.empty(n_steps, np.float32)
    rewards = np.empty(n_steps, np.float32)
    terminated = np.zeros(n_steps, bool)
    boot_idx: list[int] = []
    boot_obs: list[np.ndarray] = []
    returns: list[float] = []
    lengths: list[int] = []

    for t in range(n_steps):
        obs_buf[t] = obs
        action, logp[t] = actor.sample(obs_buf[t], rng)
        actions[t] = action
        env_action = np.clip(action, low, high) if spec.continuous else int(action)
        obs, reward, term, trunc, _ = env.step(env_action)
        rewards[t] = reward
        ep_return += float(reward)
        ep_length += 1
        if term or trunc:
            terminated[t] = term
            if not term:  # cut by the time limit: the value of the last state still counts
                boot_idx.append(t)
                boot_obs.append(np.asarray(obs, dtype=obs_dtype))
            returns.append(ep_return)
            lengths.append(ep_length)
            ep_return, ep_length = 0.0, 0
            obs, _ = env.reset()
    if not terminated[-1] and (not boot_idx or boot_idx[-1] != n_steps - 1):
        boot_idx.append(n_steps - 1)  # the rollout ends mid-episode
        boot_obs.append(np.asarray(obs, dtype=obs_dtype))

    batch = {
        "obs": obs_buf,
        "actions": actions,
        "logp": logp,
        "rewards": rewards,
        "terminated": terminated,
        "bootstrap_idx": np.asarray(boot_idx, dtype=np.int64),
        "bootstrap_obs": np.stack(boot_obs) if boot_obs else np.empty((0, *spec.obs_shape), obs_dtype),
    }
    # The env is always mid-episode here (an episode that ended was reset), so the snapshot also
    # carries the RNG state a fresh episode would have started from.
    carry = take_snapshot(env, env_id, obs, ep_return, ep_length, rng) if can_snapshot(env) else None
    summary = RolloutSummary(n_steps, returns, lengths, time.perf_counter() - start)
    return RolloutResult(batch, summary, carry)


def evaluate(
    weights: dict[str, np.ndarray] | bytes,
    env_id: str,
    seed: int,
    n_episodes: int,
    *,
    deterministic: bool,
    max_steps: int,
    arch: Architecture = Architecture(),
    policy: Policy | None = None,
    env: gym.Env | None = None,
) -> RolloutSummary:
    """Play ``n_episodes`` whole episodes (each ends by termination or the env's time limit) with
    the mean action (``deterministic``) or sampled actions, as SB3's ``evaluate_policy`` does.
    ``max_steps`` bounds the total work; an episode it cuts short is not reported."""
    start = time.perf_counter()
    spec, actor, env = _prepare(weights, env_id, arch, policy, env)
    env_seed, noise_seed = np.random.SeedSequence(seed).generate_state(2)
    rng = np.random.default_rng(noise_seed)
    if spec.continuous:
        low, high = env.action_space.low, env.action_space.high
    obs, _ = env.reset(seed=int(env_seed))
    returns: list[float] = []
    lengths: list[int] = []
    ep_return, ep_length, steps = 0.0, 0, 0
    while len(returns) < n_episodes and steps < max_steps:
        action = actor.act(obs) if deterministic else actor.sample(obs, rng)[0]
        obs, reward, term, trunc, _ = env.step(np.clip(action, low, high) if spec.continuous else int(action))
        ep_return += float(reward)
        ep_length += 1
        steps += 1
        if term or trunc:
            returns.append(ep_return)
            lengths.append(ep_length)
            ep_return, ep_length = 0.0, 0
            obs, _ = env.reset()
    return RolloutSummary(steps, returns, lengths, time.perf_counter() - start)
