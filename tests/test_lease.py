"""One writer per run (nitro/cache/lease.py) against a real Redis: a second taker is refused with the
holder's line, a holder that stops renewing loses the run after the lease time, a holder on this
host whose process is gone is taken over at once, and a writer that lost the run can write
neither its lease-fenced checks nor a checkpoint."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from nitro.cache.lease import Holder, LeaseLost, RunHeld, acquire_lease
from nitro.run.rundir import CheckpointError, RunDir


def _elsewhere() -> Holder:
    return Holder("another-host", 4242, "pid:[1]", 1.0, time.time())


def test_a_second_writer_is_refused_until_the_lease_of_a_silent_holder_expires(redis_client, tmp_path):
    first = acquire_lease(redis_client, "run-a", ttl_s=1.0, holder=_elsewhere())  # never renewed: as if killed
    with pytest.raises(RunHeld) as info:
        acquire_lease(redis_client, "run-a", ttl_s=1.0)
    line = str(info.value)
    assert "\n" not in line and "host another-host, pid 4242, since" in line and "lease expires" in line, line
    RunDir(tmp_path, "run-a").save(0, {"x": 1}, first.token)
    time.sleep(1.3)
    second = acquire_lease(redis_client, "run-a", ttl_s=5.0, floor=RunDir(tmp_path, "run-a").fence_token())
    assert second.token > first.token
    with pytest.raises(LeaseLost, match="no longer holds the run"):
        first.check()
    second.check()
    # the stale writer's checkpoint is refused by the token already on disk, the holder's is written
    RunDir(tmp_path, "run-a").save(1, {"x": 2}, second.token)
    with pytest.raises(CheckpointError, match="older than token"):
        RunDir(tmp_path, "run-a").save(2, {"x": 3}, first.token)
    assert RunDir(tmp_path, "run-a").load()[1] == {"x": 2, "lease_token": second.token}
    second.release()
    assert acquire_lease(redis_client, "run-a", ttl_s=5.0).token > second.token


def test_a_holder_on_this_host_whose_process_is_gone_is_taken_over_at_once(redis_client):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = Holder.this_process()
    dead = Holder(dead.host, gone.pid, dead.pidns, dead.process_started, time.time())
    acquire_lease(redis_client, "run-b", ttl_s=60.0, holder=dead)
    assert acquire_lease(redis_client, "run-b", ttl_s=60.0).token == 2


def test_a_renewing_holder_keeps_the_run(redis_client):
    lease = acquire_lease(redis_client, "run-c", ttl_s=1.0).start_renewing()
    try:
        time.sleep(1.5)
        with pytest.raises(RunHeld, match=f"pid {Holder.this_process().pid}"):
            acquire_lease(redis_client, "run-c", ttl_s=1.0)
        lease.check()
    finally:
        lease.release()
