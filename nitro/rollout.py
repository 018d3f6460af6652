"""The actor's work: roll a policy out in one environment for a fixed number of steps.

``rollout`` is a pure function of (weights, env id, seed, n_steps): the same inputs give the same
batch, bit for bit. Local worker processes and the Lambda handler both call it unchanged. It may
be handed an env and a policy object to reuse across warm invocations; it reseeds and reloads
them, so reuse never changes the result.

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
from nitro.models import Policy, build_policy
from nitro.serialization import loads_tensors


@dataclass
class RolloutSummary:
    steps: int
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    duration_s: float = 0.0


@dataclass
class RolloutResult:
    batch: dict[str, np.ndarray]
    summary: RolloutSummary


def load_weights(policy: Policy, weights: dict[str, np.ndarray] | bytes) -> None:
    """Load a published state dict (arrays, or the bytes of ``dumps_tensors``) into ``policy``."""
    if isinstance(weights, (bytes, bytearray, memoryview)):
        weights, _ = loads_tensors(weights, expect_format="nitro.policy/1")
    state = {k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()}
    policy.load_state_dict(state, strict=True)


def rollout(
    weights: dict[str, np.ndarray] | bytes,
    env_id: str,
    seed: int,
    n_steps: int,
    *,
    policy: Policy | None = None,
    env: gym.Env | None = None,
) -> RolloutResult:
    """Collect ``n_steps`` transitions with the given policy weights."""
    start = time.perf_counter()
    spec = env_spec(env_id)
    policy = policy if policy is not None else build_policy(spec)
    load_weights(policy, weights)
    policy.eval()
    env = env if env is not None else make_env(env_id)

    env_seed, noise_seed = np.random.SeedSequence(seed).generate_state(2)
    rng = np.random.default_rng(noise_seed)
    obs, _ = env.reset(seed=int(env_seed))
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
    ep_return, ep_length = 0.0, 0

    for t in range(n_steps):
        obs_buf[t] = obs
        action, logp[t] = policy.sample(obs_buf[t], rng)
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
    summary = RolloutSummary(n_steps, returns, lengths, time.perf_counter() - start)
    return RolloutResult(batch, summary)
