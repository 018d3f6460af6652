"""The Ray actor backend: the same interface as ``LocalActorPool`` and ``LambdaActorBackend``, on Ray.

Each invocation is one Ray *task* running ``nitro.actors.ray_worker.run_in_ray_worker`` (the real
``run_actor`` by default), not a method of a Ray actor: ``ray.cancel(force=True)`` ends a running
task and frees its CPU, while a running actor method cannot be interrupted (Ray's documentation of
``ray.cancel``). Ray keeps worker processes alive between a job's tasks, and the worker keeps its
``ActorState`` per process, so a later invocation on the same process is warm.

How it talks to Ray (docs/ray.md, docs/decisions.md "Ray"):

* The event goes in and the summary comes back as JSON bytes, which Ray stores raw: no payload of
  ours is pickled or unpickled. Batches go through Redis, as with every backend.
* Tasks are submitted with ``max_retries=0``: a retried actor would run twice, and the round
  decides what to do with a failed one.
* In-flight work is capped to the cluster's capacity (``ray.cluster_resources()`` CPUs, and GPUs
  when the job asks for them, over what one job reserves). An invocation waits here for a slot,
  and its deadline (``timeout_s``) starts when it is submitted, so a queued invocation does not
  burn its time; every submitted one ends by its deadline, so the wait for a slot ends too.
* An invocation past its deadline is cancelled with ``force=True`` (its worker process is killed,
  its CPU freed; a task that outlives the cancel ends its own worker ``WORKER_GRACE_S`` later)
  and comes back as a failed summary; so do an actor that raises, a worker that
  dies (segfault, ``os._exit``, a kill by the kernel's OOM killer), Ray's own out-of-memory kill,
  a cancelled task and a Ray that cannot be reached. The backend never raises into the round.
* Duplicates: an invocation id that already succeeded is answered from memory, and calls for an
  id in flight share one invocation. ``invoke_many`` returns one summary per distinct id.
* ``launch(events)`` starts a round's invocations at once (each in its own thread, waiting for its
  slot); the round's ``invoke-actor`` tasks then receive those invocations' summaries.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from nitro.actors.events import UNKNOWN_INVOCATION, ActorEvent, ActorSummary, event_payload
from nitro.actors.lambda_answer import one_line
from nitro.actors.preload import DEFAULT_ACTOR_FN, warm_modules
from nitro.actors.ray_cluster import RaySession
from nitro.config.backend import RayConfig

log = logging.getLogger(__name__)

UNKNOWN = UNKNOWN_INVOCATION  # the id of an event that names none
SLOT_POLL_S = 1.0  # a caller waiting for a slot looks again this often (the cluster may have grown)
GET_TIMEOUT_S = 30.0  # reading a finished task's few-kB answer
WORKER_GRACE_S = 10.0  # a task still running this long past its deadline ends its worker (ray_worker)


def failure_reason(exc: BaseException) -> str:
    """One line saying why a Ray task gave no summary."""
    import ray.exceptions as rex

    if isinstance(exc, rex.TaskCancelledError):
        return "ray task was cancelled"
    if isinstance(exc, rex.OutOfMemoryError):
        return f"ray killed the worker to free memory (out of memory): {one_line(str(exc))[:300]}"
    if isinstance(exc, rex.WorkerCrashedError):
        return "ray worker process died during the invocation (a crash, os._exit, or a kill such as the OOM killer's)"
    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return f"ray task raised {type(cause).__name__}: {one_line(str(cause))[:300]}"
    if isinstance(exc, rex.GetTimeoutError):
        return "ray did not hand over the finished task's answer in time"
    return f"ray error {type(exc).__name__}: {one_line(str(exc))[:300]}"


class RayActorBackend:
    """Run actors as Ray tasks. Thread-safe; one instance per training run."""

    def __init__(
        self,
        cfg: RayConfig | None = None,
        *,
        cpus: int | None = None,
        timeout_s: float = 120.0,
        memory_mb: int = 1024,
        actor_fn: str = DEFAULT_ACTOR_FN,
        preload: Iterable[str] | None = None,
        remember: int = 100_000,
    ):
        import os

        import ray

        from nitro.actors.ray_worker import run_in_ray_worker

        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.cfg = cfg if cfg is not None else RayConfig()
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.actor_fn = actor_fn
        preload = tuple(preload) if preload is not None else warm_modules(actor_fn)
        self._spec = json.dumps({"actor_fn": actor_fn, "memory_mb": self.memory_mb, "preload": list(preload),
                                 "deadline_s": self.timeout_s + WORKER_GRACE_S}).encode()
        self.session = RaySession.open(self.cfg, cpus=int(cpus or os.cpu_count() or 1))
        self._task = ray.remote(run_in_ray_worker).options(
            num_cpus=self.session.cpus_per_job, num_gpus=self.session.gpus_per_job, max_retries=0,
            retry_exceptions=False)
        self._remember = int(remember)
        self._lock = threading.Condition()
        self._in_flight = 0
        self._refs: dict[str, Any] = {}  # id -> ObjectRef of the submitted task
        self._calls: dict[str, Future] = {}  # id -> the summary of the invocation in flight
        self._done: OrderedDict[str, ActorSummary] = OrderedDict()  # succeeded ids -> summary
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.stats = {"invocations": 0, "failures": 0, "duplicates": 0, "timeouts": 0, "peak_in_flight": 0}

    # -- one invocation ----------------------------------------------------------------------

    def _payload(self, event: ActorEvent | dict[str, Any]) -> tuple[str, bytes | ActorSummary]:
        return event_payload(event, self.memory_mb)

    def _claim(self, inv: str) -> tuple[Future, bool]:
        """The future of ``inv``'s summary, and whether the caller must run the invocation."""
        with self._lock:
            if inv != UNKNOWN and inv in self._done:
                self.stats["duplicates"] += 1
                answered: Future = Future()
                answered.set_result(self._done[inv])
                return answered, False
            if inv != UNKNOWN and inv in self._calls:
                self.stats["duplicates"] += 1
                return self._calls[inv], False
            call: Future = Future()
            if inv != UNKNOWN:
                self._calls[inv] = call
            return call, True

    def _settle(self, inv: str, call: Future, summary: ActorSummary) -> None:
        with self._lock:
            self._calls.pop(inv, None)
            if summary.ok and inv != UNKNOWN:
                self._done[inv] = summary
                while len(self._done) > self._remember:
                    self._done.popitem(last=False)
            self.stats["invocations"] += 1
            if not summary.ok:
                self.stats["failures"] += 1
        call.set_result(summary)

    def invoke(self, event: ActorEvent | dict[str, Any]) -> ActorSummary:
        """Run one invocation on Ray and wait for its summary; blocks, never raises for a failed actor."""
        inv, payload = self._payload(event)
        if isinstance(payload, ActorSummary):
            return payload
        call, mine = self._claim(inv)
        if mine:
            self._settle(inv, call, self._run_safely(inv, payload))
        return call.result()

    def _run_safely(self, inv: str, payload: bytes) -> ActorSummary:
        try:
            return self._run(inv, payload)
        except BaseException as exc:  # a bug here must still answer the caller
            log.exception("ray backend: invocation %s", inv)
            return ActorSummary.failed(inv, f"ray backend error: {type(exc).__name__}: {exc}", memory_mb=self.memory_mb)

    def _take_slot(self) -> str | None:
        """Wait for room in the cluster; None once there is, else why there will be none."""
        with self._lock:
            while True:
                if self._closed:
                    return "the Ray backend is closed"
                capacity = self.session.capacity()
                if capacity < 1:
                    return (f"the Ray cluster has no room for one invocation ({self.session.cpus_per_job:g} CPU, "
                            f"{self.session.gpus_per_job:g} GPU)")
                if self._in_flight < capacity:
                    self._in_flight += 1
                    self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], self._in_flight)
                    return None
                self._lock.wait(SLOT_POLL_S)

    def _release_slot(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._lock.notify()

    def _run(self, inv: str, payload: bytes) -> ActorSummary:
        import ray

        refused = self._take_slot()
        if refused is not None:
            return ActorSummary.failed(inv, refused, memory_mb=self.memory_mb)
        start = time.perf_counter()

        def failed(reason: str) -> ActorSummary:
            return ActorSummary.since(inv, start, self.memory_mb, error=reason)

        try:
            try:
                ref = self._task.remote(self._spec, payload)
            except Exception as exc:
                return failed(f"cannot submit to Ray: {failure_reason(exc)}")
            with self._lock:
                self._refs[inv] = ref
            ready, _ = ray.wait([ref], timeout=self.timeout_s)
            if not ready and self._closed:
                return failed("the Ray backend was closed during the invocation")
            if not ready:
                _cancel(ref)
                with self._lock:
                    self.stats["timeouts"] += 1
                return failed(f"ray actor timed out after {self.timeout_s:g}s (task cancelled with force)")
            try:
                data = ray.get(ref, timeout=GET_TIMEOUT_S)
            except Exception as exc:
                return failed("the Ray backend was closed during the invocation" if self._closed
                              else failure_reason(exc))
        finally:
            with self._lock:
                self._refs.pop(inv, None)
            self._release_slot()
        return self._answer(inv, data, failed)

    def _answer(self, inv: str, data: Any, failed) -> ActorSummary:
        if not isinstance(data, bytes):
            return failed(f"ray task returned {type(data).__name__}, not a JSON summary")
        try:
            summary = ActorSummary.model_validate_json(data)
        except ValueError as exc:
            return failed(f"worker returned an invalid summary: {one_line(str(exc))[:200]}")
        if summary.invocation_id != inv and inv != UNKNOWN:
            return failed(f"worker answered for invocation {summary.invocation_id!r}, expected {inv!r}")
        return summary

    # -- many ---------------------------------------------------------------------------------

    def _distinct(self, events: Iterable[ActorEvent | dict[str, Any]]) -> list[ActorEvent | dict[str, Any]]:
        """The events with a repeated invocation id dropped (events without an id are all kept)."""
        seen: set[str] = set()
        out = []
        for ev in events:
            inv, _ = self._payload(ev)
            if inv == UNKNOWN or inv not in seen:
                seen.add(inv)
                out.append(ev)
            else:
                with self._lock:
                    self.stats["duplicates"] += 1
        return out

    def invoke_many(self, events: Iterable[ActorEvent | dict[str, Any]]) -> list[ActorSummary]:
        """Invoke all ``events`` at once; one summary per distinct invocation id, in order."""
        todo = self._distinct(events)
        if not todo:
            return []
        with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix="nitro-ray-invoke") as pool:
            return list(pool.map(self.invoke, todo))

    def launch(self, events: Iterable[ActorEvent | dict[str, Any]]) -> int:
        """Start ``events``' invocations now, without waiting for their answers; ``invoke`` on a
        launched id returns that invocation's summary. Returns how many were started."""
        started = 0
        for ev in self._distinct(events):
            inv, payload = self._payload(ev)
            if inv == UNKNOWN or isinstance(payload, ActorSummary):
                continue  # it fails again, in its invoke
            call, mine = self._claim(inv)
            if not mine:
                continue
            thread = threading.Thread(target=self._launched, args=(inv, payload, call), daemon=True,
                                      name=f"nitro-ray-{inv}")
            with self._lock:
                self._threads.add(thread)
            thread.start()
            started += 1
        return started

    def _launched(self, inv: str, payload: bytes, call: Future) -> None:
        try:
            self._settle(inv, call, self._run_safely(inv, payload))
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self, wait_s: float = 30.0) -> None:
        """Cancel what is in flight (its callers get failed summaries), then disconnect from Ray
        (and stop a local Ray this backend started). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            refs = list(self._refs.values())
            threads = list(self._threads)
            self._lock.notify_all()
        deadline = time.monotonic() + wait_s
        _cancel_until_ended(refs, deadline)
        while time.monotonic() < deadline:
            with self._lock:
                if self._in_flight == 0:
                    break
            time.sleep(0.05)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.session.close()

    @property
    def capacity(self) -> int:
        return self.session.capacity()

    def __enter__(self) -> RayActorBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "local Ray" if self.session.local else (self.cfg.address or "the connected Ray")
        return f"RayActorBackend({where}, timeout_s={self.timeout_s:g}, actor_fn={self.actor_fn!r})"


def _cancel_until_ended(refs: list[Any], deadline: float) -> None:
    """Cancel ``refs`` with force, again each second until Ray reports each ended or ``deadline``
    (a ``time.monotonic()`` value) passes. A cancel that reaches a task while it is being handed
    to its worker can be lost; the task then ends its own worker at its deadline
    (``WORKER_GRACE_S`` past the backend's timeout, ``nitro.actors.ray_worker``)."""
    import ray

    pending = list(refs)
    while pending:
        for ref in pending:
            _cancel(ref)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, left))
        except Exception as exc:  # Ray is gone: nothing left to stop
            log.debug("ray.wait: %s", exc)
            return


def _cancel(ref: Any) -> None:
    """Cancel a task with force: a running one's worker process is killed, and its CPU freed."""
    import ray

    try:
        ray.cancel(ref, force=True)
    except Exception as exc:  # already finished, or Ray is gone: nothing left to stop
        log.debug("ray.cancel: %s", exc)
