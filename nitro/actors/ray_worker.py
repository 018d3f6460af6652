"""The Ray worker's side of the Ray actor backend (nitro/actors/ray_.py): one function, run as a Ray task.

``run_in_ray_worker(spec, event)`` takes JSON bytes and returns JSON bytes. Ray stores ``bytes``
raw (no pickle) in both directions, so neither the event nor the summary is ever unpickled. The
function is shipped by reference (this module is imported on the worker), never as a closure.

Ray keeps a worker process alive between the tasks of one job, so the actor function and its
``ActorState`` (Redis clients, envs, policies, the last weights) are kept here, per process, and a
later task on the same process is warm, as a local worker or a Lambda container is.

A task past its deadline (``deadline_s`` in the spec: the backend's timeout and a grace) ends its
worker process, as Lambda ends a function past its timeout. The backend cancels such a task with
force first; this catches the cancel Ray loses when it reaches a task being handed to its worker,
which would otherwise hold a CPU until the task ends by itself.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from nitro.actors.events import ActorSummary
from nitro.actors.local_process import THREAD_ENV, load_actor_fn

# (actor function path, memory_mb) -> (the function, its warm state), for this process's life.
_WARM: dict[tuple[str, int], tuple[Callable[..., Any], Any]] = {}


def _warm(actor_fn: str, memory_mb: int, preload: list[str]) -> tuple[Callable[..., Any], Any]:
    key = (actor_fn, memory_mb)
    if key not in _WARM:
        for var in THREAD_ENV:  # processes give the parallelism: one thread each
            os.environ.setdefault(var, "1")
        os.environ.setdefault("MUJOCO_GL", "disable")
        import importlib

        for module in preload:
            importlib.import_module(module)
        from nitro.actors.worker import ActorState

        fn = load_actor_fn(actor_fn)
        if "torch" in sys.modules:
            torch = sys.modules["torch"]
            torch.set_num_threads(1)
        _WARM[key] = (fn, ActorState(memory_mb=memory_mb))
    return _WARM[key]


EXIT_PAST_DEADLINE = 124  # the exit status of a worker that ends a task past its deadline


def _end_process(inv: str, deadline_s: float) -> None:
    print(f"nitro ray worker: invocation {inv} still running {deadline_s:g} s after it started; "
          "ending this worker process to free its CPU", file=sys.stderr, flush=True)
    os._exit(EXIT_PAST_DEADLINE)


def run_in_ray_worker(spec: bytes, event: bytes) -> bytes:
    """Run the actor function named in ``spec`` on ``event``; the summary as JSON bytes. An actor
    that raises is a failed summary; a process that dies is reported by Ray to the backend; one
    still running at the spec's ``deadline_s`` ends its process."""
    options = json.loads(spec)
    memory_mb = int(options["memory_mb"])
    inv = "unknown"
    watchdog = None
    try:
        payload = json.loads(event)
        if isinstance(payload, dict) and isinstance(payload.get("invocation_id"), str):
            inv = payload["invocation_id"]
        if options.get("deadline_s") is not None:
            watchdog = threading.Timer(float(options["deadline_s"]), _end_process, (inv, float(options["deadline_s"])))
            watchdog.daemon = True
            watchdog.start()
        fn, state = _warm(options["actor_fn"], memory_mb, list(options.get("preload", [])))
        out = fn(payload, state)
        summary = out if isinstance(out, ActorSummary) else ActorSummary.model_validate(out)
    except Exception as exc:  # a KeyboardInterrupt (Ray's polite cancel) still ends the task
        summary = ActorSummary.failed(inv, f"{type(exc).__name__}: {exc}", memory_mb=memory_mb)
    finally:
        if watchdog is not None:
            watchdog.cancel()
    return summary.model_dump_json().encode()
