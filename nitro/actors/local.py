"""The local actor backend: a pool of warm worker processes owned by one training run.

Workers are started once per run, all at the same time, each as a fresh interpreter running
``nitro.actors.local_process`` (like multiprocessing's ``spawn``, but the caller's ``__main__`` is
never re-imported, so it works from a Prefect flow file, a notebook or stdin). The pool and its
workers exchange JSON bytes over a socket; nothing is pickled.

``invoke`` is thread-safe and blocking: a caller (a Prefect task thread) takes a free worker from
the idle queue, hands it the event and waits at most ``timeout_s``. A worker that dies (segfault,
``os._exit``) or overruns the timeout is killed, the invocation comes back as
``ActorSummary.failed`` with the reason, and a replacement is started in the background. A caller
never hangs: each invocation has a deadline, and the wait for a free worker has one too
(``queue_timeout_s``), or, without one, lasts only while the pool has live workers.

Inside ``keep_warm_workers()`` (the test session, where every run opens a pool), a closing pool keeps
its idle workers for the next pool of the same kind in this process, which resets them instead of
starting interpreters that import torch again; outside it a pool's workers never outlive it.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from pydantic import BaseModel

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.actors.local_process import RESET, THREAD_ENV
from nitro.actors.preload import DEFAULT_ACTOR_FN, warm_modules

log = logging.getLogger(__name__)


class PoolClosedError(RuntimeError):
    pass


class _Worker:
    def __init__(self, process: subprocess.Popen, conn: Connection, index: int, kind: tuple = ()):
        self.process = process
        self.conn = conn
        self.index = index
        self.kind = kind  # what a pool that takes it over must have in common with its first
        self.pid: int | None = process.pid
        self.invocations = 0
        self._dead = False
        self._kill_lock = threading.Lock()

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once the process is gone (negative: killed by that signal), else None."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, grace_s: float = 0.0) -> None:
        """Stop the process (idempotent, safe from any thread)."""
        with self._kill_lock:
            if self._dead:
                return
            self._dead = True
        if grace_s > 0 and self.process.poll() is None:
            try:
                self.conn.send_bytes(b"")
            except (OSError, ValueError):
                pass
            self.wait(grace_s)
        if self.process.poll() is None:
            try:
                self.process.kill()
            except OSError:
                pass
            self.wait(5.0)
        try:
            self.conn.close()
        except OSError:
            pass


_LIVE_POOLS: weakref.WeakSet[LocalActorPool] = weakref.WeakSet()
# Idle workers of closed pools, oldest first, while keep_warm_workers() is open (at most _kept_limit).
_kept: list[_Worker] = []
_kept_limit = 0
_kept_lock = threading.Lock()


@contextlib.contextmanager
def keep_warm_workers(limit: int = 4) -> Iterator[None]:
    """While open, closing pools keep up to ``limit`` idle workers in all for the next pools of the
    same kind (0: none); on leaving, those over the limit in force before are stopped."""
    global _kept_limit
    previous, _kept_limit = _kept_limit, limit
    try:
        _keep(None)
        yield
    finally:
        _kept_limit = previous
        _keep(None)


def _keep(w: _Worker | None) -> bool:
    """Keep ``w`` (False: not kept, to be stopped) and stop the oldest kept ones over the limit."""
    kept = w is not None and _kept_limit > 0 and w.process.poll() is None
    with _kept_lock:
        if kept and w is not None:
            _kept.append(w)
        stopped = _kept[:max(0, len(_kept) - _kept_limit)]
        del _kept[:len(stopped)]
    for old in stopped:
        old.kill(grace_s=1.0)
    return kept


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        try:
            pool.close(grace_s=1.0)
        except Exception:
            pass


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "worker process died"
    if code < 0:
        try:
            return f"worker process died from signal {signal.Signals(-code).name}"
        except ValueError:
            return f"worker process died from signal {-code}"
    return f"worker process exited with code {code}"


class LocalActorPool:
    """Warm actor processes for one training run; same event and summary as the Lambda backend."""

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 300.0,
        memory_mb: int = 1024,
        *,
        actor_fn: str = DEFAULT_ACTOR_FN,
        startup_timeout_s: float = 120.0,
        queue_timeout_s: float | None = None,
        preload: Iterable[str] | None = None,
    ):
        self.workers = int(workers or os.cpu_count() or 1)
        if self.workers < 1:
            raise ValueError("workers must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.actor_fn = actor_fn
        self.startup_timeout_s = float(startup_timeout_s)
        self.queue_timeout_s = queue_timeout_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._replacing = 0
        self._indices = itertools.count()
        self._closed = False
        self.replaced = 0
        self.failures = 0
        self.preload = tuple(preload) if preload is not None else warm_modules(actor_fn)
        started = self._start_workers(self.workers)
        if len(started) < self.workers:
            self.close()
            raise RuntimeError(f"local actor pool: only {len(started)} of {self.workers} workers started: "
                               f"{self._last_start_error}")
        for w in started:
            self._idle.put(w)
        _LIVE_POOLS.add(self)

    # -- workers -------------------------------------------------------------------------------

    _last_start_error = ""

    def _start_workers(self, n: int) -> list[_Worker]:
        """Start ``n`` processes at once (kept ones of this kind first, reset) and wait for all
        their ready messages (one deadline)."""
        pending: list[_Worker] = []
        env = dict(os.environ)
        # The worker imports what this process can import (e.g. a test's helper module).
        paths = [p for p in sys.path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(os.path.abspath(p) for p in paths))
        for var in THREAD_ENV:
            env[var] = "1"
        env.setdefault("MUJOCO_GL", "disable")
        # A kept worker takes this environment with its reset: only its start-up's (paths) must match.
        kind = (self.actor_fn, self.memory_mb, self.preload, env["PYTHONPATH"])
        with _kept_lock:
            taken = [w for w in _kept if w.kind == kind][:n]
            _kept[:] = [w for w in _kept if w not in taken]
        for kept in taken:
            w = _Worker(kept.process, kept.conn, next(self._indices), kind)
            try:
                w.conn.send_bytes(RESET + json.dumps({"env": env}).encode())  # answered as a start is
            except (OSError, ValueError):
                w.kill()
                continue
            with self._lock:
                self._all.add(w)
            pending.append(w)
        for _ in range(n - len(pending)):
            parent_sock, child_sock = socket.socketpair()
            index = next(self._indices)
            spec = json.dumps({"actor_fn": self.actor_fn, "memory_mb": self.memory_mb, "parent_pid": os.getpid(),
                               "preload": list(self.preload), "fd": child_sock.fileno()})
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "nitro.actors.local_process", spec],
                    pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL, close_fds=True,
                )
            except OSError as exc:
                parent_sock.close()
                child_sock.close()
                self._last_start_error = f"cannot start a worker process: {exc}"
                continue
            finally:
                child_sock.close()
            conn = Connection(parent_sock.detach())
            w = _Worker(proc, conn, index, kind)
            with self._lock:
                self._all.add(w)
            pending.append(w)
        ready: list[_Worker] = []
        deadline = time.monotonic() + self.startup_timeout_s
        for w in pending:
            error = ""
            try:
                if w.conn.poll(max(0.0, deadline - time.monotonic())):
                    msg = json.loads(w.conn.recv_bytes())
                    if msg.get("ready"):
                        w.pid = msg.get("pid", w.pid)
                        ready.append(w)
                        continue
                    error = str(msg.get("error"))
                else:
                    error = f"not ready within {self.startup_timeout_s:.0f}s"
            except (EOFError, OSError, ValueError):
                error = _exit_reason(w.wait(1.0))
            self._last_start_error = error
            log.error("actor worker %d failed to start: %s", w.index, error)
            self._discard(w)
        return ready

    def _discard(self, w: _Worker) -> None:
        with self._lock:
            self._all.discard(w)
        w.kill()

    def _replace_async(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._replacing += 1
        threading.Thread(target=self._replace, name="nitro-actor-replace", daemon=True).start()

    def _replace(self) -> None:
        try:
            for attempt in range(3):
                if self._closed:
                    return
                new = self._start_workers(1)
                if new:
                    with self._lock:
                        closed = self._closed
                        if not closed:
                            self.replaced += 1
                    if closed:
                        self._discard(new[0])
                    else:
                        self._idle.put(new[0])
                    return
                time.sleep(0.5 * 2**attempt)
            log.error("actor worker could not be replaced; the pool runs with one worker fewer")
        finally:
            with self._lock:
                self._replacing -= 1

    @property
    def alive(self) -> int:
        """Workers alive or being started."""
        with self._lock:
            return len(self._all) + self._replacing

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return sorted(w.pid for w in self._all if w.pid is not None)

    # -- invoking ------------------------------------------------------------------------------

    def _acquire(self) -> _Worker | None:
        deadline = None if self.queue_timeout_s is None else time.monotonic() + self.queue_timeout_s
        while True:
            if self._closed:
                raise PoolClosedError("the local actor pool is closed")
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                return None
            try:
                return self._idle.get(timeout=wait)
            except queue.Empty:
                if self.alive == 0:
                    raise PoolClosedError("the local actor pool has no live workers") from None

    def invoke(self, event: ActorEvent | dict[str, Any]) -> ActorSummary:
        """Run one invocation on a free warm worker; blocks, never raises for a failed actor."""
        # an ActorEvent or a GradientJob, or the event already as a dict
        payload = event.model_dump(mode="json") if isinstance(event, BaseModel) else dict(event)
        inv = str(payload.get("invocation_id") or "unknown")
        try:
            worker = self._acquire()
        except PoolClosedError as exc:
            return ActorSummary.failed(inv, str(exc), memory_mb=self.memory_mb)
        if worker is None:
            return ActorSummary.failed(inv, f"no free local worker within {self.queue_timeout_s}s",
                                       memory_mb=self.memory_mb)

        start = time.perf_counter()

        def failed(reason: str) -> ActorSummary:
            with self._lock:
                self.failures += 1
            return ActorSummary.since(inv, start, self.memory_mb, error=reason)

        healthy = False
        try:
            worker.invocations += 1
            try:
                worker.conn.send_bytes(json.dumps(payload).encode())
                if not worker.conn.poll(self.timeout_s):
                    worker.kill()
                    return failed(f"local actor timed out after {self.timeout_s:g}s "
                                  f"(worker pid {worker.pid} killed and replaced)")
                data = worker.conn.recv_bytes()
            except (EOFError, OSError, ValueError):
                if self._closed:
                    return failed("the local actor pool was closed during the invocation")
                reason = _exit_reason(worker.wait(2.0))
                worker.kill()
                return failed(f"{reason} (pid {worker.pid}); replaced")
            healthy = True
            try:
                summary = ActorSummary.model_validate(json.loads(data))
            except ValueError as exc:
                return failed(f"worker returned an invalid summary: {' '.join(str(exc).split())[:200]}")
            if summary.invocation_id != inv and inv != "unknown":
                return failed(f"worker answered for invocation {summary.invocation_id!r}, expected {inv!r}")
            if not summary.ok:
                with self._lock:
                    self.failures += 1
            return summary
        finally:
            if healthy and not self._closed:
                self._idle.put(worker)
            elif healthy:
                self._discard(worker)
            else:
                with self._lock:
                    self._all.discard(worker)
                worker.kill()
                self._replace_async()

    def launch(self, events: Iterable[ActorEvent | dict[str, Any]]) -> int:
        """Nothing to start ahead: each invocation starts on a warm worker in its own ``invoke``."""
        return 0

    def invoke_many(self, events: Iterable[ActorEvent | dict[str, Any]], max_threads: int = 64) -> list[ActorSummary]:
        """Invoke all ``events`` concurrently (threads); summaries in the order of ``events``."""
        events = list(events)
        if not events:
            return []
        with ThreadPoolExecutor(max_workers=min(max_threads, len(events)), thread_name_prefix="nitro-invoke") as ex:
            return list(ex.map(self.invoke, events))

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self, grace_s: float = 3.0) -> None:
        """Stop every worker (a polite stop message, then SIGKILL after ``grace_s``), or keep the idle
        ones inside ``keep_warm_workers()``. Idempotent."""
        with self._lock:
            if self._closed and not self._all:
                return
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        # Ask idle workers to stop; busy ones are killed (their callers get a failed summary).
        idle = set()
        while True:
            try:
                idle.add(self._idle.get_nowait())
            except queue.Empty:
                break
        workers = [w for w in workers if not (w in idle and _keep(w))]
        for w in workers:
            if w in idle:
                try:
                    w.conn.send_bytes(b"")
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + grace_s
        for w in workers:
            if w in idle:
                w.wait(max(0.0, deadline - time.monotonic()))
            w.kill()
        # Replacement threads see _closed and discard what they start.
        end = time.monotonic() + self.startup_timeout_s
        while self._replacing and time.monotonic() < end:
            time.sleep(0.05)
        _LIVE_POOLS.discard(self)

    def __enter__(self) -> LocalActorPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LocalActorPool(workers={self.workers}, alive={self.alive}, timeout_s={self.timeout_s:g}, "
                f"actor_fn={self.actor_fn!r})")
