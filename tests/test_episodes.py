"""Episodes that outlive an invocation (nitro/episodes.py) and evaluation episodes (rollout.evaluate),
with real environments and, through the actor, a real Redis."""

from __future__ import annotations

import numpy as np
import pytest

from nitro.actors.events import ActorEvent
from nitro.actors.worker import ActorState, run_actor
from nitro.cache import TrajectoryCache, connect_redis
from nitro.engine import Decision, TrainingRun
from nitro.invocations import is_eval_round
from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.episodes import EpisodeSnapshot
from nitro.models import Architecture, build_policy
from nitro.rollout import evaluate, rollout
from nitro.serialization import SerializationError, dumps_tensors

KEYS = ("obs", "actions", "logp", "rewards", "terminated")


def _weights(env_id: str, arch: Architecture = Architecture()) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in build_policy(env_spec(env_id), seed=3, arch=arch).state_dict().items()}


@pytest.mark.parametrize(("env_id", "n"), [("Hopper-v5", 700), ("ALE/Qbert-v5", 150)])
def test_continued_episode_is_the_uninterrupted_run(env_id, n):
    """Three invocations of n steps, each continuing the last one's snapshot (through its bytes),
    give the batches and episode returns of one invocation of 3n steps with the same seed."""
    w = _weights(env_id)
    whole = rollout(w, env_id, 11, 3 * n)
    parts = [rollout(w, env_id, 11, n)]
    for part in (1, 2):  # the seed is ignored when resuming: the snapshot's RNG states go on
        resume = EpisodeSnapshot.from_bytes(parts[-1].carry.to_bytes())
        parts.append(rollout(w, env_id, 1000 + part, n, resume=resume))
    for key in KEYS:
        assert np.array_equal(np.concatenate([p.batch[key] for p in parts]), whole.batch[key]), key
    assert sum((p.summary.episode_returns for p in parts), []) == whole.summary.episode_returns
    if env_id == "Hopper-v5":  # a random Hopper falls often: episodes end in every part, and span parts
        assert all(p.summary.episode_returns for p in parts)


def test_an_episode_longer_than_an_invocation_is_scored_whole():
    """A return reported after a continuation is the whole episode's (the snapshot carries the
    running return and length), not just the invocation's part of it."""
    w = _weights("Hopper-v5")
    whole = rollout(w, "Hopper-v5", 5, 400)
    first = rollout(w, "Hopper-v5", 5, 200)
    second = rollout(w, "Hopper-v5", 0, 200, resume=first.carry)
    spanning = second.summary.episode_lengths[0]
    assert first.carry.episode_length > 0 and spanning > first.carry.episode_length  # it began in `first`
    assert second.summary.episode_returns[0] == whole.summary.episode_returns[len(first.summary.episode_returns)]


def test_snapshot_bytes_are_data_only_and_checked():
    snap = rollout(_weights("Hopper-v5"), "Hopper-v5", 1, 50).carry
    payload = snap.to_bytes()
    assert b"pickle" not in payload and payload[8:9] == b"{"  # a safetensors header, JSON
    with pytest.raises(SerializationError):
        EpisodeSnapshot.from_bytes(payload[:40])
    with pytest.raises(SerializationError, match="nitro.episode/1"):
        EpisodeSnapshot.from_bytes(dumps_tensors({"x": np.zeros(2)}, {"format": "nitro.batch/1"}))


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
    key = cache.publish_weights(3, dumps_tensors(_weights("Hopper-v5"), {"format": "nitro.policy/1", "env_id": "Hopper-v5"}))
    s = run_actor(_event(redis_url, key, "ep-r00003-evd-0000", round=3, mode="eval_deterministic", n_steps=5000,
                         n_episodes=2), ActorState())
    assert s.ok and len(s.episode_returns) == 2 and s.batch_key is None and s.episode_key is None
    # only its billing summary is kept: no batch, no episode snapshot for a learner to train on
    written = {k.split(b":")[3] for k in redis_client.scan_iter("nitro:ep:r00003:*")}
    assert written == {b"weights", b"summary"}


def test_a_run_plans_continuations_and_evaluations(redis_url):
    cfg = NitroConfig.load({"rounds": 25, "eval": {"every_rounds": 10, "episodes": 3}, "steps_per_actor": 64})
    training = TrainingRun(cfg, "plan", TrajectoryCache(connect_redis(redis_url), "plan", ttl_s=600), actor_cache_url=redis_url)
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
