"""nitro.tracking.tracker against a real MLflow store (SQLite in tmp_path).

Creating a SQLite store runs MLflow's schema migrations (1-2 s). So, as fmind/mlops-python-package
does with its session-scoped MLflow fixtures, the migrated store is built once per module and each
test gets a private byte copy of it (milliseconds): real store, isolated tests, fast suite.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.config import NitroConfig
from nitro.tracking.metrics import HEADLINE_METRICS, ROUND_METRICS
from nitro.tracking.tracker import (
    HEADLINE_PREFIX,
    LOCAL_COST_MODEL,
    SENTINEL_METRIC,
    TAG_CHECKPOINT,
    TAG_FLOW_RUN_ID,
    TAG_RUN_ID,
    RunTracker,
    TrackingError,
    params_from_config,
)


@pytest.fixture()
def tracker(tracking_uri: str) -> RunTracker:
    return RunTracker(tracking_uri, "nitro-test")


def _metrics(k: int) -> dict[str, float]:
    m = {name: float(k) + i / 100 for i, name in enumerate(ROUND_METRICS)}
    m["ppo/kl"] = 0.01 * k
    m["ppo/clip_frac"] = 0.1
    return m


def _all_runs(client: MlflowClient) -> list:
    exp_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(exp_ids, run_view_type=ViewType.ALL, max_results=1000)


def test_missing_store_and_experiment_are_created(tmp_path: Path):
    db = tmp_path / "does" / "not" / "exist" / "mlflow.db"
    tracker = RunTracker(f"sqlite:///{db}", "brand-new")
    assert db.exists()
    exp = tracker.client.get_experiment_by_name("brand-new")
    assert exp is not None and exp.experiment_id == tracker.experiment_id
    # artifacts live next to the store, not in ./mlruns of whatever the cwd is
    assert exp.artifact_location.startswith((db.parent / "mlartifacts").as_uri())
    # a second tracker on the same store reuses the experiment
    assert RunTracker(f"sqlite:///{db}", "brand-new").experiment_id == tracker.experiment_id


def test_bare_db_path_and_file_store(tmp_path: Path, monkeypatch):
    from tests.support.templates import mlflow_db

    mlflow_db(tmp_path / "m.db")
    tracker = RunTracker(str(tmp_path / "m.db"), "e")
    assert tracker.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'm.db'}"
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(TrackingError, match="sqlite"):
        RunTracker(str(tmp_path / "mlruns"), "e")


def test_start_log_reattach_same_run(tracker: RunTracker, tracking_uri: str, monkeypatch):
    monkeypatch.setenv("PREFECT_UI_URL", "http://127.0.0.1:4200")
    cfg = NitroConfig(seed=3)
    rid = tracker.start_or_attach("flow-1", "nitro-run-a", cfg, {"team": "rl"})
    for k in range(3):
        assert tracker.log_round(rid, k, _metrics(k)) is True

    run = tracker.client.get_run(rid)
    tags = run.data.tags
    assert tags[TAG_RUN_ID] == "nitro-run-a" and tags[TAG_FLOW_RUN_ID] == "flow-1"
    assert tags["env"] == "Hopper-v5" and tags["algo"] == "ppo" and tags["scaler"] == "nitro"
    assert tags["seed"] == "3" and tags["backend"] == "local" and tags["team"] == "rl"
    assert tags["nitro.cost_model"] == LOCAL_COST_MODEL
    assert tags["prefect.flow_run_url"] == "http://127.0.0.1:4200/runs/flow-run/flow-1"
    assert run.info.run_name == "nitro-run-a"
    monkeypatch.setenv("MLFLOW_UI_URL", "http://mlflow.local:5000/")
    assert tracker.run_url(rid) == (f"http://mlflow.local:5000/#/experiments/{tracker.experiment_id}/runs/{rid}"
                                    "?workflowType=machine_learning")

    # A resumed run: new process (new tracker), same Prefect flow run (retry) -> same MLflow run
    again = RunTracker(tracking_uri, "nitro-test")
    assert again.start_or_attach("flow-1", "nitro-run-a", cfg, {}) == rid
    assert again.logged_rounds(rid) == {0, 1, 2}
    # `nitro resume` from the CLI: a new flow run id, still the same MLflow run
    assert again.start_or_attach("flow-2", "nitro-run-a", cfg, {}) == rid
    tags = again.client.get_run(rid).data.tags
    assert tags[TAG_FLOW_RUN_ID] == "flow-2" and tags["prefect.flow_run_ids"] == "flow-1,flow-2"
    # found by the nitro id alone (no flow-run id at hand, e.g. `nitro resume`)
    assert again.find_run("nitro-run-a") == rid

    # A different training run gets its own MLflow run
    other = again.start_or_attach("flow-3", "nitro-run-b", cfg, {})
    assert other != rid
    assert len(again.client.search_runs([again.experiment_id])) == 2


def test_relogging_a_round_does_not_duplicate(tracker: RunTracker, tracking_uri: str):
    cfg = NitroConfig()
    rid = tracker.start_or_attach(None, "nitro-run-dup", cfg, {})
    for k in range(4):
        tracker.log_round(rid, k, _metrics(k))
    # same tracker re-logs rounds 2 and 3 (e.g. a retried task)
    assert tracker.log_round(rid, 2, _metrics(2)) is False
    # a resumed process re-logs round 3 and continues with 4
    resumed = RunTracker(tracking_uri, "nitro-test")
    assert resumed.start_or_attach(None, "nitro-run-dup", cfg, {}) == rid
    assert resumed.log_round(rid, 3, _metrics(3)) is False
    assert resumed.log_round(rid, 4, _metrics(4)) is True
    # a process that only logs (never attached) loads the logged steps from the store
    logger_only = RunTracker(tracking_uri, "nitro-test")
    assert logger_only.log_round(rid, 1, _metrics(1)) is False

    client = MlflowClient(tracking_uri)
    for key in (*ROUND_METRICS, "ppo/kl", SENTINEL_METRIC):
        hist = client.get_metric_history(rid, key)
        assert sorted(m.step for m in hist) == [0, 1, 2, 3, 4], key
    assert client.get_run(rid).data.metrics["eval_return_mean"] == pytest.approx(4.0)


def test_log_round_is_one_batch(tracker: RunTracker, monkeypatch):
    rid = tracker.start_or_attach(None, "nitro-run-batch", NitroConfig(), {})
    calls = []
    real = tracker.client.log_batch
    monkeypatch.setattr(tracker.client, "log_batch", lambda *a, **k: (calls.append(k), real(*a, **k)))
    monkeypatch.setattr(tracker.client, "log_metric", lambda *a, **k: pytest.fail("log_metric used"))
    m = _metrics(0)
    m["boost_score"] = float("nan")
    m["ignored"] = None
    tracker.log_round(rid, 0, m)
    # one batch: the metrics, their headline copies and the sentinel
    assert set(HEADLINE_METRICS) <= set(ROUND_METRICS)
    assert len(calls) == 1 and len(calls[0]["metrics"]) == len(_metrics(0)) + len(HEADLINE_METRICS) + 1
    assert all(x.step == 0 for x in calls[0]["metrics"])
    assert math.isnan(tracker.client.get_run(rid).data.metrics["boost_score"])
    with pytest.raises(ValueError, match="not a number"):
        tracker.log_round(rid, 1, {"eval_return_mean": "high"})


def test_no_stray_runs_from_threads(tracker: RunTracker, tracking_uri: str):
    """8 threads log rounds for 2 training runs; only those 2 MLflow runs exist afterwards."""
    cfg = NitroConfig()
    rids = [tracker.start_or_attach(None, f"nitro-thread-{i}", cfg, {}) for i in range(2)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            barrier.wait()
            # also re-attach from the worker thread, as a Prefect task would
            rid = tracker.start_or_attach(None, f"nitro-thread-{t % 2}", cfg, {})
            assert rid == rids[t % 2]
            assert mlflow.active_run() is None
            for k in range(t // 2, 12, 4):  # 4 threads per run, disjoint rounds 0..11
                tracker.log_round(rid, k, _metrics(k))
                tracker.log_round(rid, k, _metrics(k))  # duplicate: skipped
            assert mlflow.active_run() is None
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert mlflow.active_run() is None

    client = MlflowClient(tracking_uri)
    runs = _all_runs(client)
    assert sorted(r.info.run_id for r in runs) == sorted(rids), "stray MLflow runs appeared"
    for rid in rids:
        for key in ("eval_return_mean", "spend_total_usd", SENTINEL_METRIC):
            assert sorted(m.step for m in client.get_metric_history(rid, key)) == list(range(12))


def test_params_contain_whole_config(tracker: RunTracker):
    cfg = NitroConfig.load({"seed": 7, "scaler": {"name": "fixed", "fixed_actors": 12}, "ppo": {"lr": 3e-4}})
    rid = tracker.start_or_attach(None, "nitro-run-params", cfg, {})
    run = tracker.client.get_run(rid)
    flat = cfg.to_flat_dict()
    assert set(run.data.params) == set(flat)  # every config key, none missing
    for key, value in flat.items():
        assert run.data.params[key] == str(value), key
    assert run.data.params["scaler.name"] == "fixed" and run.data.params["backend.lambda.region"] == "us-east-1"
    yaml_text = tracker.client.download_artifacts(rid, "config/config.yaml")
    assert NitroConfig.from_yaml(yaml_text) == cfg


def test_param_limits_are_handled(tracker: RunTracker, monkeypatch):
    cfg = NitroConfig()
    long = "x" * 7000
    flat = {**cfg.to_flat_dict(), "weird key*with$chars": 1, "long.value": long, "a.list": [1, 2]}
    monkeypatch.setattr(NitroConfig, "to_flat_dict", lambda self: flat)
    params = params_from_config(cfg)
    assert len(params["long.value"]) == 6000 and "weird key_with_chars" in params
    assert params["a.list"] == "[1, 2]"
    rid = tracker.start_or_attach(None, "nitro-run-limits", cfg, {})
    logged = tracker.client.get_run(rid).data.params
    assert len(logged) == len(flat) and len(logged["long.value"]) == 6000


def _policy_payload(env_id: str = "Hopper-v5") -> tuple[bytes, object]:
    """A real (untrained) policy as ``Trainer.policy_payload`` publishes it, and the module."""
    from nitro.envs import env_spec
    from nitro.models import Architecture
    from nitro.models.networks import build_policy
    from nitro.serialization import dumps_tensors

    policy = build_policy(env_spec(env_id), seed=0)
    meta = {"format": "nitro.policy/1", "env_id": env_id, "version": 5, "arch": Architecture().to_meta()}
    return dumps_tensors({k: v.numpy() for k, v in policy.state_dict().items()}, meta), policy


def test_final_artifacts_and_end(tracker: RunTracker, tmp_path: Path):
    rid = tracker.start_or_attach(None, "nitro-run-final", NitroConfig(), {})
    rows = []
    for k in range(5):
        m = _metrics(k)
        tracker.log_round(rid, k, m)
        rows.append({"round": k, **m})
    ckpt = tmp_path / "ckpts" / "nitro-run-final"
    payload, _ = _policy_payload()
    written = tracker.log_final(rid, payload, ckpt, rows)
    assert set(written) == {"policy", "checkpoint", "plot_return", "plot_actors", "plot_spend"}

    client = tracker.client
    run = client.get_run(rid)
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_CHECKPOINT] == str(ckpt.resolve())
    # plots at the artifact root: MLflow's Compare page lists root files only
    top = {f.path for f in client.list_artifacts(rid)}
    assert {"return.png", "actors.png", "spend.png", "checkpoint", "config"} <= top
    local = Path(client.download_artifacts(rid, "", str(tmp_path / "dl")))
    pointer = (local / "checkpoint" / "POINTER.txt").read_text()
    assert str(ckpt.resolve()) in pointer and "nitro resume nitro-run-final" in pointer
    for name in ("return", "actors", "spend"):
        assert (local / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the policy is a LoggedModel of the run, at the last round's step
    [output] = run.outputs.model_outputs
    assert written["policy"] == f"models:/{output.model_id}" and output.step == 4
    model = client.get_logged_model(output.model_id)
    assert model.name == "policy" and str(model.status) == "READY" and model.source_run_id == rid

    # re-attaching a finished run (resume after the end) marks it running again, same id
    assert tracker.start_or_attach(None, "nitro-run-final", NitroConfig(), {}) == rid
    assert client.get_run(rid).info.status == "RUNNING"
    tracker.end_run(rid, "FAILED")
    assert client.get_run(rid).info.status == "FAILED"


def test_policy_model_predicts_actions_and_registers(tracker: RunTracker, tracking_uri: str):
    """The logged policy loads with mlflow.pyfunc.load_model (no pickle inside) and maps a batch of
    observations to the policy's deterministic actions; it can be registered."""
    import numpy as np

    rid = tracker.start_or_attach(None, "nitro-run-model", NitroConfig(), {})
    payload, policy = _policy_payload()
    model_id = tracker.log_policy_model(rid, payload, step=5)

    mlflow.set_tracking_uri(tracking_uri)  # models:/ URIs resolve in the global store; reset below
    try:
        loaded = mlflow.pyfunc.load_model(f"models:/{model_id}")
        obs = np.random.default_rng(0).normal(size=(7, 11))  # Hopper: 11 floats, as the env gives them
        actions = loaded.predict(obs)
        assert actions.shape == (7, 3) and actions.dtype == np.float32
        expected = np.stack([policy.act(o.astype(np.float32)) for o in obs])
        assert np.allclose(actions, expected, atol=1e-6)
        assert loaded.metadata.get_input_schema().inputs[0].shape == (-1, 11)
        with pytest.raises(mlflow.exceptions.MlflowException):
            loaded.predict(np.zeros((2, 5)))  # wrong observation shape: refused by the signature
        version = mlflow.register_model(f"models:/{model_id}", "nitro-hopper-policy")
        assert int(version.version) == 1
    finally:
        mlflow.set_tracking_uri(None)
    files = {p.name for p in Path(tracker.client.get_logged_model(model_id).artifact_location.removeprefix("file://")).rglob("*")}
    assert {"MLmodel", "policy.safetensors", "env_spec.json", "input_example.json"} <= files
    assert not any(name.endswith((".pkl", ".pickle")) or name == "python_model.pkl" for name in files)


def test_headline_group_and_carried_score(tracker: RunTracker, tracking_uri: str):
    """Headline/* copies exist for the headline metrics only; the score's copy carries the last
    evaluation over the rounds between evaluations, also across a resume (a new tracker)."""
    rid = tracker.start_or_attach(None, "nitro-run-headline", NitroConfig(), {})
    scores = [10.0, math.nan, math.nan, 30.0, math.nan]
    for k, score in enumerate(scores[:3]):
        tracker.log_round(rid, k, {**_metrics(k), "eval_return_mean": score})
    resumed = RunTracker(tracking_uri, "nitro-test")
    for k, score in enumerate(scores[3:], start=3):
        resumed.log_round(rid, k, {**_metrics(k), "eval_return_mean": score})
    client = tracker.client
    logged = set(client.get_run(rid).data.metrics)
    assert {k for k in logged if k.startswith(HEADLINE_PREFIX)} == {HEADLINE_PREFIX + m for m in HEADLINE_METRICS}
    carried = [m.value for m in sorted(client.get_metric_history(rid, HEADLINE_PREFIX + "eval_return_mean"),
                                       key=lambda m: m.step)]
    assert carried == [10.0, 10.0, 10.0, 30.0, 30.0]
    raw = [m.value for m in sorted(client.get_metric_history(rid, "eval_return_mean"), key=lambda m: m.step)]
    assert [v for v in raw if not math.isnan(v)] == [10.0, 30.0]  # the metric itself is untouched


def test_experiment_opens_as_model_training_with_headline_columns(tracker: RunTracker, monkeypatch):
    import json

    tags = tracker.client.get_experiment(tracker.experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(tags["mlflow.sharedViewState.nitro"])
    assert view["selectedColumns"][: len(HEADLINE_METRICS)] == [f"metrics.`Headline/{m}`" for m in HEADLINE_METRICS]
    monkeypatch.setenv("MLFLOW_UI_URL", "http://mlflow.local:5000")
    assert tracker.experiment_url() == (f"http://mlflow.local:5000/#/experiments/{tracker.experiment_id}/runs"
                                        "?viewStateShareKey=nitro&workflowType=machine_learning")
    # a kind chosen by a user is kept
    tracker.client.set_experiment_tag(tracker.experiment_id, "mlflow.experimentKind", "genai_development")
    RunTracker(tracker.tracking_uri, "nitro-test")
    assert tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == "genai_development"


def test_run_is_named_after_the_flow_run_and_links_back(tracker: RunTracker):
    url = "http://prefect.local:4200/runs/flow-run/f-1"
    rid = tracker.start_or_attach("f-1", "nitro-run-named", NitroConfig(), {}, flow_run_name="glossy-panda",
                                  flow_run_url=url)
    run = tracker.client.get_run(rid)
    assert run.info.run_name == "glossy-panda"
    assert run.data.tags["prefect.flow_run_name"] == "glossy-panda" and run.data.tags["prefect.flow_run_url"] == url
    assert f"[glossy-panda]({url})" in run.data.tags["mlflow.note.content"]
    # `nitro resume` from a new flow run: same MLflow run (same name), the link follows the new flow run
    url2 = "http://prefect.local:4200/runs/flow-run/f-2"
    assert tracker.start_or_attach("f-2", "nitro-run-named", NitroConfig(), {}, flow_run_name="brave-otter",
                                   flow_run_url=url2) == rid
    run = tracker.client.get_run(rid)
    assert run.info.run_name == "glossy-panda"
    assert f"[brave-otter]({url2})" in run.data.tags["mlflow.note.content"]


def test_final_rebuilds_rows_from_store(tracker: RunTracker):
    rid = tracker.start_or_attach(None, "nitro-run-rows", NitroConfig(), {})
    for k in range(3):
        tracker.log_round(rid, k, _metrics(k))
    rows = tracker.round_rows(rid, ["eval_return_mean", "spend_total_usd"])
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[2]["eval_return_mean"] == pytest.approx(2.0)
    written = tracker.log_final(rid, None, "s3://bucket/ckpt/nitro-run-rows", None, status="KILLED")
    assert "policy" not in written and "plot_return" in written
    run = tracker.client.get_run(rid)
    assert run.info.status == "KILLED" and run.data.tags[TAG_CHECKPOINT] == "s3://bucket/ckpt/nitro-run-rows"


def test_ui_and_value_helpers():
    """The pure pieces around the tracker: re-attach tags, experiment tags, filter quoting, keys."""
    from nitro.tracking.ui import FlowRun, experiment_tags, reattach_prefect_tags
    from nitro.tracking.values import MAX_KEY, clean_key, filter_value

    flow = FlowRun("f-1", "glossy-panda", "http://prefect.local/runs/flow-run/f-1")
    known = {"prefect.flow_run_id": "f-1", "prefect.flow_run_url": flow.url, "prefect.flow_run_ids": "f-0,f-1"}
    assert reattach_prefect_tags(known, flow, "r") == {}  # same flow run: nothing to write
    assert reattach_prefect_tags(known, FlowRun(None), "r") == {}  # outside Prefect: the tags stay
    moved = reattach_prefect_tags(known, FlowRun("f-2"), "r")
    assert moved["prefect.flow_run_id"] == "f-2" and moved["prefect.flow_run_ids"] == "f-0,f-1,f-2"
    assert "`f-2`" in moved["mlflow.note.content"]
    assert (
        reattach_prefect_tags(known, FlowRun("f-1", url="http://elsewhere/f-1"), "r")["prefect.flow_run_ids"]
        == "f-0,f-1"
    )

    fresh = experiment_tags({}, ["Headline/x"])
    assert fresh["mlflow.experimentKind"] == "custom_model_development"
    assert experiment_tags(fresh, ["Headline/x"]) == {}  # already there: nothing to write
    assert set(experiment_tags(fresh, ["Headline/y"])) == {"mlflow.sharedViewState.nitro"}

    assert filter_value("it's a\\b") == "'it\\'s a\\\\b'"
    assert clean_key("//a//b*c/") == "a/b_c" and len(clean_key("k" * 400)) == MAX_KEY
