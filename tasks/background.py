"""Bookkeeping that the next round does not wait for: one ordered background lane per run.

Why: after each round, ``record-round`` logged the round to MLflow (a ``log_batch`` on SQLite, plus
a tag per dropped batch) before the next round could start: 40 to 200 ms a round, several percent
of a short one (bench/orchestration_overhead.py). Nothing in the next round needs it. Not sent
here: the checkpoint (it must be on disk before the next round deletes the trajectories it
consumed) and the Prefect artifacts (written in the background they raced the next round's
subflow start for the Prefect server's database, which then waited ~2 s in one round of two).

* One thread per run, so a run's writes keep their order (round k is logged before round k+1).
* Each job runs in a copy of the submitter's context, so Prefect's flow-run context (which run an
  artifact belongs to) and the run's shared API client come along.
* A failure is not lost: the next ``submit`` in the flow raises it (an MLflow store that went away
  still fails the run, one round later at most), and ``drain`` raises it at the end of the run.
  A resumed run re-logs its checkpointed rounds to MLflow (tasks/tracking.py), so a round whose
  logging was cut off by a crash is logged then.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

log = logging.getLogger("nitro")

_LANES: dict[str, _Lane] = {}
_LOCK = threading.Lock()


class _Lane:
    def __init__(self, run_id: str):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nitro-bookkeeping-{run_id}"[:40])
        self.pending: list[Future] = []
        self.failure: BaseException | None = None

    def collect(self, block: bool, timeout_s: float | None = None) -> None:
        """Forget finished jobs, keeping the first failure; wait for the rest if ``block``."""
        if block and self.pending:
            wait(self.pending, timeout=timeout_s)
        still = []
        for job in self.pending:
            if not job.done():
                still.append(job)
            elif job.exception() is not None and self.failure is None:
                self.failure = job.exception()
        self.pending = still


def submit(run_id: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run ``fn(*args, **kwargs)`` after the run's earlier jobs, off the caller's thread. Raises
    the failure of an earlier job instead, if one failed."""
    with _LOCK:
        lane = _LANES.get(run_id)
        if lane is None:
            lane = _LANES[run_id] = _Lane(run_id)
        lane.collect(block=False)
        if lane.failure is not None:
            failure, lane.failure = lane.failure, None
            raise failure
        lane.pending.append(lane.pool.submit(contextvars.copy_context().run, fn, *args, **kwargs))


def drain(run_id: str, timeout_s: float | None = 300.0, raise_failure: bool = True) -> None:
    """Wait for the run's jobs and close its lane; raise the first failure unless told not to
    (a run that is already failing only logs it, so the original error is the one reported)."""
    with _LOCK:
        lane = _LANES.pop(run_id, None)
    if lane is None:
        return
    lane.collect(block=True, timeout_s=timeout_s)
    lane.pool.shutdown(wait=False, cancel_futures=True)
    if lane.pending:
        log.warning("run %s: %d bookkeeping job(s) still running after %s s", run_id, len(lane.pending), timeout_s)
    if lane.failure is not None:
        if raise_failure:
            raise lane.failure
        log.warning("run %s: background bookkeeping failed: %s", run_id, lane.failure)
