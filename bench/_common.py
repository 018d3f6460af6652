"""Shared set-up for the benchmarks: a private Prefect home, MLflow store and run home per run."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def isolated_home(name: str) -> Path:
    """A fresh temporary home, with Prefect pointed into it; call before importing flows."""
    sys.path.insert(0, str(ROOT))
    home = Path(tempfile.mkdtemp(prefix=f"nitro-bench-{name}-"))
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    from flows.settings import apply_prefect_defaults  # the CLI's, task-run recorder batching included

    apply_prefect_defaults()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nitro").setLevel(logging.INFO)
    return home


def mlflow_uri(home: Path) -> str:
    """The MLflow store of a benchmark's run home."""
    return f"sqlite:///{home}/mlflow.db"


def run_overrides(home: Path) -> list[str]:
    return [f"home={home}", f"tracking.mlflow_uri={mlflow_uri(home)}"]


def machine(**measured: object) -> dict:
    """Where a result was measured: ``nitro.experiments.machine.machine_info`` (CPU model, package
    versions, commit: the same seed and code learn differently on an Intel and an AMD CPU), plus
    what the caller measured about it (load averages, pinning)."""
    from nitro.experiments.machine import machine_info

    return {**machine_info(), **measured}


# -- the local Lambda Invoke API server, for the fan-out and orchestration benchmarks ----------------


def fake_aws_credentials() -> None:
    """Credentials for signing requests to the local Invoke server (nothing reaches AWS)."""
    for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)


def start_invoke_server(function: str, *, concurrency: int, duration_s: float, threads_per_worker: int,
                        workdir: str, timeout_s: float | None = None):
    """``tests.support.lambda_invoke_server`` in its own process (so that its CPU is not the
    client's), running the real handler in simulate mode; returns (process, endpoint URL)."""
    import subprocess
    import time

    ready = os.path.join(workdir, f"invoke-server-{function}.port")
    cmd = [sys.executable, "-m", "tests.support.lambda_invoke_server", "--port", "0", "--function", function,
           "--concurrency", str(concurrency), "--threads-per-worker", str(threads_per_worker),
           "--timeout-s", str(timeout_s or max(30.0, duration_s * 10)), "--simulate-duration-s", str(duration_s),
           "--ready-file", ready]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"invoke server did not start: {err[-2000:]}")
        time.sleep(0.05)
    with open(ready) as f:
        return proc, f"http://127.0.0.1:{f.read().strip()}"


def stop_process(proc) -> None:
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its live descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


# -- simulated actors on the process backends (the local pool and Ray), for the fan-out benchmark ---


def simulated_actor(event, state):
    """An actor function for ``LocalActorPool`` / ``RayActorBackend``: the Lambda handler's simulate
    mode (wait ``NITRO_SIMULATE_DURATION_S`` seconds, then write a small valid batch to Redis), so
    that the process backends are measured doing what the Lambda fan-out measures."""
    from actor_lambda.handler import SIMULATE_ENV, simulate_actor

    return simulate_actor(event, float(os.environ[SIMULATE_ENV]), state.memory_mb)
