"""LocalActorPool: warm processes, crash and timeout replacement, 64 callers, clean shutdown."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import psutil
import pytest

from nitro.actors.events import ActorEvent, invocation_id
from nitro.actors.local import LocalActorPool, keep_warm_workers
from tests.support.servers import becomes_true

HELPER = "tests.support.actor_helpers:scripted"


def _event(i: int, seed: int = 0, n_steps: int = 10, round_idx: int = 0) -> ActorEvent:
    return ActorEvent(
        run_id="pool", round=round_idx, invocation_id=invocation_id("pool", round_idx, i), weights_key="k",
        env_id="Hopper-v5", seed=seed, n_steps=n_steps, cache_url="redis://127.0.0.1:1/0",
    )


def _gone(pids) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


@pytest.fixture(scope="module", autouse=True)
def no_kept_workers():
    """These tests are about a pool's own processes: none comes from or goes to another pool."""
    with keep_warm_workers(0):
        yield


@pytest.fixture(scope="module")
def pool():
    with LocalActorPool(workers=2, timeout_s=2.0, memory_mb=512, actor_fn=HELPER) as p:
        yield p


def test_warm_workers_are_reused(pool):
    pids = set(pool.pids)
    assert len(pids) == 2
    summaries = [pool.invoke(_event(i)) for i in range(8)]
    assert all(s.ok for s in summaries)
    used = {int(s.batch_key.split(":")[1]) for s in summaries}
    assert used <= pids  # no process was started per invocation
    assert set(pool.pids) == pids


def test_actor_exception_is_a_failed_summary_and_keeps_the_worker(pool):
    pids = set(pool.pids)
    s = pool.invoke(_event(1, seed=4))
    assert not s.ok and "boom in the actor" in s.error and s.invocation_id == invocation_id("pool", 0, 1)
    assert set(pool.pids) == pids


@pytest.mark.parametrize("seed,reason", [(1, "SIGSEGV"), (2, "exited with code 3")])
def test_crashed_worker_is_reported_and_replaced(pool, seed, reason):
    before = set(pool.pids)
    t0 = time.monotonic()
    s = pool.invoke(_event(2, seed=seed))
    assert time.monotonic() - t0 < 2.0
    assert not s.ok and reason in s.error and "replaced" in s.error
    assert s.memory_mb == 512 and s.billed_ms >= 1
    assert becomes_true(lambda: len(pool.pids) == 2 and set(pool.pids) != before)
    assert len(set(pool.pids) & before) == 1
    assert all(x.ok for x in pool.invoke_many([_event(i) for i in range(4)]))


def test_hung_worker_times_out_and_is_replaced(pool):
    before = set(pool.pids)
    t0 = time.monotonic()
    s = pool.invoke(_event(3, seed=3))
    elapsed = time.monotonic() - t0
    assert 2.0 <= elapsed < 4.0
    assert not s.ok and "timed out after 2s" in s.error
    assert s.duration_s >= 2.0 and s.billed_ms >= 2000
    assert becomes_true(lambda: len(pool.pids) == 2 and set(pool.pids) != before)
    assert pool.invoke(_event(4)).ok


def test_64_concurrent_callers_all_return(pool):
    events = [_event(i, n_steps=1000, round_idx=7) for i in range(64)]  # ~10 ms each
    results: dict[str, object] = {}

    def call(e):
        results[e.invocation_id] = pool.invoke(e)

    threads = [threading.Thread(target=call, args=(e,)) for e in events]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert time.monotonic() - t0 < 30
    assert set(results) == {e.invocation_id for e in events}
    assert all(s.ok and s.invocation_id == k for k, s in results.items())


def test_mixed_failures_under_concurrency_never_hang(pool):
    events = [_event(i, seed=(1 if i == 5 else 2 if i == 9 else 0), round_idx=8) for i in range(24)]
    summaries = pool.invoke_many(events)
    assert [s.invocation_id for s in summaries] == [e.invocation_id for e in events]
    assert sum(not s.ok for s in summaries) == 2
    assert becomes_true(lambda: len(pool.pids) == 2)


def test_pool_closes_cleanly_without_orphans():
    before = {p.pid for p in mp.active_children()}
    pool = LocalActorPool(workers=2, timeout_s=5.0, memory_mb=256, actor_fn=HELPER)
    pids = pool.pids
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    assert pool.invoke(_event(0)).ok
    pool.close()
    assert becomes_true(lambda: _gone(pids), 5.0)
    assert {p.pid for p in mp.active_children()} <= before
    # closed: an invoke fails fast instead of hanging, and close is idempotent
    s = pool.invoke(_event(1))
    assert not s.ok and "closed" in s.error
    pool.close()


def test_close_while_busy_returns_a_failed_summary():
    pool = LocalActorPool(workers=1, timeout_s=60.0, memory_mb=256, actor_fn=HELPER)
    pids = pool.pids
    out = []
    t = threading.Thread(target=lambda: out.append(pool.invoke(_event(0, seed=3))))
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    pool.close(grace_s=0.5)
    t.join(10)
    assert time.monotonic() - t0 < 10 and not t.is_alive()
    assert not out[0].ok and "closed" in out[0].error
    assert becomes_true(lambda: _gone(pids), 5.0)


def test_bad_actor_fn_fails_at_start_with_the_reason():
    with pytest.raises(RuntimeError, match="no_such_module"):
        LocalActorPool(workers=1, timeout_s=5.0, memory_mb=256, actor_fn="no_such_module:fn", startup_timeout_s=30)
