"""Experiments (issue 7): spec validation, matrix expansion, deterministic cell ids, and a tiny real
experiment through the Prefect flow (real Prefect test API, real Redis, real MLflow SQLite store):
one parent MLflow run with the cells nested under it, the report files, `nitro compare` printing
the report's numbers, and a re-run that skips the finished cells."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import yaml
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.experiments import (
    Cell,
    ExperimentError,
    cell_config,
    cell_run_id,
    cell_state,
    expand_cells,
    load_spec,
    sensitivity_cells,
)
from nitro.experiments.rounds import read_rounds, write_rounds

pytestmark = pytest.mark.timeout(300)


def _spec(**over) -> dict:
    spec = {
        "name": "unit",
        "base": {"env_id": "Hopper-v5", "steps_per_actor": 64},
        "matrix": {"env": ["Hopper-v5"], "scaler": ["fixed", "random", "nitro"], "seed": [0, 1]},
        "compare": "rounds",
        "rounds": 3,
    }
    spec.update(over)
    return spec


# -- spec validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"compare": "budget"}, "budget_usd"),
        ({"compare": "rounds", "rounds": None}, "rounds needs rounds"),
        ({"budget_usd": 1.0}, "takes no budget_usd"),
        ({"compare": "cost"}, "compare"),
        ({"name": "bad name!"}, "name"),
        ({"matrix": {"env": ["Hopper-v5"], "scaler": ["warp"], "seed": [0]}}, "matrix.scaler"),
        ({"matrix": {"env": ["Hopper-v5"], "scaler": ["nitro"], "seed": [0, 0]}}, "duplicate"),
        ({"matrix": {"env": ["NoSuchEnv-v0"], "scaler": ["nitro"], "seed": [0]}}, "env_id"),
        ({"base": {"ppo": {"lr": -1}}}, "ppo.lr"),
        ({"base": {"rounds": 5}}, "base.rounds"),
        ({"overrides": ["scaler.i_min=99"]}, "i_min"),
        ({"sensitivity": {"sweep": {"ppo.lr": [1e-4]}}}, "cannot sweep"),
        ({"sensitivity": {"sweep": {"scaler.decay": [1.5]}}}, "scaler.decay"),
        ({"extra_key": 1}, "extra_key"),
        ({"thresholds": {"Walker2d-v5": 300.0}}, "thresholds: Walker2d-v5 not in matrix.env"),
        ({"best_of": ["fixed", "fixed-8"]}, "best_of: fixed-8 not in matrix.scaler"),
        ({"best_of": ["fixed"]}, "best_of: give two or more distinct matrix entries"),
        ({"best_of": ["fixed", "fixed"]}, "best_of: give two or more distinct matrix entries"),
    ],
)
def test_bad_spec_is_one_clear_line(change, needle):
    with pytest.raises(ExperimentError) as info:
        load_spec(_spec(**change))
    msg = str(info.value)
    assert "\n" not in msg and needle in msg, msg


def test_spec_file_errors(tmp_path):
    with pytest.raises(ExperimentError, match="not found"):
        load_spec(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ExperimentError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ExperimentError, match="mapping"):
        load_spec(tmp_path / "list.yaml")


def test_example_study_spec_is_valid():
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "study_hopper.yaml")
    assert spec.compare == "budget" and set(spec.matrix.scaler) == {"nitro", "fixed", "always", "random", "hydrozoa"}
    assert len(spec.matrix.seed) >= 3 and spec.matrix.env == ["Hopper-v5"] and spec.matrix.algo == ["ppo"]
    configs = [cell_config(spec, c) for c in expand_cells(spec)]
    assert {c.budget_usd for c in configs} == {spec.budget_usd}
    assert len(expand_cells(spec, sensitivity=True)) > len(configs)


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "examples")
                                         .glob("study_*.yaml")))
def test_every_example_study_builds_its_cells_configs(name):
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / name)
    assert all(cell_config(spec, c).seed == c.seed for c in expand_cells(spec))


def test_the_priced_alike_study_bills_both_learners_as_one_instance():
    """Stellaris's parameter server and the sync learner at the same hourly price: the money buys
    each the same machine (issue 47's equal-money comparison)."""
    from nitro.pricing.cost import ledger_from_config

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "study_stellaris_priced.yaml")
    configs = {c.scaler: cell_config(spec, c) for c in expand_cells(spec)}
    assert [configs[s].learner.mode for s in ("stellaris", "sync-80", "sync")] == ["stellaris", "sync", "sync"]
    assert {ledger_from_config(cfg).prices.learner_per_hour for cfg in configs.values()} == {0.085}
    assert set(spec.thresholds) == set(spec.matrix.env)


# -- matrix expansion and cell ids -----------------------------------------------------------------


def test_matrix_expansion_order_and_ids():
    spec = load_spec(_spec())
    cells = expand_cells(spec)
    assert len(cells) == 6
    # per seed, nitro runs first (random needs its measured mean actors), random after it
    assert [c.scaler for c in cells] == ["nitro", "fixed", "random"] * 2
    assert [c.seed for c in cells] == [0, 0, 0, 1, 1, 1]
    ids = [cell_run_id(spec.name, c) for c in cells]
    assert len(set(ids)) == 6
    assert ids == [cell_run_id("unit", c) for c in expand_cells(load_spec(_spec()))]  # deterministic
    assert all(i.startswith("unit-hopper-v5-ppo-") and i.replace("-", "").isalnum() and i == i.lower() for i in ids)
    assert cell_run_id("other", cells[0]) != ids[0]  # the experiment name is part of the id
    assert ids[0] == cell_run_id("unit", Cell("Hopper-v5", "ppo", "nitro", 0))


def test_cell_config_compare_modes():
    spec = load_spec(_spec())
    cfg = cell_config(spec, Cell("Hopper-v5", "ppo", "random", 1), random_mean_actors=12.5)
    assert (cfg.rounds, cfg.budget_usd, cfg.seed, cfg.scaler.name) == (3, None, 1, "random")
    assert cfg.scaler.random_mean_actors == 12.5 and cfg.tracking.experiment == "unit"
    spec = load_spec(_spec(compare="budget", rounds=None, budget_usd=0.05, max_rounds=40))
    cfg = cell_config(spec, Cell("Hopper-v5", "ppo", "nitro", 0))
    assert (cfg.rounds, cfg.budget_usd) == (40, 0.05)


def test_a_cell_whose_saved_config_differs_is_named_with_the_field(tmp_path):
    from nitro.config import NitroConfig
    from nitro.experiments import saved_config_mismatch
    from nitro.run.rundir import RunDir

    config = NitroConfig.load({"home": str(tmp_path), "rounds": 3})
    assert saved_config_mismatch(config, "cell") is None  # nothing saved yet
    RunDir(tmp_path, "cell").save_config(config.dump_yaml())
    assert saved_config_mismatch(config, "cell") is None  # its own dump, `resolved: true` and all
    edited = NitroConfig.load({"home": str(tmp_path), "rounds": 3, "ppo": {"lr": 1e-3}})
    assert "different config (ppo.lr)" in saved_config_mismatch(edited, "cell")


def test_cell_configs_do_not_leak_into_each_other():
    spec = load_spec(_spec(base={"env_id": "Hopper-v5", "scaler": {"i_max": 32}}))
    before = json.dumps(spec.base, sort_keys=True)
    cell_config(spec, Cell("Hopper-v5", "ppo", "random", 0), random_mean_actors=20.0)
    cfg = cell_config(spec, Cell("Hopper-v5", "ppo", "nitro", 1))
    assert cfg.scaler.random_mean_actors is None and cfg.scaler.i_max == 32
    assert json.dumps(spec.base, sort_keys=True) == before


SHUFFLED = {"shuffled": {"scaler": "replay", "replays": "goodput", "description": "goodput's counts, shuffled"}}


def test_a_replay_cell_runs_after_the_cell_it_replays_and_takes_its_counts():
    from nitro.experiments import CarriedRun, replay_counts, replay_partner
    from nitro.experiments.carry import training_config

    spec = load_spec(_spec(matrix={"env": ["Hopper-v5"], "scaler": ["shuffled", "fixed", "goodput"], "seed": [0]},
                           baselines=SHUFFLED))
    cells = expand_cells(spec)
    assert [c.scaler for c in cells] == ["fixed", "goodput", "shuffled"]  # the replay after what it replays
    assert replay_partner(spec, cells[2]) == cells[1] and replay_partner(spec, cells[1]) is None
    cfg = cell_config(spec, cells[2], replay_actors=[8, 16, 16])
    assert (cfg.scaler.name, cfg.scaler.replay_actors) == ("replay", [8, 16, 16])
    assert cell_config(spec, cells[1], replay_actors=[8]).scaler.replay_actors == []  # only a replay cell takes them
    # what a cell reads from its partner is not part of the config a carried cell is matched on
    assert training_config(cfg.model_dump(mode="json")) == training_config(
        cell_config(spec, cells[2]).model_dump(mode="json"))
    # the counts come from the partner once it has finished: here from the report (carried)
    history = [{"round": 1, "actors_launched": 16.0}, {"round": 0, "actors_launched": 8.0},
               {"round": 2, "actors_launched": 0.0}]  # a budget run's last round launches none
    counts, note = replay_counts(spec, cells[2], {cells[1].key: CarriedRun(row={}, history=history)})
    assert counts == [8, 16] and "replays the 2 actor counts of Hopper-v5/ppo/goodput/seed=0" in note
    missing, why = replay_counts(spec, cells[2], {})
    assert missing is None and "has not finished" in why and "--only scaler=goodput" in why


@pytest.mark.parametrize(("baselines", "needle"), [
    ({"shuffled": {"scaler": "replay"}}, "replays"),
    ({"shuffled": {"scaler": "replay", "replays": "nitro"}}, "must be a matrix entry"),
    ({"shuffled": {"scaler": "fixed", "replays": "goodput"}}, "go together"),
])
def test_a_replay_baseline_names_a_matrix_entry(baselines, needle):
    with pytest.raises(ExperimentError, match=needle):
        load_spec(_spec(matrix={"env": ["Hopper-v5"], "scaler": ["shuffled", "goodput"], "seed": [0]},
                        baselines=baselines))


def test_sensitivity_expansion_reuses_base_value_cells():
    spec = load_spec(_spec(base={"env_id": "Hopper-v5", "scaler": {"window": 6}},
                           sensitivity={"seeds": [0], "sweep": {"scaler.decay": [0.9, 0.96],
                                                                "detector.subset_size": [256]}}))
    main = expand_cells(spec)
    cells = expand_cells(spec, sensitivity=True)
    assert cells[: len(main)] == main
    extra = cells[len(main):]
    # decay 0.96 is the base value: the main nitro cell is reused, not run twice
    assert [c.key for c in extra] == ["Hopper-v5/ppo/nitro/seed=0/scaler.decay=0.9",
                                      "Hopper-v5/ppo/nitro/seed=0/detector.subset_size=256"]
    cfg = cell_config(spec, extra[0])
    assert cfg.scaler.decay == 0.9 and cfg.scaler.name == "nitro"
    groups = sensitivity_cells(spec, cells)
    assert [c.key for c in groups["scaler.decay"][0.96]] == ["Hopper-v5/ppo/nitro/seed=0"]
    assert set(groups["detector.subset_size"]) == {256, 1024}


def test_only_selects_cells_and_names_a_bad_field_or_value():
    from cli.experiment import parse_only
    from nitro.experiments import ExperimentError, expand_cells, load_spec, select_cells

    spec = load_spec(
        {
            "name": "s",
            "matrix": {"env": ["Hopper-v5", "Walker2d-v5"], "scaler": ["nitro", "fixed", "random"], "seed": [0, 1]},
            "compare": "rounds",
            "rounds": 2,
        }
    )
    cells = expand_cells(spec)
    picked = select_cells(cells, parse_only(["env=Walker2d-v5", "scaler=nitro,random", "seed=1"]))
    assert [c.key for c in picked] == ["Walker2d-v5/ppo/nitro/seed=1", "Walker2d-v5/ppo/random/seed=1"]
    assert select_cells(cells, {}) == cells
    with pytest.raises(ExperimentError, match="--only size: not a cell field"):
        select_cells(cells, {"size": ["1"]})
    with pytest.raises(ExperimentError, match="--only env: Ant-v5 not in the spec's cells"):
        select_cells(cells, {"env": ["Ant-v5"]})
    with pytest.raises(ExperimentError, match="expected FIELD=V1,V2"):
        parse_only(["env"])


def test_ratio_ci_by_hand():
    from nitro.experiments.stats import format_ratios, ratio_ci

    assert ratio_ci([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == {"ratio": 2.0, "lo": 2.0, "hi": 2.0}
    # one arm of {1, 1, 4}: its bootstrap means are 1, 2, 3 or 4 (8/27, 12/27, 6/27, 1/27), over a
    # fixed 2; 2.5% falls on 1/2 and 97.5% on 4/2 (1/27 = 3.7% of the draws)
    r = ratio_ci([1.0, 1.0, 4.0], [2.0, 2.0, 2.0])
    assert r["ratio"] == 1.0 and r["lo"] == 0.5 and r["hi"] == 2.0
    assert math.isnan(ratio_ci([], [1.0])["ratio"]) and math.isnan(ratio_ci([1.0], [float("nan")])["lo"])
    # two seeds give a ratio and no interval, and the table says why
    two = ratio_ci([1.0, 3.0], [2.0, 2.0, 2.0])
    assert two["ratio"] == 1.0 and math.isnan(two["lo"]) and math.isnan(two["hi"])
    table = format_ratios(
        [
            {
                "label": "nitro",
                "reference": "fixed",
                "n": 2,
                "n_reference": 3,
                "return": two,
                "spend": ratio_ci([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),
            }
        ]
    )
    assert (
        "| nitro | fixed | 2 / 3 | 1.00 (no CI: under 3 seeds) | - | 1.00 (1.00-1.00) |" in table
    )  # no late return: -


def test_rounds_file_round_trips_exactly_and_is_compressed_when_large(tmp_path, monkeypatch):
    from nitro.experiments import rounds as rounds_module

    cols = ["run_name", "label", "env", "algo", "seed", "round", "eval_return_mean", "hessian_R", "spend_round_usd"]
    rows = [{"run_name": "a", "label": "nitro", "env": "Hopper-v5", "algo": "ppo", "seed": 0, "round": k,
             "eval_return_mean": 1 / 3 + k, "hessian_R": float("nan") if k == 0 else 0.1 * k,
             "spend_round_usd": 1e-5 * (k + 1)}
            for k in range(3)]
    rows[1].pop("eval_return_mean")  # a round that did not evaluate logs no eval_return_mean
    rows.append({**rows[0], "run_name": "b", "round": 0})
    assert write_rounds(tmp_path, rows, cols).name == "rounds.csv"
    plain = read_rounds(tmp_path)
    assert list(plain) == ["a", "b"] and [h["round"] for h in plain["a"]] == [0, 1, 2]
    assert plain["a"][2]["eval_return_mean"] == 1 / 3 + 2 and plain["a"][0]["spend_round_usd"] == 1e-5  # exact
    assert "eval_return_mean" not in plain["a"][1] and math.isnan(plain["a"][0]["hessian_R"])
    assert set(plain["a"][0]) == {"round", "eval_return_mean", "hessian_R", "spend_round_usd"}

    monkeypatch.setattr(rounds_module, "GZIP_ABOVE_BYTES", 100)
    assert write_rounds(tmp_path, rows, cols).name == "rounds.csv.gz"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rounds.csv.gz"]  # the smaller report's file is gone
    packed = read_rounds(tmp_path)
    assert packed["a"][2] == plain["a"][2] and packed["b"][0]["round"] == 0
    with pytest.raises(FileNotFoundError):
        read_rounds(tmp_path / "none")


def test_late_return_by_hand():
    from nitro.experiments.stats import format_ratios, format_summary, late_return, ratios_against, summarize

    nan = float("nan")
    # rounds out of order, NaN between evaluations (rounds that did not evaluate) and a round with no value
    history = [{"round": 7, "eval_return_mean": 700.0}, {"round": 0, "eval_return_mean": 10.0},
               {"round": 1, "eval_return_mean": nan}, {"round": 2, "eval_return_mean": 100.0},
               {"round": 3}, {"round": 4, "eval_return_mean": 300.0}, {"round": 5, "eval_return_mean": 500.0},
               {"round": 6, "eval_return_mean": 600.0}, {"round": 8, "eval_return_mean": 2.0}]
    assert late_return(history) == (300 + 500 + 600 + 700 + 2) / 5  # rounds 4-8
    assert late_return(history, k=2) == 351.0
    assert late_return(history[:2], k=5) == 355.0  # fewer evaluations than k: all of them
    assert math.isnan(late_return([{"round": 0, "eval_return_mean": nan}, {"round": 1}]))

    rows = [{"env": "E", "algo": "ppo", "label": lab, "seed": i, "final_return": f, "late_return": lr,
             "total_spend_usd": 1.0, "rounds_done": 10, "env_steps_total": 100}
            for lab, vals in (("fixed", [(100.0, 200.0)] * 3), ("nitro", [(300.0, 100.0)] * 3))
            for i, (f, lr) in enumerate(vals)]
    summary = summarize(rows, ["nitro", "fixed"])
    assert [s["late_return_mean"] for s in summary] == [100.0, 200.0]
    (ratio,) = ratios_against(summary, "fixed")
    assert ratio["return"]["ratio"] == 3.0 and ratio["late_return"] == {"ratio": 0.5, "lo": 0.5, "hi": 0.5}
    assert "| nitro | fixed | 3 / 3 | 3.00 (3.00-3.00) | 0.50 (0.50-0.50) | 1.00 (1.00-1.00) |" in format_ratios(
        [ratio]
    )
    assert "last 5 evals' return" in format_summary(summary) and "| 100.00 ± 0.00 |" in format_summary(summary)
    # rows without the column (a compare row, not a report's) leave it empty, not zero
    bare = summarize([{k: v for k, v in r.items() if k != "late_return"} for r in rows])
    assert math.isnan(bare[0]["late_return_mean"]) and "| - |" in format_summary(bare)


def test_time_to_threshold_by_hand():
    from nitro.experiments.stats import threshold_table, time_to_threshold

    nan = float("nan")
    # billed seconds 1, 2, 4, 8, 16 in rounds 0-4 (given out of order); evaluations in rounds 0, 2 and 4
    history = [{"round": 4, "round_billed_s": 16.0, "eval_return_mean": 500.0},
               {"round": 0, "round_billed_s": 1.0, "eval_return_mean": 10.0},
               {"round": 1, "round_billed_s": 2.0, "eval_return_mean": nan},
               {"round": 2, "round_billed_s": 4.0, "eval_return_mean": 300.0}, {"round": 3, "round_billed_s": 8.0}]
    assert time_to_threshold(history, 300.0) == 7.0  # rounds 0-2: the evaluation's round included
    assert time_to_threshold(history, 301.0) == 31.0 and time_to_threshold(history, 10.0) == 1.0
    assert time_to_threshold(history, 501.0) == math.inf

    lines, records = threshold_table({"fixed": [10.0, 10.0, 10.0], "nitro": [5.0, 5.0, 5.0],
                                      "random": [5.0, math.inf, 15.0]}, 300.0, "fixed")
    by_label = {r["label"]: r for r in records}
    assert by_label["nitro"]["ratio"] == {"ratio": 0.5, "lo": pytest.approx(0.5), "hi": pytest.approx(0.5)}
    assert by_label["random"]["ratio"] is None and by_label["fixed"]["ratio"] is None  # one never reached it
    assert "| random | 2 of 3 | 10 | - |" in lines and "| nitro | 3 of 3 | 5 | 0.50 (0.50-0.50) |" in lines


def test_round_costs_by_hand():
    from nitro.experiments.stats import round_cost_table, round_costs

    nan = float("nan")
    history = [{"actors_launched": 8, "actors_wanted": 8, "spend_round_usd": 0.004, "round_billed_s": 1.0},
               {"actors_launched": 8, "actors_wanted": 8, "spend_round_usd": 0.002, "round_billed_s": 3.0},
               {"actors_launched": 5, "actors_wanted": 8, "spend_round_usd": 0.003, "round_billed_s": 0.5},
               {"actors_launched": 2, "actors_wanted": 8, "spend_round_usd": 0.002},
               {"actors_launched": 0, "actors_wanted": 8, "spend_round_usd": 0.001},  # the final evaluation
               {"actors_launched": 3, "actors_wanted": 8, "spend_round_usd": nan}]
    costs = round_costs(history)
    assert costs["full_round_usd"] == pytest.approx(0.003) and costs["full_round_billed_s"] == 2.0
    assert costs["capped_rounds"] == 3 and costs["capped_usd"] == pytest.approx(0.005)
    assert costs["capped_share"] == pytest.approx(0.005 / 0.012)
    lines = round_cost_table({"sync": [history, history[:2]]})
    assert "| sync | 0.0030000 | 2.00 | 1.5 | 0.00250 | 21% |" in lines


# -- a tiny real experiment through the flow ---------------------------------------------------------


def _tiny(tmp_path: Path, redis_url: str) -> tuple[dict, str]:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = {
        "name": "tiny",
        "base": {"env_id": "Hopper-v5", "steps_per_actor": 64, "backend": {"workers": 2},
                 "detector": {"subset_size": 64},
                 "scaler": {"fixed_actors": 2, "i_min": 2, "i_max": 4},
                 "home": str(tmp_path / "home"), "tracking": {"mlflow_uri": uri}, "redis": {"url": redis_url}},
        "matrix": {"env": ["Hopper-v5"], "algo": ["ppo"], "scaler": ["nitro", "random"], "seed": [0, 1]},
        "compare": "rounds",
        "rounds": 2,
        "reference": "nitro",
        "thresholds": {"Hopper-v5": -1e9},  # every run reaches it at its first evaluation (round 0)
    }
    return spec, uri


@pytest.mark.slow
def test_tiny_experiment_through_the_flow(prefect_api, tmp_path, redis_url):
    from cli.main import main
    from flows.experiment import experiment

    spec, uri = _tiny(tmp_path, redis_url)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(spec))
    out_dir = tmp_path / "report"
    out_dir.mkdir()
    prereg = "# Pre-registered\n\nWritten before any cell ran.\n"
    (out_dir / "PREREGISTRATION.md").write_text(prereg)

    # --only: seed 0's cells run, and the report covers the whole spec
    part = asyncio.run(experiment(spec_path=str(tmp_path / "tiny.yaml"), report_dir=str(out_dir), only={"seed": ["0"]}))
    assert [(k, r["state"]) for k, r in part["results"].items()] == [
        ("Hopper-v5/ppo/nitro/seed=0", "ran"), ("Hopper-v5/ppo/random/seed=0", "ran")]
    assert "Cells finished: 2 of 4" in (out_dir / "README.md").read_text()
    # the pre-registration stays as written, and the report links to it
    assert (out_dir / "PREREGISTRATION.md").read_text() == prereg
    assert "[PREREGISTRATION.md](PREREGISTRATION.md)" in (out_dir / "README.md").read_text()

    result = asyncio.run(experiment(spec_path=str(tmp_path / "tiny.yaml"), report_dir=str(out_dir)))
    assert not result["failed"] and result["parent_run_id"] == part["parent_run_id"]
    assert [r["state"] for r in result["results"].values()] == ["skipped", "skipped", "ran", "ran"]

    # one parent run, four cell runs nested under it, all finished, in the experiment `tiny`
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and parents[0].info.run_id == result["parent_run_id"]
    assert len(children) == 4 and {r.data.tags["mlflow.parentRunId"] for r in children} == {result["parent_run_id"]}
    assert all(r.info.status == "FINISHED" for r in runs)
    assert sorted(r.data.tags["nitro.run_id"] for r in children) == sorted(result["cells"].values())
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)],
                                  run_view_type=ViewType.ALL, max_results=100)) == 5  # no stray runs anywhere

    # random cells matched their nitro cell's measured mean actors per round
    for r in children:
        if r.data.tags["scaler"] == "random":
            assert 2 <= float(r.data.params["scaler.random_mean_actors"]) <= 4

    # report files, logged to the parent run too
    names = {p.name for p in out_dir.iterdir()}
    for stem in ("return-vs-round", "return-vs-spend", "actors-per-round", "final-return", "total-spend"):
        assert f"hopper-v5-ppo-{stem}.png" in names
        assert (out_dir / f"hopper-v5-ppo-{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"README.md", "runs.csv", "rounds.csv", "summary.csv", "results.json"} <= names
    logged = {a.path for a in client.list_artifacts(result["parent_run_id"], "report")}
    assert "report/README.md" in logged and "report/hopper-v5-ppo-return-vs-spend.png" in logged
    results = json.loads((out_dir / "results.json").read_text())
    assert results["machine"]["packages"]["torch"] and len(results["runs"]) == 4
    summary = {s["label"]: s for s in results["summary"]}
    assert set(summary) == {"nitro", "random"} and all(s["n"] == 2 for s in summary.values())
    readme = (out_dir / "README.md").read_text()
    assert "±" in readme and "Machine and versions" in readme
    # random against the reference (nitro): the ratio of the seeds' means; two seeds give no CI
    (ratio,) = results["ratios"]
    assert (ratio["label"], ratio["reference"], ratio["n"], ratio["n_reference"]) == ("random", "nitro", 2, 2)
    assert math.isclose(
        ratio["spend"]["ratio"],
        summary["random"]["total_spend_usd_mean"] / summary["nitro"]["total_spend_usd_mean"],
        rel_tol=1e-9,
    )
    assert ratio["spend"]["lo"] is None and ratio["spend"]["hi"] is None
    assert "Against `nitro`" in readme and "(no CI: under 3 seeds)" in readme
    # rliable's IQM, mean and probability of improvement per task and arm; across tasks, the
    # normalised aggregate and the performance profile where a scaler's mean beat round 0's policy
    per_task = {s["label"]: s for s in results["statistics"]["per_task"]}
    assert set(per_task) == {"nitro", "random"} and per_task["random"]["final_return"]["seeds"] == 2
    assert per_task["nitro"]["final_return"]["improvement"] is None
    assert 0.0 <= per_task["random"]["final_return"]["improvement"]["value"] <= 1.0
    assert "final return: IQM (95% CI)" in readme and "P(> nitro)" in readme and "## Across tasks (rliable)" in readme
    normalised = any(agg["arms"] for agg in results["statistics"]["across_tasks"])
    assert ("performance-profile.png" in names) == normalised
    assert all(math.isfinite(r["start_return"]) for r in results["runs"])  # round 0 evaluates
    # time to the threshold: round 0's billed seconds, each run's as rounds.csv holds it
    round0 = {name: rounds[0]["round_billed_s"] for name, rounds in read_rounds(out_dir).items()}
    by_label = {t["label"]: t for t in results["time_to_threshold"]}
    assert {(lab, t["reached"], t["n"]) for lab, t in by_label.items()} == {("nitro", 2, 2), ("random", 2, 2)}
    assert sorted(s for t in by_label.values() for s in t["times_s"]) == pytest.approx(sorted(round0.values()))
    assert by_label["nitro"]["ratio"] is None and by_label["random"]["ratio"]["ratio"] > 0
    assert "Time to the threshold (-1e+09" in readme and "| random | 2 of 2 |" in readme
    # `nitro experiment report DIR` rebuilds the same statistics from the report's files alone
    from nitro.experiments.restats import rebuild_statistics

    written = {p: p.read_bytes() for p in (out_dir / "README.md", out_dir / "results.json")}
    rebuild_statistics(out_dir)
    assert {p: p.read_bytes() for p in written} == written
    # every cell's whole config from the spec (a random cell's matched mean actors are in the notes)
    assert set(results["configs"]) == {c for c in (r["cell"] for r in results["runs"])}
    assert {cfg["scaler"]["name"] for cfg in results["configs"].values()} == {"nitro", "random"}

    # `nitro compare --experiment tiny` prints the same numbers as the report
    # (not capsys: Prefect's console log handler, created during the flow, would keep its closed stream)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["compare", "--experiment", "tiny", "--tracking-uri", uri]) == 0
    printed = buf.getvalue()
    for run in results["runs"]:
        line = next(ln for ln in printed.splitlines() if ln.startswith(run["run_name"]))
        assert f"{run['total_spend_usd']:.4f}" in line
        if run["final_return"] is not None:
            assert f"{run['final_return']:.2f}" in line
        assert f"| {run['run_name']} |" in readme
    for label, s in summary.items():
        vals = [r["final_return"] for r in results["runs"] if r["label"] == label and r["final_return"] is not None]
        if vals:
            assert math.isclose(s["final_return_mean"], sum(vals) / len(vals), rel_tol=1e-12)
    # the late return: each run's evaluations from its own rounds, the last five of them averaged;
    # the rounds are in rounds.csv alone, not in results.json too
    assert "rounds" not in results
    rounds = read_rounds(out_dir)
    assert set(rounds) == {run["run_name"] for run in results["runs"]}
    for run in results["runs"]:
        evals = [h["eval_return_mean"] for h in rounds[run["run_name"]]
                 if h.get("eval_return_mean") is not None and math.isfinite(h["eval_return_mean"])]
        assert evals and math.isclose(run["late_return"], sum(evals[-5:]) / len(evals[-5:]), rel_tol=1e-12)
        assert evals[-1] == run["final_return"]
    assert "late_return" in (out_dir / "runs.csv").read_text().splitlines()[0].split(",")

    # re-running skips every finished cell and keeps one parent run
    again = asyncio.run(experiment(spec=spec, report_dir=str(out_dir)))
    assert [r["state"] for r in again["results"].values()] == ["skipped"] * 4
    assert again["parent_run_id"] == result["parent_run_id"]
    assert len(client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=100)) == 5


@pytest.mark.slow
def test_partial_cell_resumes_from_its_checkpoint(prefect_api, tmp_path, redis_url, inject_faults):
    """A cell that failed mid-way resumes from its checkpoint; the other cells still run."""
    from flows.experiment import ExperimentFailed, experiment

    spec, uri = _tiny(tmp_path, redis_url)
    spec["matrix"] = {"env": ["Hopper-v5"], "scaler": ["fixed"], "seed": [0]}
    parsed = load_spec(spec)
    cell = expand_cells(parsed)[0]
    cfg, run_id = cell_config(parsed, cell), cell_run_id("tiny", cell)

    inject_faults(fail_at=1)
    with pytest.raises(ExperimentFailed, match="1 of 1 cells failed"):
        asyncio.run(experiment(spec=spec, report_dir=str(tmp_path / "r")))
    assert cell_state(cfg, run_id) == ("partial", 1)

    again = asyncio.run(experiment(spec=spec, report_dir=str(tmp_path / "r")))
    assert again["results"][cell.key]["state"] == "ran" and again["results"][cell.key]["rounds_done"] == 2
    assert cell_state(cfg, run_id) == ("done", 2)
    client = MlflowClient(tracking_uri=uri)
    child = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                               filter_string=f"tags.`nitro.run_id` = '{run_id}'")
    assert len(child) == 1 and child[0].info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(child[0].info.run_id, "round")) == [0, 1]


@pytest.mark.slow
def test_a_shuffled_control_replays_its_partners_counts_through_the_flow(prefect_api, tmp_path, redis_url):
    """goodput, then the shuffled control replaying its counts; run alone first, the control is
    skipped with the reason (its partner has not finished) and the study fails at the end."""
    from flows.experiment import ExperimentFailed, experiment

    spec, uri = _tiny(tmp_path, redis_url)
    spec["matrix"] = {"env": ["Hopper-v5"], "algo": ["ppo"], "scaler": ["goodput", "shuffled"], "seed": [0]}
    spec["baselines"], spec["reference"] = SHUFFLED, "goodput"
    out_dir = tmp_path / "report"
    with pytest.raises(ExperimentFailed, match="has not finished"):
        asyncio.run(experiment(spec=spec, report_dir=str(out_dir), only={"scaler": ["shuffled"]}))
    result = asyncio.run(experiment(spec=spec, report_dir=str(out_dir)))
    assert [(k, r["state"]) for k, r in result["results"].items()] == [
        ("Hopper-v5/ppo/goodput/seed=0", "ran"), ("Hopper-v5/ppo/shuffled/seed=0", "ran")]
    rounds = read_rounds(out_dir)
    played = {name.split("-")[4]: sorted(int(h["actors_launched"]) for h in hs) for name, hs in rounds.items()}
    assert played["shuffled"] == played["goodput"] and len(played["goodput"]) == 2  # the replay plays its counts
    assert 2 in played["goodput"]  # round 0 makes no update: goodput, unmeasured, keeps I_min
    # goodput's reading of its rounds is kept with them (the replay has none)
    decided = {name.split("-")[4]: any("goodput/best_actors" in h for h in hs) for name, hs in rounds.items()}
    assert decided == {"goodput": True, "shuffled": False}
    notes = json.loads((out_dir / "results.json").read_text())["notes"]
    assert "replays the 2 actor counts of Hopper-v5/ppo/goodput/seed=0" in notes["Hopper-v5/ppo/shuffled/seed=0"]
    client = MlflowClient(tracking_uri=uri)
    (run,) = [r for r in client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
              if r.data.tags.get("nitro.cell") == "Hopper-v5/ppo/shuffled/seed=0"]
    replayed = sorted(int(n) for n in json.loads(run.data.params["scaler.replay_actors"]))
    assert replayed == played["goodput"] and run.data.params["scaler.name"] == "replay"


@pytest.mark.slow
def test_a_study_goes_on_from_its_report_on_another_machine(prefect_api, tmp_path, redis_url):
    """The MLflow store and checkpoints stay on the machine that ran a cell; the report goes on.
    A second machine (a fresh home and store, the same report directory) carries the finished cell
    from results.json instead of training it again, matches the random cell to its actors, and
    names each run's machine."""
    from flows.experiment import experiment
    from nitro.experiments import carried_runs

    spec, _ = _tiny(tmp_path, redis_url)
    spec["matrix"]["seed"] = [0]
    out_dir = tmp_path / "report"
    first = asyncio.run(experiment(spec=spec, report_dir=str(out_dir), only={"scaler": ["nitro"]}))
    assert [r["state"] for r in first["results"].values()] == ["ran"]
    results = json.loads((out_dir / "results.json").read_text())
    rounds = read_rounds(out_dir)
    (nitro_row,) = results["runs"]
    assert nitro_row["machine"] == results["machine"]["cpu"]
    late = nitro_row["late_return"]
    results["machine"]["cpu"] = "the first machine's CPU"  # what a report from another CPU model holds
    for run in results["runs"]:
        run.pop("machine")  # and one written before runs named their machine
        run.pop("late_return")  # or before the late return
    for config in results["configs"].values():
        config["learner"].pop("lane_linger_s")  # or before a config field existed (at its default now)
    (out_dir / "results.json").write_text(json.dumps(results))

    spec["base"]["home"] = str(tmp_path / "home-2")
    spec["base"]["tracking"]["mlflow_uri"] = f"sqlite:///{tmp_path}/mlflow-2.db"
    second = asyncio.run(experiment(spec=spec, report_dir=str(out_dir)))
    assert [(k, r["state"]) for k, r in second["results"].items()] == [
        ("Hopper-v5/ppo/nitro/seed=0", "carried"), ("Hopper-v5/ppo/random/seed=0", "ran")]
    parsed = load_spec(spec)
    nitro_cell = expand_cells(parsed)[0]
    assert cell_state(cell_config(parsed, nitro_cell), cell_run_id("tiny", nitro_cell)) == (
        "new",
        0,
    )  # not trained here

    after = json.loads((out_dir / "results.json").read_text())
    by_label = {r["label"]: r for r in after["runs"]}
    assert by_label["nitro"]["final_return"] == nitro_row["final_return"]
    assert by_label["nitro"]["late_return"] == late  # from the carried rounds
    assert by_label["nitro"]["machine"] == "the first machine's CPU"
    assert by_label["random"]["machine"] == after["machine"]["cpu"]
    # the carried run's rounds, written again as they were read (repr: a round's NaN R equals NaN)
    assert repr(read_rounds(out_dir)[nitro_row["run_name"]]) == repr(rounds[nitro_row["run_name"]])
    launched = [h["actors_launched"] for h in rounds[nitro_row["run_name"]] if h.get("actors_launched")]
    assert f"random_mean_actors={sum(launched) / len(launched):.3f}" in after["notes"]["Hopper-v5/ppo/random/seed=0"]
    readme = (out_dir / "README.md").read_text()
    assert "Cells finished: 2 of 2" in readme and "the first machine's CPU: 1" in readme
    assert "machine" in (out_dir / "runs.csv").read_text().splitlines()[0].split(",")

    # a cell trained with another config is not the spec's cell any more: it runs again
    spec["base"]["steps_per_actor"] = 32
    assert carried_runs(out_dir, load_spec(spec), expand_cells(load_spec(spec))) == {}
