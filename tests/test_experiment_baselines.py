"""The paper's baselines in one experiment matrix: named baselines carry their own overrides (so
Lambda-priced and VM-priced cells mix), are checked when the spec loads, and a MinionsRL cell run
through the experiment flow keeps its pre-training record in its MLflow tags and in the report."""

from __future__ import annotations

import asyncio
import csv
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from nitro.config.minionsrl import PretrainConfig
from nitro.experiments import ExperimentError, cell_config, cell_run_id, expand_cells, load_spec
from nitro.scaling.minionsrl.pretrain import pretrain, save_scheduler

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "baselines_hopper.yaml"


@pytest.fixture(scope="module")
def scheduler_file(tmp_path_factory) -> tuple[Path, object]:
    """A scheduler pre-trained for 2 simulated runs of 3 rounds: a real file with a real record."""
    scheduler, _ = pretrain(PretrainConfig(episodes=2, i_min=2, i_max=4, simulator={"rounds": 3}))
    return save_scheduler(tmp_path_factory.mktemp("minionsrl") / "s.safetensors", scheduler), scheduler.record


def _spec(**over) -> dict:
    spec = {"name": "mix", "base": {"env_id": "Hopper-v5", "steps_per_actor": 64},
            "matrix": {"env": ["Hopper-v5"], "scaler": ["fixed", "serverful", "vm-pause"], "seed": [0]},
            "compare": "rounds", "rounds": 2}
    spec.update(over)
    return spec


def test_the_example_spec_expands_into_one_cell_per_baseline(scheduler_file):
    path, _ = scheduler_file
    spec = load_spec(EXAMPLE, [f"scaler.minionsrl.path={path}"])
    cells = expand_cells(spec)
    assert [c.label for c in cells] == ["nitro", "fixed", "serverful", "vm-pause", "vm-replay", "nitro-vm", "minionsrl"]
    assert {(c.env, c.algo, c.seed) for c in cells} == {("Hopper-v5", "ppo", 0)}
    configs = {c.label: cell_config(spec, c) for c in cells}
    got = {label: (c.scaler.name, c.backend.pricing) for label, c in configs.items()}
    assert got == {
        "nitro": ("nitro", "lambda"),
        "fixed": ("fixed", "lambda"),
        "serverful": ("fixed", "vm"),
        "vm-pause": ("vm-pause", "vm"),
        "vm-replay": ("vm-replay", "vm"),
        "nitro-vm": ("nitro", "vm"),
        "minionsrl": ("minionsrl", "lambda"),
    }
    assert (configs["serverful"].backend.vm.instance_type, configs["serverful"].backend.vm.min_instances) == (
        "c5.4xlarge",
        0,
    )
    # the spec's own nitro-vm replaces the built-in one: a VM sized for its I_max of 32
    vm = configs["nitro-vm"].backend.vm
    assert (vm.instance_type, vm.vcpus, vm.min_instances) == ("c5.9xlarge", 36, 1) and vm.vcpus >= configs[
        "nitro-vm"
    ].scaler.i_max
    assert configs["minionsrl"].scaler.minionsrl.path == str(path)
    for c in configs.values():
        assert (c.clock.kind, c.rounds, c.budget_usd, c.env_id) == ("lambda", 10, None, "Hopper-v5")
        assert (c.scaler.fixed_actors, c.scaler.i_min, c.scaler.i_max) == (8, 4, 32)
    assert len({cell_run_id(spec.name, c) for c in cells}) == len(cells)
    assert all(label in cell_run_id(spec.name, c) for label, c in zip(configs, cells))


def test_lambda_and_vm_priced_cells_share_one_matrix():
    """`vm-pause` alone needs `backend.pricing: vm`; as a baseline it brings it, for its cells only."""
    spec = load_spec(_spec())
    got = {c.label: cell_config(spec, c).backend.pricing for c in expand_cells(spec)}
    assert got == {"fixed": "lambda", "serverful": "vm", "vm-pause": "vm"}
    own = load_spec(_spec(baselines={"serverful": {"scaler": "fixed", "overrides": [
        "backend.pricing=vm", "backend.vm.instance_type=c5.2xlarge", "scaler.fixed_actors=4"]}}))
    serverful = cell_config(own, expand_cells(own)[1])
    assert (serverful.backend.vm.instance_type, serverful.scaler.fixed_actors) == ("c5.2xlarge", 4)


@pytest.mark.parametrize(("change", "needle"), [
    ({"matrix": {"env": ["Hopper-v5"], "scaler": ["nitro", "warp"], "seed": [0]}},
     "matrix.scaler: unknown scaler or baseline 'warp'"),
    ({"baselines": {"b": {"scaler": "fixed", "overrides": ["scaler.name=nitro"]}}},
     "baselines.b.overrides: scaler.name is set by the matrix"),
    ({"baselines": {"b": {"scaler": "fixed", "overrides": ["backend.pricing"]}}}, "baselines.b.overrides"),
    ({"baselines": {"b": {"scaler": "warp"}}}, "baselines.b.scaler"),
    ({"baselines": {"a/b": {"scaler": "fixed"}}}, "baselines: name 'a/b'"),
    ({"baselines": {"b": {"scaler": "fixed", "overrides": ["backend.vm.instance_type=c9.huge"]}},
      "matrix": {"env": ["Hopper-v5"], "scaler": ["b"], "seed": [0]}}, "baseline b: invalid config: backend.vm"),
    ({"matrix": {"env": ["Hopper-v5"], "scaler": ["minionsrl"], "seed": [0]},
      "base": {"scaler": {"minionsrl": {"path": "/nonexistent/s.safetensors"}}},
     }, "scaler.minionsrl.path: no MinionsRL scheduler at /nonexistent/s.safetensors"),
    ({"matrix": {"env": ["Hopper-v5"], "scaler": ["minionsrl"], "seed": [0]}}, "minionsrl.path"),
    ({"sensitivity": {"scaler": "warp", "sweep": {"scaler.decay": [0.9]}}}, "sensitivity.scaler"),
])
def test_a_bad_baseline_is_one_line_naming_the_field(change, needle):
    with pytest.raises(ExperimentError) as info:
        load_spec(_spec(**change))
    msg = str(info.value)
    assert "\n" not in msg and needle in msg, msg


@pytest.mark.slow
def test_a_minionsrl_cell_reports_its_pretraining(prefect_api, tmp_path, redis_url, scheduler_file):
    """One MinionsRL cell, 2 rounds of 64-step actors, through the experiment flow: the cell's MLflow
    run (created by the experiment, attached by the training run) carries the pre-training record,
    and the report's run table, summary and runs.csv show it beside the run's own spend."""
    from flows.experiment import experiment

    path, record = scheduler_file
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = {
        "name": "tiny-minions",
        "base": {"env_id": "Hopper-v5", "steps_per_actor": 64, "backend": {"workers": 2}, "clock": {"kind": "lambda"},
                 "detector": {"subset_size": 64}, "scaler": {"i_min": 2, "i_max": 4, "minionsrl": {"path": str(path)}},
                 "home": str(tmp_path / "home"), "tracking": {"mlflow_uri": uri}, "redis": {"url": redis_url}},
        "matrix": {"env": ["Hopper-v5"], "scaler": ["minionsrl"], "seed": [0]},
        "compare": "rounds", "rounds": 2}
    out = tmp_path / "report"
    result = asyncio.run(experiment(spec=spec, report_dir=str(out)))
    assert not result["failed"] and [r["state"] for r in result["results"].values()] == ["ran"]

    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("tiny-minions").experiment_id],
                             filter_string=f"tags.`nitro.run_id` = '{next(iter(result['cells'].values()))}'")[0]
    tags = run.data.tags
    assert (tags["scaler"], tags["nitro.cell_label"]) == ("minionsrl", "minionsrl")
    assert int(tags["minionsrl.pretrain_episodes"]) == record.episodes == 2
    assert int(tags["minionsrl.pretrain_env_steps"]) == record.env_steps > 0
    assert float(tags["minionsrl.pretrain_usd"]) == pytest.approx(record.usd) and record.usd > 0

    readme = (out / "README.md").read_text()
    assert "pretrain USD (projected)" in readme and f"{record.usd:.4f}" in readme
    assert f"({record.episodes} episodes, {record.env_steps} env steps)" in readme  # the summary's column
    assert "| minionsrl | minionsrl | - | aws-lambda x86_64 1024MB |" in readme
    row = next(csv.DictReader((out / "runs.csv").open()))
    assert (int(row["pretrain_episodes"]), int(row["pretrain_env_steps"])) == (record.episodes, record.env_steps)
    assert float(row["pretrain_usd"]) == pytest.approx(record.usd) and float(row["total_spend_usd"]) > 0
