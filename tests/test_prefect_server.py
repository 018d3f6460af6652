"""Integration test of issue 3 against a REAL local `prefect server` (temporary PREFECT_HOME).

1. start `prefect server start` on a free port, create the process work pool, deploy from the repo's
   prefect.yaml (non-interactive) and start a `prefect worker` with a failure injected in round 1;
2. trigger a short run through the REST API the UI uses (POST /deployments/{id}/create_flow_run);
3. the run fails in round 1; retry it the way the UI's Retry button does (set_state to
   Scheduled/AwaitingRetry, same flow-run id); it completes;
4. check: rounds before the failure were not re-executed (one `{run_id}-round-0` subflow run), and
   MLflow holds exactly one run with one value per round for each metric.
Also: bad parameters sent through the deployment are rejected with an error naming the field.

Every process started here runs in its own process group and is killed with it at teardown.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.tracking import CANONICAL_METRICS

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
ROUNDS = 3
FAIL_AT = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
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


def _spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    out = open(log, "wb")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`prefect server start` on a free port with its own PREFECT_HOME; yields (api_url, env, tmp)."""
    tmp = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "NITRO_", "MLFLOW_"))}
    env.update(
        PREFECT_HOME=str(tmp / "prefect-home"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_SERVER_LOGGING_LEVEL="WARNING",
        PREFECT_LOGGING_LEVEL="INFO",
        MUJOCO_GL="disable",
        PYTHONUNBUFFERED="1",
    )
    log = tmp / "server.log"
    proc = _spawn([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prefect server exited with {proc.returncode}:\n{_tail(log)}")
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server not healthy within 90 s:\n{_tail(log)}")
            time.sleep(0.5)
        yield api, env, tmp
    finally:
        _kill_group(proc)


def _cli(env: dict, *args: str, timeout: float = 120) -> str:
    done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def deployment(server):
    """Pools, `prefect deploy --all` from prefect.yaml, and a worker on `nitro-local`."""
    api, env, tmp = server
    _cli(env, "work-pool", "create", "nitro-local", "--type", "process")
    _cli(env, "work-pool", "create", "nitro-lambda", "--type", "process")
    before = set((REPO / ".prefect").iterdir()) if (REPO / ".prefect").exists() else None
    _cli(env, "deploy", "--all", timeout=180)
    if before is None:  # deploy may create a .prefect/ folder in the checkout: leave no trace
        shutil.rmtree(REPO / ".prefect", ignore_errors=True)

    with httpx.Client(base_url=api, timeout=30) as client:
        dep = client.get("/deployments/name/nitro-train/local-actors")
        assert dep.status_code == 200, dep.text
        dep = dep.json()
        assert dep["enforce_parameter_schema"] is True
        assert all(not s["active"] for s in dep["schedules"]), "schedules must ship inactive"

    worker_env = dict(env, NITRO_INJECT_FAILURE_AT_ROUND=str(FAIL_AT), PREFECT_WORKER_QUERY_SECONDS="1",
                      PREFECT_LOGGING_LEVEL="INFO")
    log = tmp / "worker.log"
    # No `--limit`: with a limit, Prefect 3.8.8's worker crashes ("this borrower is already holding one
    # of this CapacityLimiter's tokens") when a run is retried (same flow-run id) before the worker has
    # released the slot of its failed attempt (PrefectHQ/prefect#10632, #16806).
    worker = _spawn([PREFECT, "worker", "start", "--pool", "nitro-local", "--type", "process"],
                    worker_env, log)
    try:
        yield api, dep, tmp, log
    finally:
        _kill_group(worker)


def _wait_state(client: httpx.Client, flow_run_id: str, states: set[str], timeout_s: float, log: Path) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        fr = client.get(f"/flow_runs/{flow_run_id}").json()
        state = fr["state"]["type"] if fr.get("state") else None
        if state in states:
            return fr
        if state in {"FAILED", "CRASHED", "CANCELLED", "COMPLETED"} - states:
            pytest.fail(f"flow run ended {state}: {fr['state'].get('message')}\nworker log:\n{_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"flow run still {state} after {timeout_s:.0f} s\nworker log:\n{_tail(log)}")
        time.sleep(1)


def _flow_runs_named(client: httpx.Client, name: str) -> list[dict]:
    resp = client.post("/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}})
    resp.raise_for_status()
    return resp.json()


def test_deployed_run_fails_retries_and_resumes(deployment):
    api, dep, tmp, log = deployment
    home = tmp / "nitro-home"
    store = tmp / "mlflow-store-not-yet-created"
    uri = f"sqlite:///{store}/mlflow.db"
    params = {
        "rounds": ROUNDS,
        "steps_per_actor": 128,
        "scaler": "fixed",
        "overrides": ["scaler.fixed_actors=2", "backend.workers=2", "detector.subset_size=64",
                      f"home={home}", f"tracking.mlflow_uri={uri}"],
    }
    with httpx.Client(base_url=api, timeout=30) as client:
        # 2. trigger a run the way the UI's "Run > Custom run" does
        resp = client.post(f"/deployments/{dep['id']}/create_flow_run", json={"parameters": params})
        assert resp.status_code == 201, resp.text
        flow_run_id = resp.json()["id"]
        run_id = "run-" + flow_run_id.replace("-", "")[:12]  # flows.training.default_run_id

        # 3. the injected failure in round 1 fails the run
        failed = _wait_state(client, flow_run_id, {"FAILED"}, 180, log)
        assert "injected failure in round 1" in (failed["state"]["message"] or ""), failed["state"]

        # ... retried as the UI's Retry button does: same flow-run id back to Scheduled/AwaitingRetry
        resp = client.post(f"/flow_runs/{flow_run_id}/set_state", json={
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}})
        assert resp.status_code in (200, 201), resp.text
        assert resp.json()["status"] == "ACCEPT", resp.json()
        done = _wait_state(client, flow_run_id, {"COMPLETED"}, 180, log)
        assert done["run_count"] >= 2

        # 4. rounds before the failure ran once; the failed round ran again
        round0 = _flow_runs_named(client, f"{run_id}-round-0")
        assert [r["state"]["type"] for r in round0] == ["COMPLETED"]
        round1 = sorted(r["state"]["type"] for r in _flow_runs_named(client, f"{run_id}-round-{FAIL_AT}"))
        assert round1 == ["COMPLETED", "FAILED"]
        last = _flow_runs_named(client, f"{run_id}-round-{ROUNDS - 1}")
        assert [r["state"]["type"] for r in last] == ["COMPLETED"]

    # MLflow: the store was created; exactly one run in it, one value per round per metric
    mlflow = MlflowClient(tracking_uri=uri)
    exp_ids = [e.experiment_id for e in mlflow.search_experiments(view_type=ViewType.ALL)]
    runs = mlflow.search_runs(exp_ids, run_view_type=ViewType.ALL)
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["nitro.run_id"] == run_id
    assert run.data.tags["prefect.flow_run_id"] == flow_run_id
    for name in CANONICAL_METRICS:
        steps = [m.step for m in mlflow.get_metric_history(run.info.run_id, name)]
        assert sorted(steps) == list(range(ROUNDS)), f"{name}: steps {steps}"


@pytest.mark.parametrize(
    ("parameters", "field"),
    [({"rounds": "many"}, "rounds"), ({"env_id": "NoSuchEnv-v0"}, "env_id")],
)
def test_bad_parameters_are_rejected_at_creation(deployment, parameters, field):
    api, dep, _, _ = deployment
    with httpx.Client(base_url=api, timeout=30) as client:
        resp = client.post(f"/deployments/{dep['id']}/create_flow_run", json={"parameters": parameters})
        assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
        detail = resp.text
        assert field in detail and "alidation" in detail, detail
        # nothing was created for the worker to run
        runs = client.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [dep["id"]]}}}).json()
        assert all(r["parameters"] != parameters for r in runs)


def test_bad_override_fails_the_run_with_a_message_naming_the_field(deployment):
    """Values that the schema cannot see (dotted overrides) are validated by the flow: FAILED, with
    the field in the state message, before any round starts."""
    api, dep, tmp, log = deployment
    params = {"rounds": 1, "overrides": ["scaler.i_min=32", "scaler.i_max=8", f"home={tmp / 'bad-home'}"]}
    with httpx.Client(base_url=api, timeout=30) as client:
        resp = client.post(f"/deployments/{dep['id']}/create_flow_run", json={"parameters": params})
        assert resp.status_code == 201, resp.text
        fr = _wait_state(client, resp.json()["id"], {"FAILED"}, 120, log)
    message = fr["state"]["message"] or ""
    assert "ConfigError" in message and "i_min" in message, message
    assert not (tmp / "bad-home").exists()
