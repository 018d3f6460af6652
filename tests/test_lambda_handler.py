"""actor_lambda.handler called directly (as the Lambda runtime calls it), against a real Redis."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from actor_lambda import handler as H
from nitro.actors.events import ActorSummary
from nitro.cache import CacheUnavailableError, LocalRedisServer, TrajectoryCache, connect_redis
from nitro.envs import env_spec
from nitro.models.networks import build_policy
from nitro.serialization import dumps_tensors, loads_tensors
from tests.support.tls import throwaway_tls

ENV = "Hopper-v5"
RUN = "hdl"


class Ctx:
    aws_request_id = "req-1"
    function_name = "nitro-actor"
    memory_limit_in_mb = "2048"

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


@pytest.fixture()
def published(redis_client, redis_url):
    cache = TrajectoryCache(connect_redis(redis_url), RUN)
    policy = build_policy(env_spec(ENV))
    key = cache.publish_weights(
        3, dumps_tensors(policy.state_dict(), {"env_id": ENV, "version": 3, "format": "nitro.policy/1"})
    )
    return cache, key


def _event(redis_url, key, i=0, **kw):
    ev = dict(run_id=RUN, round=3, invocation_id=f"{RUN}-r00003-{i:04d}", weights_key=key, env_id=ENV, seed=i,
              n_steps=32, cache_url=redis_url)
    ev.update(kw)
    return ev


def test_valid_event_writes_the_batch_and_reuses_state(published, redis_url):
    cache, key = published
    out = H.handler(_event(redis_url, key, 0), Ctx())
    json.dumps(out)  # what Lambda will marshal
    s = ActorSummary.model_validate(out)
    assert s.ok, s.error
    assert s.steps == 32 and s.memory_mb == 2048 and s.batch_key == cache.batch_key(3, s.invocation_id)
    arrays, meta = loads_tensors(cache.get_batch(3, s.invocation_id), expect_format="nitro.batch/1")
    assert arrays["obs"].shape == (32, *env_spec(ENV).obs_shape)
    assert meta["weights_version"] == "3" and meta["invocation_id"] == s.invocation_id

    # Warm invocation: the same env, decoded weights and Redis client objects are reused.
    env, weights = H.STATE.envs[ENV], H.STATE.weights
    clients = dict(H.STATE.clients)
    s2 = ActorSummary.model_validate(H.handler(_event(redis_url, key, 1), Ctx()))
    assert s2.ok
    assert H.STATE.envs[ENV] is env and H.STATE.weights is weights
    assert H.STATE.clients == clients and H.STATE.weights_key == key

    # Duplicate delivery: still ok, not enqueued twice.
    s3 = ActorSummary.model_validate(H.handler(_event(redis_url, key, 1), Ctx()))
    assert s3.ok
    done = [x.decode() for x in cache.client.lrange(cache.done_key(3), 0, -1)]
    assert done.count(f"{RUN}-r00003-0001") == 1


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda ev: ev.pop("weights_key"), "invalid event: weights_key: Field required"),
        (lambda ev: ev.update(env_id="Hopper-v1"), "invalid event: env_id: unknown env id 'Hopper-v1'"),
        (lambda ev: ev.update(seed=-1), "invalid event: seed:"),
        (lambda ev: ev.update(n_steps=0), "invalid event: n_steps:"),
        (lambda ev: ev.update(round="three"), "invalid event: round:"),
        (lambda ev: ev.update(cache_url="http://example.com"), "invalid event: cache_url:"),
        (lambda ev: ev.update(cache_url="redis://user:hunter2@host:6379/0"), "must not contain a password"),
        (lambda ev: ev.update(surprise=1), "invalid event: surprise: Extra inputs are not permitted"),
        (lambda ev: ev.update(run_id="a b"), "invalid event: run_id:"),
    ],
)
def test_invalid_events_get_a_one_line_reason(redis_url, mutate, expected):
    ev = _event(redis_url, "nitro:hdl:r00003:weights", 7)
    mutate(ev)
    out = H.handler(ev, Ctx())
    s = ActorSummary.model_validate(out)
    assert not s.ok and expected in s.error, s.error
    assert "\n" not in s.error and "Traceback" not in s.error and "hunter2" not in json.dumps(out)
    assert s.invocation_id == f"{RUN}-r00003-0007"


@pytest.mark.parametrize("event", [None, [], 42, "not json", json.dumps([1, 2])])
def test_non_object_events(event):
    s = ActorSummary.model_validate(H.handler(event, Ctx()))
    assert not s.ok and s.error.startswith("invalid event: expected a JSON object")
    assert s.invocation_id == "unknown"


def test_json_string_event_is_accepted(published, redis_url):
    _, key = published
    s = ActorSummary.model_validate(H.handler(json.dumps(_event(redis_url, key, 5)), Ctx()))
    assert s.ok, s.error


def test_runtime_failures_are_reported_not_raised(published, redis_url):
    _, key = published
    s = ActorSummary.model_validate(H.handler(_event(redis_url, "nitro:hdl:r00003:nope", 8), Ctx()))
    assert not s.ok and "missing or expired" in s.error
    s = ActorSummary.model_validate(
        H.handler(_event(redis_url, key, 9, cache_credentials={"env": "NITRO_TEST_UNSET_VAR"}), Ctx())
    )
    assert not s.ok and "NITRO_TEST_UNSET_VAR" in s.error
    s = ActorSummary.model_validate(H.handler(_event("redis://127.0.0.1:1/0", key, 10), Ctx()))
    assert not s.ok and "cannot connect" in s.error.lower()


def test_secret_arn_credentials_via_secrets_manager(monkeypatch):
    """{"secret_arn": ...} is resolved with Secrets Manager (moto) and used for an ACL'd Redis."""
    from moto import mock_aws

    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    with LocalRedisServer(tempfile.mkdtemp(prefix="nitro-h-"), password="s3cret-pw") as srv, mock_aws():
        import boto3

        monkeypatch.setattr(H, "_SM_CLIENT", None)
        monkeypatch.setattr(H, "_SECRETS", {})
        arn = boto3.client("secretsmanager").create_secret(
            Name="nitro/redis", SecretString=json.dumps({"password": "s3cret-pw"})
        )["ARN"]
        cache = TrajectoryCache(connect_redis(srv.url, password="s3cret-pw"), RUN)
        key = cache.publish_weights(
            3,
            dumps_tensors(
                build_policy(env_spec(ENV)).state_dict(), {"env_id": ENV, "version": 3, "format": "nitro.policy/1"}
            ),
        )
        s = ActorSummary.model_validate(
            H.handler(_event(srv.url, key, 11, cache_credentials={"secret_arn": arn}), Ctx())
        )
        assert s.ok, s.error
        assert H._SECRETS[arn][1] == "s3cret-pw"
        bad = ActorSummary.model_validate(
            H.handler(_event(srv.url, key, 12, cache_credentials={"secret_arn": arn + "x"}), Ctx())
        )
        assert not bad.ok and "ResourceNotFoundException" in bad.error and "s3cret" not in bad.error
        H.STATE.close()


def test_simulate_mode_writes_a_small_dummy_batch(monkeypatch, redis_client, redis_url):
    monkeypatch.setenv(H.SIMULATE_ENV, "0.05")
    cache = TrajectoryCache(connect_redis(redis_url), RUN)
    s = ActorSummary.model_validate(H.handler(_event(redis_url, "nitro:hdl:r00003:weights", 20), Ctx()))
    assert s.ok and s.duration_s >= 0.05 and s.steps == 4
    arrays, meta = loads_tensors(cache.get_batch(3, s.invocation_id), expect_format="nitro.batch/1")
    assert meta["simulated"] == "true" and arrays["rewards"].shape == (4,)
    bad = ActorSummary.model_validate(H.handler({"run_id": RUN}, Ctx()))
    assert not bad.ok and bad.error.startswith("invalid event:")


def test_misconfigured_function_raises(monkeypatch):
    monkeypatch.setenv(H.SIMULATE_ENV, "soon")
    with pytest.raises(H.ConfigurationError, match="NITRO_SIMULATE_DURATION_S"):
        H.handler({}, Ctx())


def test_preload_imports_what_the_function_environment_names(monkeypatch):
    monkeypatch.setenv(H.PRELOAD_ENV, " nitro.actors.rollout, ,nitro.models ")
    assert H.preload() == ("nitro.actors.rollout", "nitro.models")
    monkeypatch.setenv(H.PRELOAD_ENV, "nitro.actors.rollout,nitro.no_such_module")
    with pytest.raises(H.ConfigurationError, match=r"NITRO_PRELOAD: cannot import 'nitro\.no_such_module'"):
        H.preload()


@pytest.mark.parametrize(("preload", "torch_in_init"),
                         [("", False), ("nitro.actors.rollout,nitro.models.networks", True)])
def test_init_imports_pytorch_only_where_the_function_environment_asks(preload, torch_in_init):
    """A cold start's INIT (importing the handler, in a fresh process): no PyTorch for an MLP
    policy's actors; PyTorch's networks where ``NITRO_PRELOAD`` names them (an Atari function)."""
    import subprocess
    import sys

    env = {**os.environ, H.PRELOAD_ENV: preload}
    code = "import sys, actor_lambda.handler as h; print(h.PRELOADED, 'torch' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip().endswith(str(torch_in_init))


def test_dockerfile_and_requirements():
    root = os.path.join(os.path.dirname(__file__), "..", "actor_lambda")
    docker = Path(root, "Dockerfile").read_text()
    assert docker.startswith("# syntax=") or "FROM public.ecr.aws/lambda/python:3.12" in docker
    assert "FROM public.ecr.aws/lambda/python:3.12" in docker
    assert "download.pytorch.org/whl/cpu" in docker and "MUJOCO_GL=disable" in docker
    assert 'CMD ["actor_lambda.handler.handler"]' in docker
    reqs = Path(root, "requirements.txt").read_text()
    assert "torch" not in [line.split("=")[0].split(">")[0].strip() for line in reqs.splitlines()]
    for pkg in ("gymnasium", "mujoco", "ale-py", "redis", "safetensors", "pydantic", "numpy"):
        assert pkg in reqs


# -- the Redis side for actors: TLS and an ACL user (deployments/redis) --------------------------

def _require_redis7() -> str:
    from nitro.cache import redis7_binary

    exe = redis7_binary()
    assert exe, "no Redis 7 (per-key ACL permissions, TLS): run ./setup.sh"
    return exe


def test_actor_over_tls_with_the_least_privilege_acl_user(monkeypatch):
    import redis

    from deployments.redis.setup_acl import apply_users

    d = tempfile.mkdtemp(prefix="nitro-acl-")
    tls = throwaway_tls(Path(d))
    actor_pw, learner_pw = "actor-password-0123456789", "learner-password-0123456789"
    with LocalRedisServer(
        os.path.join(d, "data"), binary=_require_redis7(), password="admin-password-0123456789", tls=tls
    ) as srv:
        admin = connect_redis(srv.url, password="admin-password-0123456789")
        assert apply_users(admin, actor_pw, learner_pw) == ["nitro-actor", "nitro-learner"]
        assert apply_users(admin, actor_pw, learner_pw)  # idempotent
        base = srv.url  # rediss://127.0.0.1:PORT/0?ssl_ca_certs=...
        learner_url = base.replace("rediss://", "rediss://nitro-learner@")
        actor_url = base.replace("rediss://", "rediss://nitro-actor@")

        learner = TrajectoryCache(connect_redis(learner_url, password=learner_pw), RUN)
        key = learner.publish_weights(3, dumps_tensors(build_policy(env_spec(ENV)).state_dict(),
                                                       {"env_id": ENV, "version": 3, "format": "nitro.policy/1"}))
        monkeypatch.setenv("NITRO_TEST_ACTOR_PW", actor_pw)
        ev = _event(actor_url, key, 30, cache_credentials={"env": "NITRO_TEST_ACTOR_PW"})
        s = ActorSummary.model_validate(H.handler(ev, Ctx()))
        assert s.ok, s.error
        got = learner.collect(3, {ev["invocation_id"]}, deadline_s=5)
        assert got.complete and got.samples == 32
        # Duplicate delivery still works under the ACL (the script's SET NX says "already there").
        assert ActorSummary.model_validate(H.handler(ev, Ctx())).ok

        actor = connect_redis(actor_url, password=actor_pw)
        assert actor.get(key) is not None
        denied = [
            ("SET", key, "x"),
            ("DEL", key),
            ("KEYS", "*"),
            ("FLUSHALL",),
            ("CONFIG", "GET", "*"),
            ("GET", "other:key"),
            ("SET", "nitro-other", "1"),
            ("SCAN", "0"),
            ("LRANGE", learner.done_key(3), "0", "-1"),
            ("EVAL", "return redis.call('DEL', KEYS[1])", "1", learner.batch_key(3, ev["invocation_id"])),
        ]
        for cmd in denied:
            with pytest.raises(redis.ResponseError, match=r"(?i)no permissions|NOPERM"):
                actor.execute_command(*cmd)
        assert learner.delete_round(3) >= 2
        # Without TLS the server does not answer at all (TLS-only listener).
        plain = base.split("?")[0].replace("rediss://", "redis://nitro-actor@")
        with pytest.raises(CacheUnavailableError):
            connect_redis(plain, password=actor_pw, timeout_s=1.0)
        H.STATE.close()


def test_atari_event_sends_uint8_frames_to_redis_not_the_response(redis_client, redis_url):
    env_id = "ALE/Qbert-v5"
    cache = TrajectoryCache(connect_redis(redis_url), RUN)
    policy = build_policy(env_spec(env_id))
    key = cache.publish_weights(4, dumps_tensors(policy.state_dict(), {"env_id": env_id, "version": 4,
                                                                       "format": "nitro.policy/1"}))
    out = H.handler(_event(redis_url, key, 7, round=4, invocation_id=f"{RUN}-r00004-0007", env_id=env_id,
                           n_steps=64), Ctx())
    s = ActorSummary.model_validate(out)
    assert s.ok, s.error
    assert len(json.dumps(out)) < 2048  # the summary only: Lambda's 6 MB response limit is far away
    arrays, _ = loads_tensors(cache.get_batch(4, s.invocation_id), expect_format="nitro.batch/1")
    assert arrays["obs"].dtype.name == "uint8" and arrays["obs"].shape == (64, 4, 84, 84)
    assert s.batch_bytes == len(cache.get_batch(4, s.invocation_id)) < 64 * 4 * 84 * 84 + 64 * 1024
