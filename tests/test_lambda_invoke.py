"""The Lambda backend over its two real invoke paths (aiohttp requests signed by botocore's SigV4,
and boto3's own ``invoke``), against the local Invoke API server (tests.support.lambda_invoke_server)
running the REAL handler (actor_lambda.handler) in worker processes, with trajectories landing in a
real Redis. The server verifies every request's SigV4 signature against the test credentials, as
Lambda would: a wrongly signed request is refused, so every passing test also checks the signing."""

from __future__ import annotations

import base64
import json
import threading

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from nitro.actors import lambda_http
from nitro.actors.events import ActorEvent
from nitro.actors.lambda_ import LambdaActorBackend
from nitro.actors.lambda_answer import parse_report
from nitro.actors.profile import profile_actor
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import LambdaConfig
from nitro.envs import env_spec
from nitro.models.networks import build_policy
from nitro.serialization import dumps_tensors, loads_tensors
from tests.support.lambda_invoke_server import FunctionSpec, InvokeServer

ENV = "Hopper-v5"
RUN = "lam"
CREDENTIALS = ("testing", "testing-secret")  # what the server verifies signatures against
INVOKERS = ["aiohttp", "boto3"]
pytestmark = pytest.mark.slow  # the Invoke API emulator and its function processes


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS[1])
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(params=INVOKERS)
def invoker(request) -> str:
    """Every failure path runs through both transports."""
    return request.param


@pytest.fixture(scope="module")
def server():
    functions = [
        FunctionSpec("nitro-actor", concurrency=2, timeout_s=60),  # the real actor
        FunctionSpec("nitro-actor-short", concurrency=1, timeout_s=1),  # real actor, 1 s timeout
        FunctionSpec("nitro-actor-sim", concurrency=2, timeout_s=10, threads_per_worker=4,
                     environment={"NITRO_SIMULATE_DURATION_S": "0.3"}, aliases={"mem512": "1", "mem1024": "2"}),
        FunctionSpec("nitro-actor-misconfigured", concurrency=1, timeout_s=10,
                     environment={"NITRO_SIMULATE_DURATION_S": "soon"}),
        FunctionSpec("nitro-actor-badimage", handler="actor_lambda.no_such_module.handler", concurrency=1),
        FunctionSpec("nitro-actor-slow", concurrency=4, timeout_s=30, threads_per_worker=4,
                     environment={"NITRO_SIMULATE_DURATION_S": "3"}),
    ]
    with InvokeServer(functions, credentials=CREDENTIALS) as srv:
        srv.prewarm({"nitro-actor": 2, "nitro-actor-sim": 1})
        yield srv


@pytest.fixture()
def weights(redis_client, redis_url):
    cache = TrajectoryCache(connect_redis(redis_url), RUN)
    policy = build_policy(env_spec(ENV))
    key = cache.publish_weights(
        0, dumps_tensors(policy.state_dict(), {"env_id": ENV, "version": 0, "format": "nitro.policy/1"})
    )
    return cache, key


def _event(redis_url, key, i, n_steps=64, **kw):
    return ActorEvent(run_id=RUN, round=0, invocation_id=f"{RUN}-r00000-{i:04d}", weights_key=key, env_id=ENV,
                      seed=i, n_steps=n_steps, cache_url=redis_url, **kw)


def _backend(server, name="nitro-actor", concurrency=2, timeout_s=60, invoker="aiohttp", url=None, **kw):
    cfg = LambdaConfig(function_name=name, endpoint_url=url or server.url, concurrency=concurrency,
                       function_timeout_s=max(1, int(timeout_s)), invoker=invoker, **kw)
    return LambdaActorBackend(cfg, memory_mb=1024, timeout_s=timeout_s)


def _raw_client(server):
    return boto3.client("lambda", endpoint_url=server.url, region_name="us-east-1",
                        config=Config(retries={"mode": "standard", "total_max_attempts": 1}, read_timeout=90))


def _invocations(server, name: str) -> int:
    return server.stats(name)[name]["invocations"]


def test_client_config_follows_the_notes(server):
    with _backend(server, concurrency=64, timeout_s=300, invoker="boto3") as be:
        cfg = be.transport.client.meta.config
        assert cfg.max_pool_connections >= 64
        assert cfg.read_timeout > 300
        assert cfg.retries["total_max_attempts"] == 1 and cfg.retries["mode"] == "standard"
        assert be.transport.client.meta.endpoint_url == server.url
    with _backend(server, concurrency=64, timeout_s=300, invoker="aiohttp") as be:
        session = be.transport.session
        assert session.connector.limit >= 64  # a connection for every call in flight
        assert session.timeout.sock_read > 300  # Lambda reports a slow actor; the client never cuts it off
        assert be.transport.url == f"{server.url}/2015-03-31/functions/nitro-actor/invocations"


def test_success_trajectories_land_in_redis(server, weights, redis_url, invoker):
    cache, key = weights
    events = [_event(redis_url, key, i) for i in range(3)]
    with _backend(server, invoker=invoker) as be:
        summaries = be.invoke_many(events)
    assert [s.invocation_id for s in summaries] == [e.invocation_id for e in events]
    for s, ev in zip(summaries, events):
        assert s.ok, s.error
        assert s.steps == 64 and s.memory_mb == 1024
        assert s.batch_key == cache.batch_key(0, ev.invocation_id)
        data = cache.get_batch(0, ev.invocation_id)
        arrays, meta = loads_tensors(data, expect_format="nitro.batch/1")
        assert arrays["rewards"].shape == (64,) and meta["invocation_id"] == ev.invocation_id
        assert s.billed_ms >= 1
    assert sorted(x.decode() for x in cache.client.lrange(cache.done_key(0), 0, -1)) == sorted(
        e.invocation_id for e in events
    )


def test_raw_invoke_headers_and_billed_duration(server, weights, redis_url):
    _, key = weights
    client = _raw_client(server)
    resp = client.invoke(
        FunctionName="nitro-actor", Payload=_event(redis_url, key, 9).model_dump_json(), LogType="Tail"
    )
    assert resp["StatusCode"] == 200 and resp["ExecutedVersion"] == "$LATEST" and "FunctionError" not in resp
    log = base64.b64decode(resp["LogResult"]).decode()
    assert "REPORT RequestId:" in log and "Billed Duration:" in log
    report = parse_report(resp["LogResult"])
    assert report["billed_ms"] >= 1 and report["memory_mb"] == 1024
    assert json.loads(resp["Payload"].read())["ok"] is True
    # The backend takes billed_ms from that REPORT line.
    with _backend(server) as be:
        s = be.invoke(_event(redis_url, key, 10))
    assert s.ok and s.billed_ms >= int(s.duration_s * 1000)


def test_duplicate_delivery_counts_once(server, weights, redis_url, invoker):
    cache, key = weights
    ev = _event(redis_url, key, 20)
    with _backend(server, invoker=invoker) as be:
        first = be.invoke(ev)
        again = be.invoke(ev)  # e.g. a retried Prefect task
        many = be.invoke_many([ev, _event(redis_url, key, 21), ev])
        assert be.stats["invocations"] == 2  # 20 and 21 once each
    assert first.ok and again == first
    assert [s.invocation_id for s in many] == [ev.invocation_id, f"{RUN}-r00000-0021"]
    # A second delivery that does reach the function (another client) is stored/enqueued once.
    resp = _raw_client(server).invoke(FunctionName="nitro-actor", Payload=ev.model_dump_json())
    assert json.loads(resp["Payload"].read())["ok"] is True
    done = [x.decode() for x in cache.client.lrange(cache.done_key(0), 0, -1)]
    assert done.count(ev.invocation_id) == 1


def test_bad_event_is_a_clear_failed_summary(server, redis_url, invoker):
    with _backend(server, invoker=invoker) as be:
        s = be.invoke({"invocation_id": "lam-r00000-0099", "run_id": "lam", "round": 0, "env_id": "Nope-v0"})
    assert not s.ok and s.error.startswith("invalid event:") and "Traceback" not in s.error
    assert be.stats["function_errors"] == 0


def test_function_error_misconfigured_function(server, weights, redis_url, invoker):
    _, key = weights
    with _backend(server, name="nitro-actor-misconfigured", invoker=invoker) as be:
        s = be.invoke(_event(redis_url, key, 30))
    assert not s.ok and "function error (ConfigurationError)" in s.error and "NITRO_SIMULATE_DURATION_S" in s.error
    assert be.stats["function_errors"] == 1
    with _backend(server, name="nitro-actor-badimage", invoker=invoker) as be:
        s = be.invoke(_event(redis_url, key, 31))
    assert not s.ok and "Runtime.ImportModuleError" in s.error


def test_timeout_is_reported_as_lambda_reports_it(server, weights, redis_url, invoker):
    cache, key = weights
    before = server.stats("nitro-actor-short")["nitro-actor-short"]["timeouts"]
    with _backend(server, name="nitro-actor-short", timeout_s=1, invoker=invoker) as be:
        s = be.invoke(_event(redis_url, key, 41, n_steps=1_000_000))
    # {"errorType": "Sandbox.Timedout", "errorMessage": "RequestId: ... Error: Task timed out after 1.00 seconds"}
    assert (
        not s.ok and "Lambda timed out (Sandbox.Timedout)" in s.error and "Task timed out after 1.00 seconds" in s.error
    )
    assert s.billed_ms == 1000  # from the REPORT line: a timeout bills the whole timeout
    assert cache.get_batch(0, f"{RUN}-r00000-0041") is None
    stats = server.stats("nitro-actor-short")["nitro-actor-short"]
    assert stats["timeouts"] == before + 1 and stats["workers"] == 0  # the execution environment was destroyed


def test_throttle_burst_is_retried_until_it_succeeds(server, weights, redis_url, invoker):
    """Server concurrency 2 < client concurrency 8: 429s, jittered retries, every batch stored."""
    cache, key = weights
    before = server.stats("nitro-actor-sim")["nitro-actor-sim"]["throttles"]
    events = [_event(redis_url, key, 100 + i) for i in range(10)]
    with _backend(server, name="nitro-actor-sim", concurrency=8, timeout_s=60, max_throttle_retries=30,
                  invoker=invoker) as be:
        summaries = be.invoke_many(events)
        assert be.stats["throttled"] > 0
    assert all(s.ok for s in summaries), [s.error for s in summaries if not s.ok]
    assert server.stats("nitro-actor-sim")["nitro-actor-sim"]["throttles"] > before
    for ev in events:
        assert cache.get_batch(0, ev.invocation_id) is not None


def test_throttle_gives_up_with_a_reason(server, weights, redis_url, invoker):
    _, key = weights
    events = [_event(redis_url, key, 200 + i) for i in range(6)]
    with _backend(server, name="nitro-actor-sim", concurrency=6, timeout_s=5, max_throttle_retries=0,
                  invoker=invoker) as be:
        summaries = be.invoke_many(events)
    failed = [s for s in summaries if not s.ok]
    assert failed and all("throttled by Lambda (TooManyRequestsException" in s.error for s in failed)
    assert sum(s.ok for s in summaries) >= 2


def test_oversize_request_is_413(server, redis_url, invoker):
    big = {"invocation_id": "lam-r00000-0300", "padding": "x" * (6 * 1024 * 1024 + 10)}
    with pytest.raises(ClientError) as info:
        _raw_client(server).invoke(FunctionName="nitro-actor", Payload=json.dumps(big))
    assert info.value.response["Error"]["Code"] == "RequestEntityTooLargeException"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 413
    with _backend(server, invoker=invoker) as be:
        s = be.invoke(big)
    assert not s.ok and "payload too large" in s.error and "smaller than 6291456 bytes" in s.error


def test_unknown_function_and_qualifier(server, weights, redis_url, invoker):
    _, key = weights
    with _backend(server, name="no-such-function", invoker=invoker) as be:
        s = be.invoke(_event(redis_url, key, 400))
    assert not s.ok and "ResourceNotFoundException" in s.error and "HTTP 404" in s.error
    with _backend(server, name="nitro-actor-sim", qualifier="mem512", invoker=invoker) as be:
        assert be.invoke(_event(redis_url, key, 401)).ok
    with _backend(server, name="nitro-actor-sim", qualifier="nope", invoker=invoker) as be:
        assert "ResourceNotFoundException" in be.invoke(_event(redis_url, key, 402)).error


def test_profile_actor_over_lambda_aliases(server, weights, redis_url):
    _, key = weights

    def factory(memory_mb: int) -> LambdaActorBackend:
        cfg = LambdaConfig(function_name="nitro-actor-sim", qualifier=f"mem{memory_mb}", endpoint_url=server.url,
                           concurrency=2, function_timeout_s=10)
        return LambdaActorBackend(cfg, memory_mb=memory_mb, timeout_s=10)

    report = profile_actor(factory, [1024, 512], _event(redis_url, key, 500), repeats=2, warmup=1)
    assert [s.memory_mb for s in report.sizes] == [512, 1024]
    assert all(s.failures == 0 and s.median_ms >= 300 for s in report.sizes)
    # The same simulated duration at both sizes, measured on a shared host: the rule is checked against
    # what was measured (the cheapest size within 10% of the fastest median), and where both sizes
    # came out within 10% (on a quiet host, always), the smaller one is the cheaper.
    fastest = min(s.median_ms for s in report.sizes)
    not_slower = [s for s in report.sizes if s.median_ms <= 1.1 * fastest]
    assert report.recommended_mb == min(not_slower, key=lambda s: s.cost_per_invocation_usd).memory_mb, report.table()
    if len(not_slower) == 2:
        assert report.recommended_mb == 512, report.table()


def test_wrong_secret_is_refused_by_the_signature_check(server, weights, redis_url, invoker, monkeypatch):
    """The server recomputes each request's SigV4 signature; a client signing with another secret
    is refused with the service's 403, and the function never runs."""
    _, key = weights
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    failures, ran = server.auth_failures, _invocations(server, "nitro-actor-sim")
    with _backend(server, name="nitro-actor-sim", invoker=invoker) as be:
        s = be.invoke(_event(redis_url, key, 600))
    assert not s.ok and "InvalidSignatureException, HTTP 403" in s.error and "signature" in s.error
    assert server.auth_failures == failures + 1 and _invocations(server, "nitro-actor-sim") == ran


def test_launch_sends_at_once_and_each_id_is_invoked_once(server, weights, redis_url, invoker):
    """``launch`` starts every invocation and returns once the requests left the client; the
    per-actor ``invoke`` calls that follow (the round's mapped tasks) get those summaries."""
    cache, key = weights
    events = [_event(redis_url, key, 700 + i) for i in range(4)]
    ran = _invocations(server, "nitro-actor-slow")
    with _backend(server, name="nitro-actor-slow", concurrency=4, timeout_s=30, invoker=invoker) as be:
        assert be.launch(events) == 4
        assert all(be.timings[e.invocation_id].sent is not None for e in events)  # all four left
        assert be.launch(events) == 0  # already in flight: nothing started twice
        summaries = [be.invoke(e) for e in events]
        assert be.invoke(events[0]) == summaries[0]  # answered from memory
        assert be.stats["invocations"] == 4 and be.stats["duplicates"] == 1
    assert all(s.ok for s in summaries), [s.error for s in summaries]
    assert _invocations(server, "nitro-actor-slow") == ran + 4
    for ev, s in zip(events, summaries):
        assert s.invocation_id == ev.invocation_id and cache.get_batch(0, ev.invocation_id) is not None
        timing = be.timings[ev.invocation_id]
        assert timing.started <= timing.sent <= timing.answered


def test_close_answers_waiters_of_invocations_in_flight(server, weights, redis_url, invoker):
    _, key = weights
    ev = _event(redis_url, key, 800)
    be = _backend(server, name="nitro-actor-slow", concurrency=2, timeout_s=30, invoker=invoker)
    be.launch([ev])
    got = []
    waiter = threading.Thread(target=lambda: got.append(be.invoke(ev)))
    waiter.start()
    be.close()
    waiter.join(timeout=20)
    assert len(got) == 1 and not got[0].ok and "closed" in got[0].error
    assert "closed" in be.invoke(_event(redis_url, key, 801)).error
    assert "closed" in be.invoke_many([_event(redis_url, key, 802)])[0].error


def test_nothing_listening_is_a_transport_failure(server, weights, redis_url, invoker):
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _, key = weights
    with _backend(server, invoker=invoker, url=f"http://127.0.0.1:{port}") as be:
        s = be.invoke(_event(redis_url, key, 900))
    assert not s.ok and s.error.startswith("no response from Lambda (EndpointConnectionError)")


def test_read_timeout_is_a_transport_failure(server, weights, redis_url, invoker, monkeypatch):
    """A function still running past the client's read timeout (set just above the function's
    timeout) is not re-sent: a failed summary, the round goes on."""
    monkeypatch.setattr(lambda_http, "READ_TIMEOUT_MARGIN_S", 0.5)
    _, key = weights
    with _backend(server, name="nitro-actor-slow", timeout_s=1, invoker=invoker) as be:  # read timeout 1.5 s < 3 s
        s = be.invoke(_event(redis_url, key, 950))
        assert be.stats["invocations"] == 0
    assert not s.ok and s.error.startswith("no response from Lambda (ReadTimeoutError)")


@pytest.mark.parametrize(
    ("endpoint", "function", "qualifier", "token"),
    [
        (
            "https://lambda.eu-west-1.amazonaws.com",
            "arn:aws:lambda:eu-west-1:123456789012:function:nitro-actor",
            "live",
            "TOKEN",
        ),
        ("http://127.0.0.1:9001", "nitro-actor", None, None),
    ],
)
def test_signer_signs_exactly_as_botocore(monkeypatch, endpoint, function, qualifier, token):
    """The lean signer's Authorization equals botocore's SigV4Auth for the same request and time:
    ARN quoting, the qualifier, a session token and a non-default port included."""
    import datetime
    from unittest import mock

    import botocore.auth
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    url = endpoint + lambda_http.invoke_path(function, qualifier)
    payload = b'{"invocation_id": "lam-r00000-0001"}'
    when = datetime.datetime(2026, 11, 23, 1, 2, 3)
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=when):
        reference = AWSRequest(method="POST", url=url, data=payload,
                               headers={"X-Amz-Invocation-Type": "RequestResponse", "X-Amz-Log-Type": "Tail"})
        SigV4Auth(creds, "lambda", "eu-west-1").add_auth(reference)
    mine = lambda_http.InvokeSigner(url, "eu-west-1", creds).headers(payload, when.strftime("%Y%m%dT%H%M%SZ"))
    assert mine["Authorization"] == reference.headers["Authorization"]
    assert mine["X-Amz-Date"] == reference.headers["X-Amz-Date"]
    assert mine.get("X-Amz-Security-Token") == token
    assert mine["Host"] == botocore.auth._host_from_url(url)
