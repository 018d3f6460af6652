"""run_actor: a real Hopper rollout writing to real Redis, and every way an invocation can fail."""

from __future__ import annotations

import numpy as np
import pytest

from nitro.actors.events import ActorEvent, invocation_id
from nitro.actors.local import LocalActorPool
from nitro.actors.preload import warm_modules, warm_modules_for
from nitro.actors.worker import ActorState, run_actor
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.models.networks import build_policy
from nitro.serialization import dumps_tensors, loads_tensors

ENV = "Hopper-v5"
RUN = "wrk"


@pytest.fixture()
def published(redis_client, redis_url):
    client = connect_redis(redis_url)
    cache = TrajectoryCache(client, RUN, ttl_s=600)
    policy = build_policy(env_spec(ENV), seed=0)
    key = cache.publish_weights(
        2, dumps_tensors(policy.state_dict(), {"env_id": ENV, "version": 2, "format": "nitro.policy/1"})
    )
    yield cache, key
    client.close()


def _event(redis_url: str, key: str, i: int = 0, **kw) -> dict:
    ev = dict(run_id=RUN, round=2, invocation_id=invocation_id(RUN, 2, i), weights_key=key, env_id=ENV,
              seed=100 + i, n_steps=300, cache_url=redis_url, batch_ttl_s=600)
    ev.update(kw)
    return ev


def test_real_rollout_is_written_to_redis(published, redis_url, redis_client):
    cache, key = published
    state = ActorState(memory_mb=1024)
    s = run_actor(_event(redis_url, key), state)
    assert s.ok, s.error
    assert s.steps == 300 and s.batch_key == cache.batch_key(2, invocation_id(RUN, 2, 0))
    assert (
        s.memory_mb == 1024
        and s.billed_ms == pytest.approx(s.duration_s * 1000, abs=1.0)
        and s.billed_ms >= s.duration_s * 1000
    )
    assert len(s.episode_returns) == len(s.episode_lengths) >= 1  # Hopper falls quickly under a random policy
    raw = redis_client.get(s.batch_key)
    assert len(raw) == s.batch_bytes and 0 < redis_client.ttl(s.batch_key) <= 600
    batch, meta = loads_tensors(raw, expect_format="nitro.batch/1")
    assert (
        meta["env_id"] == ENV and meta["invocation_id"] == invocation_id(RUN, 2, 0) and meta["weights_version"] == "2"
    )
    assert (
        batch["obs"].shape == (300, 11) and batch["actions"].shape == (300, 3) and batch["rewards"].dtype == np.float32
    )
    res = cache.collect(2, {invocation_id(RUN, 2, 0)}, deadline_s=1.0)
    assert res.complete


def test_warm_state_is_reused_and_results_are_deterministic(published, redis_url, redis_client):
    _cache, key = published
    state = ActorState()
    a = run_actor(_event(redis_url, key, 0), state)
    env, weights, client = state.envs[ENV], state.weights, next(iter(state.clients.values()))
    redis_client.delete(key)  # the decoded weights stay in the warm state
    b = run_actor(_event(redis_url, key, 1, seed=100), state)
    assert a.ok and b.ok, (a.error, b.error)
    assert state.envs[ENV] is env and state.weights is weights and next(iter(state.clients.values())) is client
    assert len(state.clients) == 1
    ba, _ = loads_tensors(redis_client.get(a.batch_key))
    bb, _ = loads_tensors(redis_client.get(b.batch_key))
    for name in ba:  # same seed and weights: the same batch, bit for bit, warm or cold
        np.testing.assert_array_equal(ba[name], bb[name])
    cold = run_actor(_event(redis_url, "nitro:wrk:r00002:weights", 2, seed=100), ActorState())
    assert not cold.ok and "missing or expired" in cold.error


def test_duplicate_delivery_counts_once(published, redis_url, redis_client):
    cache, key = published
    state = ActorState()
    first = run_actor(_event(redis_url, key, 5), state)
    again = run_actor(_event(redis_url, key, 5), state)
    assert first.ok and again.ok and first.batch_key == again.batch_key
    assert redis_client.llen(cache.done_key(2)) == 1


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"env_id": "NoSuchEnv-v0"}, "invalid event: env_id: unknown env id"),
        ({"n_steps": 0}, "invalid event: n_steps"),
        ({"cache_url": "http://x"}, "invalid event: cache_url"),
        ({"surprise": 1}, "invalid event: surprise"),
        ({"cache_credentials": {"env": "NITRO_TEST_UNSET_VAR"}}, "NITRO_TEST_UNSET_VAR' is not set"),
        (
            {"cache_credentials": {"secret_arn": "arn:aws:secretsmanager:x"}},
            "NotImplementedError: cache_credentials.secret_arn",
        ),
        ({"cache_credentials": {"password": "plain"}}, "cache_credentials must be"),
        ({"weights_key": "nitro:wrk:r00099:weights"}, "missing or expired"),
    ],
)
def test_bad_events_fail_with_one_line(published, redis_url, change, expected):
    _, key = published
    s = run_actor(_event(redis_url, key, 9, **change), ActorState())
    assert not s.ok and expected in s.error and "\n" not in s.error
    assert s.invocation_id == invocation_id(RUN, 2, 9)
    assert "plain" not in s.error


def test_missing_fields_and_non_objects_never_raise():
    s = run_actor({"run_id": "x"}, ActorState())
    assert not s.ok and s.invocation_id == "unknown" and s.error.startswith("invalid event:")
    s = run_actor(["not", "an", "object"], ActorState())  # type: ignore[arg-type]
    assert not s.ok and "expected a JSON object" in s.error


def test_unreachable_cache_is_a_failed_summary_without_the_password(published, redis_url, monkeypatch):
    _, key = published
    monkeypatch.setenv("NITRO_TEST_PW", "do-not-leak")
    s = run_actor(_event("redis://actor@127.0.0.1:1/0", key, cache_credentials={"env": "NITRO_TEST_PW"}), ActorState())
    assert not s.ok and "CacheUnavailableError" in s.error and "do-not-leak" not in s.error


def test_weights_for_another_env_are_refused(redis_client, redis_url):
    cache = TrajectoryCache(connect_redis(redis_url), RUN, 600)
    policy = build_policy(env_spec(ENV), seed=0)
    key = cache.publish_weights(
        3, dumps_tensors(policy.state_dict(), {"env_id": "Walker2d-v5", "version": 3, "format": "nitro.policy/1"})
    )
    s = run_actor(_event(redis_url, key, round=3), ActorState())
    assert not s.ok and "Walker2d-v5" in s.error


@pytest.mark.slow
def test_local_pool_runs_the_real_actor(published, redis_url):
    cache, key = published
    ids = [invocation_id(RUN, 2, i) for i in range(4)]
    with LocalActorPool(workers=2, timeout_s=120, memory_mb=2048) as pool:
        events = [ActorEvent.model_validate(_event(redis_url, key, i, n_steps=200)) for i in range(4)]
        summaries = pool.invoke_many(events)
    assert all(s.ok for s in summaries), [s.error for s in summaries]
    assert [s.invocation_id for s in summaries] == ids
    assert all(s.steps == 200 and s.memory_mb == 2048 for s in summaries)
    res = cache.collect(2, set(ids), deadline_s=2.0)
    assert res.complete and res.samples == 800


def test_an_atari_actor_steps_its_games_through_redis_and_the_learners_door(redis_client, redis_url):
    """An Atari event with n_envs=4: the batch travels uint8 through Redis, passes the learner's
    door and its behaviour check, a PPO update trains on it with the observations still uint8,
    and the next invocation (another process: a fresh state) continues all four games."""
    import torch

    from nitro.config import NitroConfig
    from nitro.learners import make_learner
    from nitro.learners.behaviour import BehaviourPolicies
    from nitro.validation import batch_version, bounds_for, decode_batch_meta

    atari = "ALE/SpaceInvaders-v5"
    config = NitroConfig.load({"env_id": atari, "steps_per_actor": 64, "envs_per_actor": 4,
                               "ppo": {"minibatch_size": 32, "epochs": 1}})
    spec, learner = env_spec(atari), make_learner(config)
    cache = TrajectoryCache(connect_redis(redis_url), RUN, ttl_s=600)
    key = cache.publish_weights(4, dumps_tensors(learner.weights(), {"env_id": atari, "version": 4,
                                                                     "format": "nitro.policy/1"}))
    behaviour = BehaviourPolicies(spec, config.model.architecture(), atol=1e-3, rtol=1e-3)
    behaviour.remember(4, learner.weights())
    first = run_actor(_event(redis_url, key, 0, env_id=atari, round=4, n_steps=64, n_envs=4), ActorState())
    second = run_actor(_event(redis_url, key, 1, env_id=atari, round=4, n_steps=64, n_envs=4,
                              episode_key=first.episode_key), ActorState())
    assert first.ok and second.ok, (first.error, second.error)
    assert second.continued and first.steps == second.steps == 64
    batches = []
    for summary in (first, second):
        arrays, meta = decode_batch_meta(redis_client.get(summary.batch_key), spec, config.steps_per_actor,
                                         summary.invocation_id, bounds_for(spec, config.door))
        behaviour.check(arrays, batch_version(meta))
        assert arrays["obs"].dtype == np.uint8 and arrays["bootstrap_obs"].dtype == np.uint8
        assert arrays["obs"].shape == (64, 4, 84, 84) and len(arrays["bootstrap_idx"]) >= 4  # one per game at least
        batches.append(arrays)
    # game i of the second invocation starts where game i of the first stopped (the observation
    # its segment bootstraps from, unless that last step terminated)
    boot_rows = batches[0]["bootstrap_idx"].tolist()
    continued = [g for g in range(4) if 16 * g + 15 in boot_rows]
    assert continued
    for game in continued:
        last = boot_rows.index(16 * game + 15)
        assert np.array_equal(batches[1]["obs"][16 * game], batches[0]["bootstrap_obs"][last])
    result = learner.update(batches)
    assert result.sgd_steps == 4 and learner.trained_batch.obs.dtype == torch.uint8


@pytest.mark.parametrize(("overrides", "networks", "learner_functions"), [
    (["env_id=Hopper-v5"], False, False),
    (["env_id=ALE/Qbert-v5"], True, False),  # the CNN's forward
    (["env_id=Hopper-v5", "learner.mode=stellaris"], False, True),  # the learner functions' gradients
    (["env_id=ALE/Qbert-v5", "learner.mode=stellaris"], True, True),
])
def test_a_runs_fresh_actors_import_pytorch_only_where_an_invocation_needs_it(overrides, networks, learner_functions):
    """What a run's pool preloads (tests/test_envs_rollout.py shows the rollout itself imports no
    PyTorch; the learner function's modules import it)."""
    modules = warm_modules_for(NitroConfig.load(overrides=overrides))
    assert modules[0] == "nitro.actors.rollout"
    assert ("nitro.models.networks" in modules) == networks
    assert ("nitro.stellaris.gradient" in modules) == learner_functions


def test_a_pool_without_a_config_preloads_the_rollout_and_another_function_nothing():
    assert warm_modules() == ("nitro.actors.rollout",)
    assert warm_modules("tests.support.helpers:echo", image_env=True, learner_functions=True) == ()
