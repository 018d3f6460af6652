"""The worker process of the local actor pool (``nitro.actors.local``): its start-up and its loop.

``python -m nitro.actors.local_process SPEC`` starts a fresh interpreter that talks to the pool
over an inherited socket wrapped in ``multiprocessing.connection.Connection``: it loads the actor
function, says it is ready, then loops: receive an event as JSON bytes, run the actor function,
send the summary back as JSON bytes. Nothing is pickled, in either direction, not even at start-up.
The worker exits when the pool's process is gone, so no worker outlives its run. ``RESET`` (from a
pool that takes over a kept worker, see ``keep_warm_workers``) drops what it kept between
invocations, takes the new pool's environment and says it is ready again, as at start-up.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from nitro.actors.events import ActorSummary

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
RESET = b"reset"  # then the new pool's {"env": ...}; not JSON, so never an event


def load_actor_fn(path: str) -> Callable[..., Any]:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"actor_fn must look like 'package.module:function', got {path!r}")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"actor_fn {path!r} is not callable")
    return fn


def _watch_parent(parent_pid: int) -> None:
    """Exit when the pool's process is gone (even mid-rollout), so no worker outlives its run."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(conn: Connection, actor_fn: str, memory_mb: int, parent_pid: int, preload: list[str]) -> None:
    """Entry point of a worker process. Speaks JSON bytes only."""
    for var in THREAD_ENV:
        os.environ[var] = "1"
    os.environ.setdefault("MUJOCO_GL", "disable")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which closes the pool
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        for module in preload:
            importlib.import_module(module)
        fn = load_actor_fn(actor_fn)
        from nitro.actors.worker import ActorState

        state = ActorState(memory_mb=memory_mb)
        if "torch" in sys.modules:  # one intra-op thread per worker: processes give the parallelism
            torch = sys.modules["torch"]
            torch.set_num_threads(1)
            try:
                torch.set_num_interop_threads(1)
            except RuntimeError:
                pass
    except BaseException as exc:  # report why the worker cannot start, then exit
        _say(conn, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        conn.close()
        return
    if not _say(conn, {"ready": True, "pid": os.getpid()}):
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not data:  # the pool's stop message
            break
        if data.startswith(RESET):  # a new pool's worker now: its environment, nothing of the last pool's
            state.close()
            os.environ.clear()
            os.environ.update(json.loads(data[len(RESET):])["env"])
            state = ActorState(memory_mb=memory_mb)
            if not _say(conn, {"ready": True, "pid": os.getpid()}):
                break
            continue
        event: Any = None
        try:
            event = json.loads(data)
            out = fn(event, state)
            if isinstance(out, ActorSummary):
                reply = out.model_dump(mode="json")
            else:
                reply = ActorSummary.model_validate(out).model_dump(mode="json")
        except BaseException as exc:  # the actor function must not kill the loop
            inv = event.get("invocation_id", "unknown") if isinstance(event, dict) else "unknown"
            failure = ActorSummary.failed(str(inv), f"{type(exc).__name__}: {exc}", memory_mb=memory_mb)
            reply = failure.model_dump(mode="json")
        if not _say(conn, reply):
            break
    try:
        state.close()
    except Exception:
        pass


def _say(conn: Connection, message: dict) -> bool:
    """Send ``message`` to the pool as JSON bytes; False when the pool is gone (a run stopped while
    this worker started or ran): the worker then ends quietly, with no traceback on the run's stderr."""
    try:
        conn.send_bytes(json.dumps(message).encode())
    except (OSError, ValueError):
        return False
    return True


def _main(argv: list[str]) -> None:
    """``python -m nitro.actors.local_process SPEC``: a worker process, talking over the inherited socket."""
    spec = json.loads(argv[0])
    conn = Connection(int(spec["fd"]))
    _worker_main(conn, spec["actor_fn"], int(spec["memory_mb"]), int(spec["parent_pid"]), list(spec["preload"]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (torch, mujoco): a pool closes in milliseconds


if __name__ == "__main__":
    _main(sys.argv[1:])
