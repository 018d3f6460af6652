"""The Prefect pipeline in process: the real `nitro-train` flow, a real (test-harness) Prefect API,
a real Redis and a real MLflow SQLite store, on a tiny Hopper run.

What it proves (issue 3): rounds run as subflows and finish; exactly one MLflow run per training run
(no stray runs from task threads); one value per round for each canonical metric; the whole config
as params; final artifacts; a checkpoint per round; consumed Redis keys deleted; resume after an
injected failure re-runs no completed round and charges no spend twice; bad input fails clearly.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.config import ConfigError, NitroConfig
from nitro.run.rundir import RunDir
from nitro.tracking.metrics import ROUND_METRICS
from nitro.tracking.tracker import TAG_RUN_ID, params_from_config

pytestmark = pytest.mark.timeout(300)

ROUNDS = 3


def _overrides(home: Path, uri: str, redis_url: str | None = None) -> list[str]:
    out = [
        f"rounds={ROUNDS}",
        "steps_per_actor=128",
        "scaler.name=fixed",
        "scaler.fixed_actors=2",
        "detector.enabled=true",
        "backend.workers=2",
        "detector.subset_size=64",
        f"home={home}",
        f"tracking.mlflow_uri={uri}",
    ]
    if redis_url:
        out.append(f"redis.url={redis_url}")
    return out


def _train(overrides: list[str], run_id: str) -> dict:
    from flows.training import train

    return asyncio.run(train(overrides=overrides, run_id=run_id))


def _all_runs(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    exp_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(exp_ids, run_view_type=ViewType.ALL, max_results=1000)


def _check_one_value_per_round(client: MlflowClient, mlflow_run: str, rounds: int) -> None:
    for name in ROUND_METRICS:
        steps = [m.step for m in client.get_metric_history(mlflow_run, name)]
        assert sorted(steps) == list(range(rounds)), f"{name}: steps {steps}"


async def _flow_runs_named(name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async with get_client() as client:
        return await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))


# -- a short run -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_short_run(prefect_api, tmp_path, redis_client, redis_url):
    home = tmp_path / "home"
    store = tmp_path / "not" / "yet" / "there"  # a missing MLflow store directory is created
    assert not store.exists()
    uri = f"sqlite:///{store}/mlflow.db"
    run_id = "pipeline-short"

    result = _train(_overrides(home, uri, redis_url), run_id)

    assert result.rounds_done == ROUNDS and result.stop_reason == "round_limit"
    assert (store / "mlflow.db").exists()

    # exactly one MLflow run in the whole store: no stray runs from task threads
    runs = _all_runs(uri)
    assert [r.info.run_id for r in runs] == [result.mlflow_run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_RUN_ID] == run_id
    client = MlflowClient(tracking_uri=uri)
    _check_one_value_per_round(client, run.info.run_id, ROUNDS)

    # the whole config as params
    config = NitroConfig.load(overrides=_overrides(home, uri, redis_url))
    expected = params_from_config(config)
    assert {k: run.data.params.get(k) for k in expected} == expected

    # artifacts: plots (PNG, at the root, where MLflow's Compare looks), checkpoint pointer, config;
    # the final policy is a logged MLflow model linked to the run
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"return.png", "actors.png", "spend.png", "checkpoint", "config"} <= top
    models = [client.get_logged_model(o.model_id) for o in client.get_run(run.info.run_id).outputs.model_outputs]
    assert [(m.name, str(m.status)) for m in models] == [("policy", "READY")]

    # a checkpoint per completed round
    rounds = sorted(p.name for p in RunDir(home, run_id).checkpoints.iterdir() if p.name.startswith("round-"))
    assert rounds == [f"round-{k:05d}" for k in range(ROUNDS)]

    # Redis: a round's keys go once the checkpoint two rounds later is durable (a resume that falls
    # back one checkpoint finds its batches); only the last two rounds' keys remain, beside the
    # last fencing token handed out (nitro/cache/lease.py); the lease itself is released
    keys = sorted(k.decode() for k in redis_client.scan_iter(match=f"nitro:{run_id}:*"))
    assert f"nitro:{run_id}:lease:token" in keys and f"nitro:{run_id}:lease" not in keys
    keys.remove(f"nitro:{run_id}:lease:token")
    assert keys, "the last round's keys should still be there"
    assert all(k.startswith((f"nitro:{run_id}:r{ROUNDS - 2:05d}:", f"nitro:{run_id}:r{ROUNDS - 1:05d}:"))
               for k in keys), keys

    # Prefect's graph shows the round's data flow: each step's task run lists, among its inputs,
    # the task run whose result it received
    edges = asyncio.run(_round_edges(f"{run_id}-round-1"))
    assert ("detect-boosting", "update-policy") in edges["update"], edges
    assert ("decide-actors", "detect-boosting") in edges["detection"], edges
    assert ("decide-actors", "update-policy") in edges["update"], edges
    assert ("plan-invocations", "decide-actors") in edges["decision"], edges
    assert ("plan-invocations", "publish-weights") in edges["weights_key"], edges
    assert ("end-round", "decide-actors") in edges["decision"], edges
    assert {("end-round", "invoke-actor")} == edges["summaries"], edges


async def _round_edges(round_flow_run_name: str, timeout_s: float = 30.0) -> dict[str, set[tuple[str, str]]]:
    """{parameter: {(task, upstream task)}} of one round subflow's task runs, as the Prefect API
    records them (task names without their run suffix). The server writes task runs in batches,
    so it is polled until end-round, the last one, is there."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import TaskRunResult

    (flow_run,) = await _flow_runs_named(round_flow_run_name)
    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
            names = {
                r.id: r.name.rsplit("-", 1)[0] if not r.name.startswith("actor-") else "invoke-actor" for r in runs
            }
            if "end-round" in names.values() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    edges: dict[str, set[tuple[str, str]]] = {}
    for r in runs:
        for param, inputs in r.task_inputs.items():
            for upstream in inputs:
                if isinstance(upstream, TaskRunResult) and upstream.id in names:
                    edges.setdefault(param, set()).add((names[r.id], names[upstream.id]))
    return {key: edges.get(key, set()) for key in ("update", "detection", "decision", "weights_key", "summaries")}


# -- resume after a failure ------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_after_injected_failure(prefect_api, tmp_path, inject_faults):
    from prefect.client.schemas.objects import StateType

    home, uri, run_id = tmp_path / "home", f"sqlite:///{tmp_path}/mlflow.db", "pipeline-resume"
    overrides = _overrides(home, uri)
    inject_faults(fail_at=1)

    with pytest.raises(RuntimeError, match="injected failure in round 1"):
        _train(overrides, run_id)
    failed = _all_runs(uri)
    assert len(failed) == 1 and failed[0].info.status == "FAILED"

    result = _train(overrides, run_id)  # same run id: resumes after round 0
    assert result.rounds_done == ROUNDS and result.stop_reason == "round_limit"

    # round 0 ran once; round 1 twice (failed, then completed)
    round0 = asyncio.run(_flow_runs_named(f"{run_id}-round-0"))
    assert len(round0) == 1 and round0[0].state.type == StateType.COMPLETED
    round1 = asyncio.run(_flow_runs_named(f"{run_id}-round-1"))
    assert sorted(r.state.type.value for r in round1) == ["COMPLETED", "FAILED"]

    # MLflow: still one run, re-attached, one value per step
    runs = _all_runs(uri)
    assert [r.info.run_id for r in runs] == [result.mlflow_run_id] == [failed[0].info.run_id]
    assert runs[0].info.status == "FINISHED"
    client = MlflowClient(tracking_uri=uri)
    _check_one_value_per_round(client, result.mlflow_run_id, ROUNDS)

    # spend is not double counted: the ledger total is the sum of the per-round spends
    per_round = [m.value for m in client.get_metric_history(result.mlflow_run_id, "spend_round_usd")]
    assert len(per_round) == ROUNDS
    assert math.isclose(result.spend_usd, sum(per_round), rel_tol=1e-9, abs_tol=1e-12)
    total = client.get_metric_history(result.mlflow_run_id, "spend_total_usd")
    assert math.isclose(max(total, key=lambda m: m.step).value, result.spend_usd, rel_tol=1e-9, abs_tol=1e-12)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "field"),
    [("env_id=NoSuchEnv-v0", "env_id"), ("scaler.i_min=32", "scaler"), ("rounds=many", "rounds")],
)
def test_bad_config_is_one_line_naming_the_field(override, field):
    extra = ["scaler.i_max=8"] if override.startswith("scaler.i_min") else []
    with pytest.raises(ConfigError) as info:
        NitroConfig.load(overrides=[override, *extra])
    message = str(info.value)
    assert "\n" not in message and field in message
    if "i_min" in override:
        assert "i_min" in message and "i_max" in message


@pytest.mark.slow
def test_bad_config_through_the_flow_fails_before_any_round(prefect_api, tmp_path):
    home = tmp_path / "home"
    with pytest.raises(ConfigError, match="env_id"):
        _train([*_overrides(home, f"sqlite:///{tmp_path}/mlflow.db"), "env_id=NoSuchEnv-v0"], "pipeline-bad")
    assert not (home / "runs").exists()


def test_cli_bad_config_exits_2(capsys):
    from cli.main import main

    assert main(["train", "scaler.i_min=32", "scaler.i_max=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nitro: error:") and "i_min" in err and len(err.splitlines()) == 1


def test_resume_unknown_run_exits_2(tmp_path, capsys):
    from cli.main import main

    assert main(["resume", "unknown-run", "--home", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown run id 'unknown-run'" in err and len(err.splitlines()) == 1


# -- a run opened before its flow (`nitro train` opens it while its Prefect API starts) ------------


def test_the_flow_trains_in_the_run_opened_before_it_and_leaves_it_open(prefect_api, tmp_path, redis_url):
    from nitro.run.runtime import get_run, open_run, prepared_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = [*_overrides(tmp_path / "home", uri, redis_url), "rounds=1", "detector.enabled=false"]
    config = NitroConfig.from_yaml(None, overrides)
    with prepared_run(config, "early") as ctx:
        assert ctx.store is not None and get_run("early") is ctx
        with pytest.raises(RuntimeError, match="another config"), open_run(config.model_copy(update={"seed": 7}),
                                                                             "early"):
            pass
        result = _train(overrides, "early")
        assert result.rounds_done == 1 and ctx.training.next_round == 1  # trained in this context
        assert ctx.tracker is ctx.store  # MLflow attached through the store opened before the flow
        ctx.lease.check()  # still held: the flow left closing the run to its opener
        assert get_run("early") is ctx
    with pytest.raises(RuntimeError, match="not open"):
        get_run("early")


def test_the_round_table_shows_the_newest_rounds_of_a_long_run(prefect_api):
    """A run of thousands of rounds: Prefect sends the whole table with each update, in an event of
    at most 1.5 MB, which ~4,700 rows outgrew (the update failed the run). The table keeps the newest."""
    import json
    from types import SimpleNamespace

    from prefect import flow, runtime
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks import bookkeeping

    history = [{**{column: 1234.56789 + k for column in bookkeeping.TABLE_COLUMNS}, "round": float(k),
                "eval_return_mean": math.nan} for k in range(6000)]  # ~330 bytes a row in the table
    ctx = SimpleNamespace(run_id="long-run", config=SimpleNamespace(rounds=10_000),
                          training=SimpleNamespace(history=history, next_round=6000))

    @flow
    def publish() -> str:
        bookkeeping._publish_live_state(ctx)
        return str(runtime.flow_run.id)

    publish()
    with get_client(sync_client=True) as client:
        (table,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["nitro-rounds-long-run"])), limit=1)
    rows = json.loads(table.data)
    assert len(rows) == bookkeeping.TABLE_ROWS and [r["round"] for r in rows] == list(range(5900, 6000))
    assert rows[-1]["eval_return_mean"] is None and "the newest 100 are shown" in table.description
