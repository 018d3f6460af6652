"""The Ray a run's actors run on: a local one started and stopped with the run, or a cluster joined.

``RaySession.open(cfg, cpus)`` connects this process to Ray:

* Ray already connected in this process (a test's, a notebook's, another backend's): used as it
  is, and left running at ``close``.
* ``cfg.address`` None: a local Ray with ``cpus`` CPUs, the dashboard off, a small object store,
  bound to 127.0.0.1 (nothing outside the machine talks to it). It never outlives the run: Ray
  starts its GCS server and raylet with PR_SET_PDEATHSIG, tied to the *thread* that calls
  ``ray.init``, so that call runs on a thread that lives as long as the process (the main thread,
  else a dedicated one); the rest of Ray's processes are ended by ``nitro.actors.ray_reaper``.
  Ray's SIGTERM handler is taken off again, so the run stops on SIGTERM as it did without Ray.
* ``cfg.address`` "auto" or host:port: join that cluster; ``close`` disconnects, and Ray ends
  the job's tasks.

Workers get one thread each (OMP/MKL/OpenBLAS/NumExpr) through the job's ``runtime_env``; a
local Ray's workers also import what this process imports (its ``sys.path``).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil

from nitro.actors.local_process import THREAD_ENV
from nitro.config.backend import JobKind, RayConfig
from nitro.processes import on_main_thread

log = logging.getLogger(__name__)

T = TypeVar("T")
CAPACITY_TTL_S = 5.0  # how long a reading of the cluster's size is trusted (clusters autoscale)


def worker_env(local: bool) -> dict[str, str]:
    """Environment variables of the job's workers."""
    env = {var: "1" for var in THREAD_ENV}
    env["MUJOCO_GL"] = "disable"
    if local:  # the same machine: the workers can import what this process imports
        paths = [p for p in sys.path if p] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(os.path.abspath(p) for p in paths))
    return env


def slots(resources: dict[str, float], cpus_per_job: float, gpus_per_job: float) -> int:
    """How many jobs of that shape the cluster's resources hold at once."""
    n = math.floor(resources.get("CPU", 0.0) / cpus_per_job + 1e-9)
    if gpus_per_job > 0:
        n = min(n, math.floor(resources.get("GPU", 0.0) / gpus_per_job + 1e-9))
    return max(0, n)


_LASTING: queue.Queue[tuple[Callable[[], Any], queue.Queue]] | None = None
_LASTING_LOCK = threading.Lock()


def on_lasting_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that lives as long as the process: this one if it is the main thread,
    else one daemon thread kept for the purpose (children forked there die only with the process)."""
    global _LASTING
    if on_main_thread():
        return fn()
    with _LASTING_LOCK:
        if _LASTING is None:
            _LASTING = queue.Queue()
            work = _LASTING

            def serve() -> None:
                while True:
                    job, reply = work.get()
                    try:
                        reply.put((True, job()))
                    except BaseException as exc:
                        reply.put((False, exc))

            threading.Thread(target=serve, name="nitro-ray-owner", daemon=True).start()
    reply: queue.Queue = queue.Queue()
    _LASTING.put((fn, reply))
    ok, value = reply.get()
    if not ok:
        raise value
    return value


@dataclass
class RaySession:
    """This process's connection to Ray, as far as one backend is concerned."""

    owned: bool  # this session started or joined Ray, and disconnects at close
    local: bool  # this session started the Ray it uses
    cpus_per_job: float
    gpus_per_job: float
    reaper: subprocess.Popen | None = None
    _capacity: tuple[float, int] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, cfg: RayConfig, cpus: int, kind: JobKind = "actor") -> RaySession:
        import ray

        gpus = float(cfg.gpus_per_job.get(kind, 0.0))
        if ray.is_initialized():
            return cls(owned=False, local=False, cpus_per_job=cfg.cpus_per_job, gpus_per_job=gpus)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry from a training run
        local = cfg.address is None
        options: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                                       runtime_env={"env_vars": worker_env(local)})
        if local:  # "local": a new Ray, never one that RAY_ADDRESS or the last `ray start` points at
            options.update(address="local", num_cpus=cpus, object_store_memory=cfg.object_store_mb * 2**20,
                           _node_ip_address="127.0.0.1")
        else:
            options["address"] = cfg.address
        before = {p.pid for p in psutil.Process().children()}
        on_lasting_thread(lambda: _init_keeping_sigterm(ray, options))
        session = cls(owned=True, local=local, cpus_per_job=cfg.cpus_per_job, gpus_per_job=gpus)
        if local:
            roots = [p.pid for p in psutil.Process().children() if p.pid not in before]
            session.reaper = subprocess.Popen([sys.executable, "-m", "nitro.actors.ray_reaper", *map(str, roots)],
                                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
        return session

    def capacity(self) -> int:
        """Jobs the cluster holds at once, read from ``ray.cluster_resources()`` at most every few seconds."""
        import ray

        with self._lock:
            now = time.monotonic()
            if self._capacity is None or now - self._capacity[0] > CAPACITY_TTL_S:
                self._capacity = (now, slots(ray.cluster_resources(), self.cpus_per_job, self.gpus_per_job))
            return self._capacity[1]

    def close(self) -> None:
        """Disconnect (and stop a local Ray) if this session connected; then the reaper ends what is left."""
        if self.owned:
            import ray

            try:
                on_lasting_thread(ray.shutdown)
            except Exception as exc:
                log.warning("ray.shutdown failed: %s", exc)
            self.owned = False
        if self.reaper is not None:
            try:
                if self.reaper.stdin is not None:  # always a pipe: started with stdin=PIPE
                    self.reaper.stdin.close()
                self.reaper.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.reaper.kill()
            self.reaper = None


def _init_keeping_sigterm(ray: Any, options: dict[str, Any]) -> None:
    """``ray.init``, then SIGTERM's handler as it was: Ray installs its own on the main thread."""
    main = on_main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**options)
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)
