"""Episodes that outlive an invocation (nitro/actors/episodes.py) and evaluation episodes (rollout.evaluate),
with real environments and, through the actor, a real Redis."""

from __future__ import annotations

import numpy as np
import pytest

from nitro.actors.episodes import (
    EpisodeSnapshot,
    episodes_from_bytes,
    episodes_to_bytes,
    restore_game_snapshot,
    restore_snapshot,
)
from nitro.actors.events import ActorEvent
from nitro.actors.rollout import evaluate, games_for, rollout
from nitro.actors.worker import ActorState, run_actor
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import NitroConfig
from nitro.envs import AtariGames, env_spec, make_env
from nitro.models import Architecture
from nitro.models.networks import build_policy
from nitro.run.engine import Decision, TrainingRun
from nitro.run.invocations import is_eval_round
from nitro.serialization import SerializationError, dumps_tensors

KEYS = ("obs", "actions", "logp", "rewards", "terminated")


def _weights(env_id: str, arch: Architecture = Architecture()) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in build_policy(env_spec(env_id), seed=3, arch=arch).state_dict().items()}


def _segments(batch: dict[str, np.ndarray], key: str, n_envs: int) -> list[np.ndarray]:
    """A batch's rows of ``key``, one array per env (equal segments, back to back)."""
    return np.split(batch[key], n_envs)


@pytest.mark.parametrize(("env_id", "n", "n_envs"), [("Hopper-v5", 700, 1), ("ALE/Qbert-v5", 150, 1),
                                                     ("ALE/Qbert-v5", 240, 4)])
def test_continued_episode_is_the_uninterrupted_run(env_id, n, n_envs):
    """Three invocations of n steps, each continuing the last one's snapshots (through their
    bytes), give the batches and episode returns of one invocation of 3n steps with the same
    seed, env by env (an Atari actor's batch holds one segment per game)."""
    w = _weights(env_id)
    whole = rollout(w, env_id, 11, 3 * n, n_envs=n_envs)
    parts = [rollout(w, env_id, 11, n, n_envs=n_envs)]
    for part in (1, 2):  # the seed is ignored when resuming: the snapshots' RNG states go on
        resume = episodes_from_bytes(episodes_to_bytes(parts[-1].carry))
        assert len(resume) == n_envs
        parts.append(rollout(w, env_id, 1000 + part, n, n_envs=n_envs, resume=resume))
    for key in KEYS:
        for env, whole_rows in enumerate(_segments(whole.batch, key, n_envs)):
            rows = np.concatenate([_segments(p.batch, key, n_envs)[env] for p in parts])
            assert np.array_equal(rows, whole_rows), (key, env)
    returns = [r for p in parts for r in p.summary.episode_returns]
    assert sorted(returns) == sorted(whole.summary.episode_returns)
    if env_id == "Hopper-v5":  # a random Hopper falls often: episodes end in every part, and span parts
        assert returns == whole.summary.episode_returns and all(p.summary.episode_returns for p in parts)


@pytest.mark.parametrize("env_id", ["Humanoid-v5", "Ant-v5"])
def test_a_restored_episode_does_not_depend_on_what_its_env_ran_before(env_id):
    """Humanoid's and Ant's rewards read positions MuJoCo derives from the state (the mass centre
    before a step), which a restored state does not set by itself: without recomputing them the
    first reward after a restore came from the reset before it (-10.6 against -0.15 on Humanoid),
    so it depended on which warm env a continuation landed in. Restored, two envs with different
    pasts step alike, and within float rounding of the episode that never left its env (whose
    derived positions lag its state by one MuJoCo substep)."""
    from nitro.actors.episodes import take_snapshot

    original = make_env(env_id, seed=0)
    obs, _ = original.reset(seed=0)
    for _ in range(60):
        obs, *_ = original.step(original.action_space.sample() * 0.3)
    snap = take_snapshot(original, env_id, obs, 0.0, 60, np.random.default_rng(0))
    fresh, used = make_env(env_id, seed=1), make_env(env_id, seed=2)
    used.reset(seed=5)
    for _ in range(7):
        used.step(used.action_space.sample())
    action = np.zeros(original.action_space.shape, dtype=np.float32)
    steps = []
    for env in (fresh, used):
        restore_snapshot(env, snap)
        steps.append([env.step(action)[:2] for _ in range(3)])
    for (obs_a, r_a), (obs_b, r_b) in zip(*steps):
        assert np.array_equal(obs_a, obs_b) and r_a == r_b
    assert steps[0][0][1] == pytest.approx(original.step(action)[1], abs=1e-3)


def test_an_episode_longer_than_an_invocation_is_scored_whole():
    """A return reported after a continuation is the whole episode's (the snapshot carries the
    running return and length), not just the invocation's part of it."""
    w = _weights("Hopper-v5")
    whole = rollout(w, "Hopper-v5", 5, 400)
    first = rollout(w, "Hopper-v5", 5, 200)
    second = rollout(w, "Hopper-v5", 0, 200, resume=first.carry)
    spanning = second.summary.episode_lengths[0]
    assert first.carry[0].episode_length > 0 and spanning > first.carry[0].episode_length  # it began in `first`
    assert second.summary.episode_returns[0] == whole.summary.episode_returns[len(first.summary.episode_returns)]


def test_snapshot_bytes_are_data_only_and_checked():
    snaps = rollout(_weights("Hopper-v5"), "Hopper-v5", 1, 50).carry
    payload = episodes_to_bytes(snaps)
    assert b"pickle" not in payload and payload[8:9] == b"{"  # a safetensors header, JSON
    with pytest.raises(SerializationError):
        episodes_from_bytes(payload[:40])
    with pytest.raises(SerializationError, match=r"nitro\.episodes/1"):
        episodes_from_bytes(dumps_tensors({"x": np.zeros(2)}, {"format": "nitro.batch/1"}))
    with pytest.raises(SerializationError, match="incomplete"):
        episodes_from_bytes(dumps_tensors({"0.obs": np.zeros(2)}, {"format": "nitro.episodes/1", "env_id": "Hopper-v5",
                                                                    "kind": "mujoco", "episodes": "[{}]"}))
    # one episode in the single-episode format (what an actor wrote before games ran side by side)
    single = episodes_from_bytes(snaps[0].to_bytes())
    assert len(single) == 1 and np.array_equal(single[0].sim_state, snaps[0].sim_state)
    with pytest.raises(SerializationError):
        EpisodeSnapshot.from_bytes(snaps[0].to_bytes()[:40])


def test_an_atari_snapshot_moves_between_a_game_and_make_envs_env():
    """An ALE snapshot is the same data whoever took it: a game of AtariGames and make_env's env
    restored from it play on identically."""
    env_id = "ALE/SpaceInvaders-v5"
    snap = rollout(_weights(env_id), env_id, 2, 40, n_envs=2).carry[1]
    games, env = AtariGames(env_id, 1), make_env(env_id)
    restore_game_snapshot(games, 0, snap)
    obs, _ = restore_snapshot(env, snap)
    assert np.array_equal(games.obs[0], obs)
    for action in [1, 2, 3, 0] * 10:
        reward, term, trunc, _ = games.step(np.array([action]))
        obs, r, t, tr, _ = env.step(action)
        assert np.array_equal(games.obs[0], obs) and (reward[0], term[0], trunc[0]) == (r, t, tr)


def test_evaluation_plays_whole_episodes_only():
    w = _weights("Hopper-v5")
    for deterministic in (True, False):
        s = evaluate(w, "Hopper-v5", 3, 4, deterministic=deterministic, max_steps=50_000)
        assert len(s.episode_returns) == 4 and sum(s.episode_lengths) == s.steps
    # an episode the step cap cuts short is not reported
    capped = evaluate(w, "Hopper-v5", 3, 4, deterministic=True, max_steps=30)
    assert capped.steps == 30 and sum(capped.episode_lengths) <= 30
    assert all(length <= 1000 for length in capped.episode_lengths)
    # the mean action is deterministic: the same start state gives the same episode
    a = evaluate(w, "Hopper-v5", 9, 1, deterministic=True, max_steps=2000)
    b = evaluate(w, "Hopper-v5", 9, 1, deterministic=True, max_steps=2000)
    assert a.episode_returns == b.episode_returns


def _event(redis_url, key, inv, **kw) -> ActorEvent:
    return ActorEvent(run_id="ep", round=kw.pop("round", 1), invocation_id=inv, weights_key=key, env_id="Hopper-v5",
                      seed=kw.pop("seed", 4), n_steps=kw.pop("n_steps", 300), cache_url=redis_url, **kw)


def test_the_actor_continues_an_episode_through_the_cache(redis_url, redis_client):
    cache = TrajectoryCache(connect_redis(redis_url), "ep", ttl_s=600)
    payload = dumps_tensors(_weights("Hopper-v5"), {"format": "nitro.policy/1", "env_id": "Hopper-v5", "version": 1,
                                                    "arch": Architecture().to_meta()})
    key = cache.publish_weights(1, payload)
    state = ActorState()
    first = run_actor(_event(redis_url, key, "ep-r00001-0000", seed=4), state)
    assert first.ok and first.episode_key == cache.episode_key(1, "ep-r00001-0000") and not first.continued
    second = run_actor(_event(redis_url, key, "ep-r00002-0000", round=2, seed=99, episode_key=first.episode_key),
                       ActorState())  # another process: only the cache connects them
    assert second.ok and second.continued
    whole = rollout(_weights("Hopper-v5"), "Hopper-v5", 4, 600)
    from nitro.serialization import loads_tensors

    b1 = loads_tensors(cache.get_batch(1, "ep-r00001-0000"))[0]
    b2 = loads_tensors(cache.get_batch(2, "ep-r00002-0000"))[0]
    for k in KEYS:
        assert np.array_equal(np.concatenate([b1[k], b2[k]]), whole.batch[k]), k
    assert first.episode_returns + second.episode_returns == whole.summary.episode_returns
    # an expired snapshot: the actor starts a fresh episode from its own seed and says so
    redis_client.delete(first.episode_key)
    third = run_actor(_event(redis_url, key, "ep-r00002-0001", round=2, seed=4, episode_key=first.episode_key), state)
    assert third.ok and not third.continued


def test_evaluation_invocations_write_no_trajectories(redis_url, redis_client):
    cache = TrajectoryCache(connect_redis(redis_url), "ep", ttl_s=600)
    key = cache.publish_weights(
        3, dumps_tensors(_weights("Hopper-v5"), {"format": "nitro.policy/1", "env_id": "Hopper-v5"})
    )
    s = run_actor(
        _event(redis_url, key, "ep-r00003-evd-0000", round=3, mode="eval_deterministic", n_steps=5000, n_episodes=2),
        ActorState(),
    )
    assert s.ok and len(s.episode_returns) == 2 and s.batch_key is None and s.episode_key is None
    # only its billing summary is kept: no batch, no episode snapshot for a learner to train on
    written = {k.split(b":")[3] for k in redis_client.scan_iter("nitro:ep:r00003:*")}
    assert written == {b"weights", b"summary"}


def test_a_run_plans_continuations_and_evaluations(redis_url):
    cfg = NitroConfig.load({"rounds": 25, "eval": {"every_rounds": 10, "episodes": 3}, "steps_per_actor": 64})
    training = TrainingRun(
        cfg, "plan", TrajectoryCache(connect_redis(redis_url), "plan", ttl_s=600), actor_cache_url=redis_url
    )
    assert [k for k in range(25) if is_eval_round(cfg, k)] == [0, 10, 20, 24]
    training.open_episodes = ["e0", "e1"]
    four, none = Decision(4, 4, "fixed"), Decision(0, 4, "budget")
    events = training.plan_invocations(10, four, "w")
    train = [e for e in events if e.mode == "train"]
    assert [e.episode_key for e in train] == ["e0", "e1", None, None]
    modes = [e.mode for e in events if e.mode != "train"]
    assert modes == ["eval_deterministic"] * 3 + ["eval_stochastic"] * 3
    # evaluation episodes start from the same states every evaluation round
    again = [e.seed for e in training.plan_invocations(20, four, "w") if e.mode != "train"]
    assert again == [e.seed for e in events if e.mode != "train"]
    assert all(e.mode == "train" for e in training.plan_invocations(11, four, "w"))
    assert training.plan_invocations(24, none, "w") == []  # no actors (budget): no evaluation either
    final = Decision(0, 4, "budget spent: a final evaluation", final_evaluation=True)
    assert [e.mode for e in training.plan_invocations(13, final, "w")] == modes  # a budget run's last round


@pytest.mark.parametrize("env_id", ["ALE/SpaceInvaders-v5", "ALE/Gravitar-v5"])
def test_a_warm_actors_games_continue_snapshots_as_fresh_games_do(env_id):
    """A warm worker's games have played other episodes, and ALE keeps state outside a saved state
    that the next frame reads; restored there, each snapshot still plays on as in fresh games, bit
    for bit (these two games showed the difference when the history was not reset)."""
    w = _weights(env_id)
    snapshots = rollout(w, env_id, 7, 96, n_envs=6).carry
    warm = games_for(env_id, 6, 96)
    rollout(w, env_id, 8, 96, n_envs=6, env=warm)  # other games, played in these emulators
    for part in range(3):
        fresh = rollout(w, env_id, 0, 96, n_envs=6, resume=snapshots)
        again = rollout(w, env_id, 0, 96, n_envs=6, resume=snapshots, env=warm)
        for key in (*KEYS, "bootstrap_idx", "bootstrap_obs"):
            assert np.array_equal(again.batch[key], fresh.batch[key]), (part, key)
        assert again.summary.episode_returns == fresh.summary.episode_returns
        snapshots = fresh.carry
