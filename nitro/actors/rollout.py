"""The actor's work: roll a policy out for a fixed number of steps, or play whole episodes to
evaluate it.

``rollout`` is a pure function of (weights, env id, seed, n_steps, n_envs, the episodes it
continues): the same inputs give the same batch, bit for bit. Local worker processes and the
Lambda handler both call it unchanged. It may be handed an env to reuse across warm invocations;
it reseeds (or restores) it, so reuse never changes the result. It acts with the policies of
``nitro.models.acting``, built from the weights each call: the rollout of an MLP policy, and so
the actor process that runs it, never imports PyTorch.

An Atari actor steps ``n_envs`` games side by side (``rollout_games`` over
``nitro.envs.AtariGames``) and runs its CNN once per step on all their observations; its
``n_steps`` transitions are split among the games (game i steps ``n_steps // n_envs``, one more
for the first ``n_steps % n_envs``), and its batch holds game 0's segment, then game 1's, and so
on, each ending in a bootstrap or termination step (the batch format in docs/ARCHITECTURE.md).
The round's batch is still actors x ``n_steps``. Training on Atari ends an episode at each lost
life (``terminated``, so its successor is worth nothing), as the DeepMind preprocessing in the
paper's RLlib code does; the game goes on, and ``episode_returns`` are those of whole games.
Every other env is stepped alone (``rollout_env``).

Episodes outlive an invocation (``nitro/actors/episodes.py``): a rollout may start from the
snapshots of the episodes an earlier invocation left unfinished (game i continues the i-th), and
it returns the snapshots of its own unfinished ones (``RolloutResult.carry``) for a later one to
continue. An episode's return is reported once, by the rollout that sees it end, and it is the
return of the whole episode.

Episode ends are handled by hand (no autoreset): a terminated step has no successor, a
time-limit truncation and a segment's last step record the observation to bootstrap from
(see the batch table in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import gymnasium as gym
import numpy as np

from nitro.actors.episodes import (
    EpisodeSnapshot,
    can_snapshot,
    restore_game_snapshot,
    restore_snapshot,
    take_game_snapshot,
    take_snapshot,
)
from nitro.envs import AtariGames, EnvSpec, box_bounds, env_spec, make_env
from nitro.models import Architecture
from nitro.models.acting import NumpyMLPPolicy, acting_policy
from nitro.serialization import loads_tensors

if TYPE_CHECKING:
    from nitro.models.networks import CNNActor


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
    carry: list[EpisodeSnapshot] = field(default_factory=list)  # the unfinished episodes, one per env


def _prepare(weights: dict[str, np.ndarray] | bytes, env_id: str,
             arch: Architecture) -> tuple[EnvSpec, CNNActor | NumpyMLPPolicy]:
    if isinstance(weights, (bytes, bytearray, memoryview)):
        weights, _ = loads_tensors(weights, expect_format="nitro.policy/1")
    spec = env_spec(env_id)
    return spec, acting_policy(spec, arch, weights)


def games_for(env_id: str, n_envs: int, n_steps: int, games: AtariGames | None = None) -> AtariGames:
    """``games`` if it holds the games a rollout of ``n_steps`` over ``n_envs`` steps, else new
    ones: min(n_envs, n_steps) of them, so that every game steps at least once."""
    n = max(1, min(int(n_envs), int(n_steps)))
    if games is not None and games.env_id == env_id and games.n == n:
        return games
    return AtariGames(env_id, n)


def rollout(
    weights: dict[str, np.ndarray] | bytes,
    env_id: str,
    seed: int,
    n_steps: int,
    *,
    n_envs: int = 1,
    resume: Sequence[EpisodeSnapshot] = (),
    arch: Architecture = Architecture(),
    env: gym.Env | AtariGames | None = None,
) -> RolloutResult:
    """Collect ``n_steps`` transitions with the given policy weights: on Atari over ``n_envs``
    games (``rollout_games``; ``env`` may be an ``AtariGames`` to reuse), else in one env
    (``rollout_env``; ``n_envs`` is not read). Episode i continues ``resume[i]`` where given (its
    RNG states replace ``seed``'s); the others start fresh from ``seed``. ``arch``: the policy's
    shape (from the weights' metadata)."""
    start = time.perf_counter()
    spec, actor = _prepare(weights, env_id, arch)
    if spec.is_atari:
        assert not isinstance(actor, NumpyMLPPolicy)
        games = games_for(env_id, n_envs, n_steps, env if isinstance(env, AtariGames) else None)
        return rollout_games(actor, games, seed, n_steps, resume, started=start)
    if env is None or isinstance(env, AtariGames):
        env = make_env(env_id)
    return rollout_env(actor, spec, env, seed, n_steps, resume[0] if resume else None, started=start)


def rollout_env(actor: CNNActor | NumpyMLPPolicy, spec: EnvSpec, env: gym.Env, seed: int, n_steps: int,
                resume: EpisodeSnapshot | None = None, *, started: float | None = None) -> RolloutResult:
    """``n_steps`` transitions in one env, acting with ``actor.sample`` one observation at a
    time; continues ``resume`` if given, else starts a fresh episode from ``seed``."""
    start = time.perf_counter() if started is None else started
    if resume is not None:
        obs, rng = restore_snapshot(env, resume)
        ep_return, ep_length = resume.episode_return, resume.episode_length
    else:
        env_seed, noise_seed = np.random.SeedSequence(seed).generate_state(2)
        rng = np.random.default_rng(noise_seed)
        obs, _ = env.reset(seed=int(env_seed))
        ep_return, ep_length = 0.0, 0
    if spec.continuous:
        low, high = box_bounds(env.action_space)

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
    carry = [take_snapshot(env, spec.env_id, obs, ep_return, ep_length, rng)] if can_snapshot(env) else []
    summary = RolloutSummary(n_steps, returns, lengths, time.perf_counter() - start)
    return RolloutResult(batch, summary, carry)


def rollout_games(actor: CNNActor, games: AtariGames, seed: int, n_steps: int,
                  resume: Sequence[EpisodeSnapshot] = (), *, started: float | None = None) -> RolloutResult:
    """``n_steps`` transitions over the ``games.n`` games of ``games``, one batched forward per
    step (module docstring: the segments, the lost lives). Game i continues ``resume[i]`` where
    there is one (extra snapshots are dropped: their episodes are never scored), else starts from
    ``seed``: game i from the i-th pair of seeds ``SeedSequence(seed)`` gives, so that one game
    plays what ``rollout_env`` plays in ``make_env``'s env from the same seed."""
    start = time.perf_counter() if started is None else started
    n = games.n
    if n_steps < n:
        raise ValueError(f"{n_steps} steps cannot be split among {n} games")
    steps = [n_steps // n + (i < n_steps % n) for i in range(n)]  # non-increasing
    first_row = np.concatenate([[0], np.cumsum(steps)[:-1]]).astype(np.int64)
    seeds = np.random.SeedSequence(seed).generate_state(2 * n)
    rngs: list[np.random.Generator] = []
    ep_return, ep_length = [0.0] * n, [0] * n
    for i in range(n):
        if i < len(resume):
            rngs.append(restore_game_snapshot(games, i, resume[i]))
            ep_return[i], ep_length[i] = resume[i].episode_return, resume[i].episode_length
        else:
            games.reset(i, seed=int(seeds[2 * i]))
            rngs.append(np.random.default_rng(seeds[2 * i + 1]))

    obs_shape = games.obs.shape[1:]
    obs_buf = np.empty((n_steps, *obs_shape), np.uint8)
    actions = np.empty(n_steps, np.int64)
    logp = np.empty(n_steps, np.float32)
    rewards = np.empty(n_steps, np.float32)
    terminated = np.zeros(n_steps, bool)
    boots: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    returns: list[float] = []
    lengths: list[int] = []

    for t in range(steps[0]):
        k = sum(1 for s in steps if s > t)  # the games whose segment has a step t
        rows = first_row[:k] + t
        obs_buf[rows] = games.obs[:k]
        acts, logp[rows] = actor.sample_batch(games.obs[:k], rngs[:k])
        actions[rows] = acts
        reward, term, trunc, life_lost = games.step(acts)
        rewards[rows] = reward
        terminated[rows] = term | life_lost  # a lost life ends a training episode; the game goes on
        for i in range(k):
            ep_return[i] += float(reward[i])
            ep_length[i] += 1
            if term[i] or trunc[i]:
                if not (term[i] or life_lost[i]):  # cut by ALE's frame limit: the last state's value counts
                    boots[i].append((int(rows[i]), games.obs[i].copy()))
                returns.append(ep_return[i])
                lengths.append(ep_length[i])
                ep_return[i], ep_length[i] = 0.0, 0
                games.reset(i)
    for i in range(n):
        last = int(first_row[i]) + steps[i] - 1
        if not terminated[last] and not (boots[i] and boots[i][-1][0] == last):
            boots[i].append((last, games.obs[i].copy()))  # the segment ends mid-episode

    boot = [b for per_game in boots for b in per_game]
    batch: dict[str, np.ndarray] = {
        "obs": obs_buf,
        "actions": actions,
        "logp": logp,
        "rewards": rewards,
        "terminated": terminated,
        "bootstrap_idx": np.asarray([row for row, _ in boot], dtype=np.int64),
        "bootstrap_obs": np.stack([o for _, o in boot]) if boot else np.empty((0, *obs_shape), np.uint8),
    }
    # Every game is mid-episode here (a game that ended was reset).
    carry = [take_game_snapshot(games, i, ep_return[i], ep_length[i], rngs[i]) for i in range(n)]
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
    env: gym.Env | None = None,
) -> RolloutSummary:
    """Play ``n_episodes`` whole episodes (each ends by termination or the env's time limit) with
    the mean action (``deterministic``) or sampled actions, as SB3's ``evaluate_policy`` does.
    ``max_steps`` bounds the total work; an episode it cuts short is not reported."""
    start = time.perf_counter()
    spec, actor = _prepare(weights, env_id, arch)
    env = env if env is not None else make_env(env_id)
    env_seed, noise_seed = np.random.SeedSequence(seed).generate_state(2)
    rng = np.random.default_rng(noise_seed)
    if spec.continuous:
        low, high = box_bounds(env.action_space)
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
