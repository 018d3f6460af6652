"""nitro.tracking.compare (and the multi-run plots of nitro.tracking.plots) against a real MLflow SQLite store.

The migrated store is built once per module and copied per test (see test_tracking.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from nitro.config import NitroConfig
from nitro.tracking.compare import compare_runs, format_table
from nitro.tracking.plots import mean_ci95, plot_group_bars, plot_group_curves, write_run_plots
from nitro.tracking.tracker import RunTracker, TrackingError


def _train(tracker: RunTracker, name: str, cfg: NitroConfig, rounds: int, finish: bool = True) -> str:
    rid = tracker.start_or_attach(f"flow-{name}", name, cfg, {})
    spend = 0.0
    for k in range(rounds):
        spend += 0.5 + cfg.seed
        tracker.log_round(
            rid,
            k,
            {
                "eval_return_mean": 10.0 * k + cfg.seed,
                "train_return_max": 20.0 * k,
                "spend_round_usd": 0.5 + cfg.seed,
                "spend_total_usd": spend,
                "actors_launched": 8,
            },
        )
    if finish:
        tracker.end_run(rid)
    return rid


@pytest.fixture()
def study(tracking_uri: str) -> dict[str, str]:
    """Experiment "study": Hopper, scalers nitro/fixed x seeds 0/1; experiment "other": one Walker2d run
    still running; plus one non-Nitro run that compare must ignore."""
    ids = {}
    t = RunTracker(tracking_uri, "study")
    for scaler in ("nitro", "fixed"):
        for seed in (1, 0):
            cfg = NitroConfig.load({"seed": seed, "rounds": 5, "scaler": {"name": scaler}})
            ids[f"{scaler}-{seed}"] = _train(t, f"hopper-{scaler}-s{seed}", cfg, rounds=3 + seed)
    o = RunTracker(tracking_uri, "other")
    ids["walker"] = _train(o, "walker-run", NitroConfig(env_id="Walker2d-v5"), rounds=2, finish=False)
    o.client.create_run(o.experiment_id, run_name="not-nitro")  # e.g. an experiment's parent run
    return ids


def test_table_of_one_experiment(tracking_uri: str, study):
    rows = compare_runs(tracking_uri, "study", {})
    assert [(r["scaler"], r["seed"]) for r in rows] == [("fixed", "0"), ("fixed", "1"), ("nitro", "0"), ("nitro", "1")]
    r = rows[1]  # fixed, seed 1: 4 rounds, last return 31, spend 4 * 1.5
    assert r["env"] == "Hopper-v5" and r["algo"] == "ppo" and r["status"] == "FINISHED"
    assert r["rounds_done"] == 4 and r["rounds_limit"] == 5
    assert r["final_return"] == pytest.approx(31.0) and r["total_spend_usd"] == pytest.approx(6.0)
    assert r["run_name"] == "hopper-fixed-s1" and r["mlflow_run_id"] == study["fixed-1"]
    assert r["experiment"] == "study"

    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["run", "env", "algo", "scaler", "seed", "rounds"]
    assert len(lines) == 2 + 4
    assert "hopper-fixed-s1" in lines[3] and "31.00" in lines[3] and "6.0000" in lines[3]
    md = format_table(rows, markdown=True)
    assert md.splitlines()[0].startswith("| run | env |") and md.count("\n") == 5


def test_filters(tracking_uri: str, study):
    everything = compare_runs(tracking_uri, None, {})
    assert {r["run_name"] for r in everything} == {
        "hopper-nitro-s0", "hopper-nitro-s1", "hopper-fixed-s0", "hopper-fixed-s1", "walker-run"
    }  # the non-Nitro run is not listed
    walker = next(r for r in everything if r["env"] == "Walker2d-v5")
    assert walker["status"] == "RUNNING" and walker["rounds_done"] == 2

    fixed = compare_runs(tracking_uri, "study", {"scaler": "fixed"})
    assert {r["run_name"] for r in fixed} == {"hopper-fixed-s0", "hopper-fixed-s1"}
    one = compare_runs(tracking_uri, None, {"scaler": "nitro", "seed": "1"})
    assert [r["mlflow_run_id"] for r in one] == [study["nitro-1"]]
    by_param = compare_runs(tracking_uri, None, {"params.env_id": "Walker2d-v5"})
    assert [r["run_name"] for r in by_param] == ["walker-run"]
    assert compare_runs(tracking_uri, "study", {"scaler": "kungfu"}) == []
    assert format_table([]) == "no runs found"
    finished = compare_runs(tracking_uri, None, {}, include_unfinished=False)
    assert "walker-run" not in {r["run_name"] for r in finished}


def test_errors(tracking_uri: str, study, tmp_path: Path):
    with pytest.raises(TrackingError, match=r"unknown MLflow experiment 'nope'.*study"):
        compare_runs(tracking_uri, "nope", {})
    with pytest.raises(TrackingError, match="no MLflow store"):
        compare_runs(f"sqlite:///{tmp_path / 'missing' / 'm.db'}", None, {})


def test_params_line_up_for_the_ui_compare_view(tracking_uri: str, study):
    client = MlflowClient(tracking_uri)
    runs = [client.get_run(study[k]) for k in ("nitro-0", "fixed-1")]
    assert set(runs[0].data.params) == set(runs[1].data.params)  # same columns in the compare view
    assert set(runs[0].data.metrics) == set(runs[1].data.metrics)
    assert runs[0].data.params["scaler.name"] == "nitro" and runs[1].data.params["scaler.name"] == "fixed"


def test_group_plots_and_ci(tmp_path: Path):
    m, h = mean_ci95([1.0, 2.0, 3.0])
    assert m == pytest.approx(2.0) and h == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-3)
    assert mean_ci95([5.0])[0] == 5.0
    runs = {
        scaler: [
            [
                {
                    "round": k,
                    "eval_return_mean": k * (s + 1.0),
                    "spend_total_usd": 0.3 * (k + 1) * (s + 1),
                    "actors_launched": 8,
                }
                for k in range(6)
            ]
            for s in range(3)
        ]
        for scaler in ("nitro", "fixed")
    }
    for path in (
        plot_group_curves(runs, tmp_path / "ret_round.png"),
        plot_group_curves(runs, tmp_path / "ret_spend.png", x_key="spend_total_usd", xlabel="cumulative spend (USD)"),
        plot_group_curves(runs, tmp_path / "actors.png", y_key="actors_launched"),
        plot_group_bars({"nitro": [1, 2, 3], "fixed": [2, 2.5]}, tmp_path / "final.png", ylabel="final return"),
        *write_run_plots([{"round": 0, "eval_return_mean": float("nan")}], tmp_path / "sparse").values(),
    ):
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_minionsrl_row_shows_its_pretraining_beside_its_own_spend(tracking_uri: str, study):
    """The pre-training record rides in the run's tags; the table adds its columns after the spend,
    "-" on rows without a pre-trained scheduler."""
    t = RunTracker(tracking_uri, "study")
    cfg = NitroConfig.load({"seed": 0, "rounds": 5, "scaler": {"name": "minionsrl", "minionsrl": {"path": "s.st"}}})
    record = {"minionsrl.pretrain_usd": "0.123456", "minionsrl.pretrain_episodes": "100",
              "minionsrl.pretrain_env_steps": "1638400", "minionsrl.pretrain_on": "nitro.scaling.minionsrl.simulator"}
    rid = t.start_or_attach("flow-m", "hopper-minionsrl-s0", cfg, record)
    t.log_round(rid, 0, {"eval_return_mean": 5.0, "spend_total_usd": 0.25, "env_steps_total": 2048.0})
    t.end_run(rid)

    rows = {r["run_name"]: r for r in compare_runs(tracking_uri, "study")}
    m = rows["hopper-minionsrl-s0"]
    assert (m["pretrain_episodes"], m["pretrain_env_steps"], m["pretrain_usd"]) == (
        100,
        1638400,
        pytest.approx(0.123456),
    )
    assert rows["hopper-fixed-s0"]["pretrain_usd"] is None

    lines = format_table(list(rows.values())).splitlines()
    header = lines[0]
    assert header.index("spend USD") < header.index("env steps") < header.index("pretrain episodes") \
        < header.index("pretrain env steps") < header.index("pretrain USD (projected)") < header.index("status")
    line = next(ln for ln in lines if ln.startswith("hopper-minionsrl-s0"))
    assert line.split()[7:12] == ["0.2500", "2048", "100", "1638400", "0.1235"]
    fixed = next(ln for ln in lines if ln.startswith("hopper-fixed-s0"))
    assert fixed.split()[9:12] == ["-", "-", "-"]
    md = format_table(list(rows.values()), markdown=True)
    assert "| pretrain USD (projected) |" in md.splitlines()[0]
    # without a pre-trained scheduler in the rows, the table keeps its usual columns
    assert "pretrain" not in format_table([r for r in rows.values() if r["pretrain_usd"] is None])


def test_attaching_to_a_run_created_elsewhere_adds_the_tags_it_lacks(tracking_uri: str):
    """An experiment creates its cells' MLflow runs with the ledger's tags; the training run's own
    attach then adds what only it knows (its scheduler's pre-training) and changes nothing set."""
    t = RunTracker(tracking_uri, "study")
    cfg = NitroConfig.load({"seed": 0, "rounds": 2})
    rid = t.start_or_attach(None, "cell-run", cfg, {"cost.learner_clock": "lambda", "nitro.cell": "a/b"})
    again = t.start_or_attach("flow-2", "cell-run", cfg, {"cost.learner_clock": "measured",
                                                         "minionsrl.pretrain_usd": "0.5"})
    tags = MlflowClient(tracking_uri).get_run(rid).data.tags
    assert again == rid and tags["minionsrl.pretrain_usd"] == "0.5"
    assert tags["cost.learner_clock"] == "lambda" and tags["nitro.cell"] == "a/b"
