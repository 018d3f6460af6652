"""Real servers for integration tests: `prefect server`, `mlflow ui` and `prefect worker`, each in its
own process group on a free port, always stopped with its group.

Every wait has a deadline and ends with the process's log tail in the failure message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFECT = str(BIN / "prefect")
MLFLOW = str(BIN / "mlflow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """Start ``args`` in the repository root, in a new session (its own process group)."""
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process's group, SIGKILL it after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_until(check: Callable[[], object], timeout_s: float, what: str, log: Path | None = None,
               proc: subprocess.Popen | None = None, every_s: float = 0.5) -> object:
    """Poll ``check`` until it returns something truthy; fail with ``what`` and the log's tail."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            said = proc.stderr.read()[-3000:] if proc.stderr is not None else ""  # what it said, where piped
            pytest.fail(f"{what}: the process exited with {proc.returncode}:\n{tail(log) if log else ''}{said}")
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{tail(log) if log else ''}")
        time.sleep(every_s)


def becomes_true(check: Callable[[], object], timeout_s: float = 30.0) -> bool:
    """Whether ``check`` returns something truthy within ``timeout_s`` (polled every 50 ms): for
    assertions, where ``wait_until`` would fail the test itself."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def base_env() -> dict:
    """The test process's environment without any Prefect/Nitro/MLflow setting that could point a
    child at the user's servers or stores."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "NITRO_", "MLFLOW_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", MUJOCO_GL="disable", PYTHONUNBUFFERED="1")
    return env


def create_flow_run(
    client: httpx.Client, deployment_id: str, parameters: dict, timeout_s: float = 30.0
) -> httpx.Response:
    """POST a deployment's create_flow_run as the UI does, resending on 503 until ``timeout_s``:
    the server's "retry" answer, which a SQLite server gives when the event persister committed
    while it created the run (README, "Fan-out and orchestration"); Prefect's own client retries it
    too. Any other answer is returned for the test to check."""

    def answer() -> httpx.Response | None:
        resp = client.post(f"/deployments/{deployment_id}/create_flow_run", json={"parameters": parameters})
        return None if resp.status_code == 503 else resp

    return wait_until(answer, timeout_s, f"create_flow_run of deployment {deployment_id} (503 throughout)")


@dataclass
class PrefectServer:
    api: str  # http://127.0.0.1:<port>/api
    ui: str  # http://127.0.0.1:<port>
    env: dict  # what a CLI call or a worker needs to talk to this server
    tmp: Path


@contextmanager
def prefect_server(tmp: Path, *, ui: bool = False, extra_env: dict[str, str] | None = None) -> Iterator[PrefectServer]:
    """`prefect server start` on a free port with its own PREFECT_HOME (and the UI if asked);
    ``extra_env`` adds settings, e.g. ``PREFECT_API_DATABASE_CONNECTION_URL`` for PostgreSQL."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    from tests.support.templates import prefect_home

    env = base_env()
    env.update(
        PREFECT_HOME=str(prefect_home(tmp / "prefect-home")),
        PREFECT_API_URL=api,
        PREFECT_UI_ENABLED="true" if ui else "false",
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_SERVER_LOGGING_LEVEL="WARNING",
        PREFECT_LOGGING_LEVEL="INFO",
        # as the README's step 1: batched task-run and event writes keep SQLite from locking under bursts
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE="100",
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE="100",
        PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE="200",
        PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE="100",
    )
    env.update(extra_env or {})
    log = tmp / "prefect-server.log"
    proc = spawn([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log)
    try:
        wait_until(lambda: _healthy(f"{api}/health"), 120, "prefect server healthy", log, proc)
        yield PrefectServer(api, f"http://127.0.0.1:{port}", env, tmp)
    finally:
        kill_group(proc)


@contextmanager
def mlflow_ui(tmp: Path, store_uri: str) -> Iterator[str]:
    """`mlflow ui` on a free port over ``store_uri``; yields its base URL. Artifacts logged through
    it land under ``tmp`` (the server's default is ./mlartifacts in its working directory, the
    checkout)."""
    port = free_port()
    log = tmp / "mlflow-ui.log"
    proc = spawn([MLFLOW, "ui", "--backend-store-uri", store_uri, "--artifacts-destination", str(tmp / "mlartifacts"),
                  "--host", "127.0.0.1", "--port", str(port)], base_env(), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(f"{url}/health"), 120, "mlflow ui healthy", log, proc)
        yield url
    finally:
        kill_group(proc)


def prefect_cli(env: dict, *args: str, timeout: float = 180) -> str:
    """`prefect --no-prompt <args>`; fails the test with its output unless it exits 0."""
    done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@contextmanager
def prefect_worker(env: dict, pool: str, log: Path) -> Iterator[subprocess.Popen]:
    """A process worker on ``pool``. No `--limit`: with one, Prefect 3.8.8's worker crashes ("this
    borrower is already holding one of this CapacityLimiter's tokens") when a run is retried
    (same flow-run id) before the worker released the slot of its failed attempt
    (PrefectHQ/prefect#10632, #16806)."""
    worker = spawn([PREFECT, "worker", "start", "--pool", pool, "--type", "process"],
                   dict(env, PREFECT_WORKER_QUERY_SECONDS="1"), log)
    try:
        yield worker
    finally:
        kill_group(worker)


@contextmanager
def deploy_leaves_no_trace() -> Iterator[None]:
    """`prefect deploy` may create a .prefect/ folder in the checkout: remove it if it was not there."""
    import shutil

    existed = (REPO / ".prefect").exists()
    try:
        yield
    finally:
        if not existed:
            shutil.rmtree(REPO / ".prefect", ignore_errors=True)


def wait_flow_run(client: httpx.Client, flow_run_id: str, states: set[str], timeout_s: float, log: Path) -> dict:
    """The flow run once its state type is in ``states``; fails early on another final state."""
    final = {"FAILED", "CRASHED", "CANCELLED", "COMPLETED"}

    def check() -> dict | None:
        fr = client.get(f"/flow_runs/{flow_run_id}").json()
        state = fr["state"]["type"] if fr.get("state") else None
        if state in states:
            return fr
        if state in final - states:
            pytest.fail(f"flow run ended {state}: {fr['state'].get('message')}\nworker log:\n{tail(log)}")
        return None

    return wait_until(check, timeout_s, f"flow run {flow_run_id} reaching {sorted(states)}", log, every_s=1)


def flow_runs_named(client: httpx.Client, name: str) -> list[dict]:
    resp = client.post("/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}})
    resp.raise_for_status()
    return resp.json()
