"""Integration test of issue 3 against a REAL local `prefect server` (temporary PREFECT_HOME).

1. the session's Prefect stack (tests/support/stack.py): `prefect server start` on a free port, the
   work pools and `prefect deploy --all` from the README, a `prefect worker`; the run's home holds a
   failure planted in round 1 (tests/support/faults.py);
2. trigger a short run through the REST API the UI uses (POST /deployments/{id}/create_flow_run);
3. the run fails in round 1; retry it the way the UI's Retry button does (set_state to
   Scheduled/AwaitingRetry, same flow-run id); it completes;
4. check: rounds before the failure were not re-executed (one `{run_id}-round-0` subflow run), and
   MLflow holds exactly one run with one value per round for each metric.
Also: bad parameters sent through the deployment are rejected with an error naming the field.

Every server process runs in its own process group and is killed with it at teardown.
"""

from __future__ import annotations

import httpx
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.tracking.metrics import ROUND_METRICS
from tests.support import faults
from tests.support.servers import create_flow_run, flow_runs_named, wait_flow_run

# The first test's budget includes starting the shared stack (minutes on a loaded machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROUNDS = 3
FAIL_AT = 1


@pytest.fixture(scope="module")
def deployment(prefect_stack, tmp_path_factory):
    """`nitro-train/local-actors` as the README deploys it; (api_url, deployment, tmp, worker log)."""
    dep = prefect_stack.deployment("nitro-train/local-actors")
    assert dep["enforce_parameter_schema"] is True
    assert all(not s["active"] for s in dep["schedules"]), "schedules must ship inactive"
    return prefect_stack.api, dep, tmp_path_factory.mktemp("prefect-server"), prefect_stack.worker_log


def test_deployed_run_fails_retries_and_resumes(deployment):
    api, dep, tmp, log = deployment
    home = tmp / "nitro-home"
    faults.plant(home, fail_at=FAIL_AT)
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
        resp = create_flow_run(client, dep['id'], params)
        assert resp.status_code == 201, resp.text
        flow_run_id = resp.json()["id"]
        run_id = "run-" + flow_run_id.replace("-", "")[:12]  # flows.training.default_run_id

        # 3. the injected failure in round 1 fails the run
        failed = wait_flow_run(client, flow_run_id, {"FAILED"}, 180, log)
        assert "injected failure in round 1" in (failed["state"]["message"] or ""), failed["state"]

        # ... retried as the UI's Retry button does: same flow-run id back to Scheduled/AwaitingRetry
        resp = client.post(f"/flow_runs/{flow_run_id}/set_state", json={
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}})
        assert resp.status_code in (200, 201), resp.text
        assert resp.json()["status"] == "ACCEPT", resp.json()
        done = wait_flow_run(client, flow_run_id, {"COMPLETED"}, 180, log)
        assert done["run_count"] >= 2

        # 4. rounds before the failure ran once; the failed round ran again
        round0 = flow_runs_named(client, f"{run_id}-round-0")
        assert [r["state"]["type"] for r in round0] == ["COMPLETED"]
        round1 = sorted(r["state"]["type"] for r in flow_runs_named(client, f"{run_id}-round-{FAIL_AT}"))
        assert round1 == ["COMPLETED", "FAILED"]
        last = flow_runs_named(client, f"{run_id}-round-{ROUNDS - 1}")
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
    for name in ROUND_METRICS:
        steps = [m.step for m in mlflow.get_metric_history(run.info.run_id, name)]
        assert sorted(steps) == list(range(ROUNDS)), f"{name}: steps {steps}"


@pytest.mark.parametrize(
    ("parameters", "field"),
    [({"rounds": "many"}, "rounds"), ({"env_id": "NoSuchEnv-v0"}, "env_id")],
)
def test_bad_parameters_are_rejected_at_creation(deployment, parameters, field):
    api, dep, _, _ = deployment
    with httpx.Client(base_url=api, timeout=30) as client:
        resp = create_flow_run(client, dep['id'], parameters)
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
        resp = create_flow_run(client, dep['id'], params)
        assert resp.status_code == 201, resp.text
        fr = wait_flow_run(client, resp.json()["id"], {"FAILED"}, 120, log)
    message = fr["state"]["message"] or ""
    assert "ConfigError" in message and "i_min" in message, message
    assert not (tmp / "bad-home").exists()


def test_the_minionsrl_pretrain_deployment_saves_a_scheduler_with_its_record(deployment):
    """The deployment `minionsrl-pretrain`, run as the UI's Custom run does: the scheduler file
    lands where the form said, with the record a run that deploys it will carry."""
    from nitro.scaling.minionsrl.pretrain import load_scheduler

    api, _, tmp, log = deployment
    out = tmp / "minionsrl" / "scheduler.safetensors"
    with httpx.Client(base_url=api, timeout=30) as client:
        dep = client.get("/deployments/name/nitro-minionsrl-pretrain/minionsrl-pretrain")
        assert dep.status_code == 200, dep.text
        resp = create_flow_run(
            client, dep.json()["id"], {"out": str(out), "overrides": ["episodes=2", "simulator.rounds=4"]}
        )
        assert resp.status_code == 201, resp.text
        wait_flow_run(client, resp.json()["id"], {"COMPLETED"}, 180, log)
    record = load_scheduler(out).record
    assert record.episodes == 2 and record.env_steps > 0 and record.usd > 0
