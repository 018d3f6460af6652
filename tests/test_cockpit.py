"""Issue 12 without a browser: the deployment's run form (parameter schema), one round numbering,
the CLI's compare errors and help, and the artifact payloads. The browser tests of the same
issue are in test_ui.py."""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.utilities.callables import parameter_schema

from flows.training import config_from_parameters, train
from nitro.config import NitroConfig
from nitro.tracking.metrics import round_line
from tasks.artifacts import _encode, artifact_key

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = {name: p.default for name, p in inspect.signature(train.fn).parameters.items()}


def test_every_form_field_has_a_type_a_default_and_a_description():
    """What the Prefect UI's Custom-run form shows comes from this schema: no field without help,
    none typed "anything or None"."""
    schema = parameter_schema(train).model_dump_for_openapi()
    props = schema["properties"]
    assert list(props) == list(DEFAULTS)
    for name, prop in props.items():
        assert prop.get("description", "").strip(), f"{name} has no description"
        assert "type" in prop and "anyOf" not in prop, f"{name}: {prop}"
        assert "default" in prop, name
    assert not schema.get("required")
    assert props["scaler"]["enum"][0] == "nitro" and props["rounds"]["minimum"] == 1
    assert "key=value" in props["overrides"]["description"]


def test_the_probe_form_has_a_type_a_default_and_a_description_for_every_field():
    from flows.probe import probe

    schema = parameter_schema(probe).model_dump_for_openapi()
    props = schema["properties"]
    assert list(props) == ["spec_path", "overrides", "report_dir"] and not schema.get("required")
    for prop in props.values():
        assert prop.get("description", "").strip() and "type" in prop, prop
        assert "anyOf" not in prop and "default" in prop, prop
    assert (REPO / props["spec_path"]["default"]).is_file()  # the default spec ships with the repository


def test_form_defaults_are_the_built_in_config():
    """A run started with the form's prefilled values is a run with the built-in defaults."""
    assert config_from_parameters(DEFAULTS) == NitroConfig()
    built_in = NitroConfig()
    assert (DEFAULTS["env_id"], DEFAULTS["algo"], DEFAULTS["scaler"], DEFAULTS["rounds"], DEFAULTS["seed"],
            DEFAULTS["backend"]) == (
        built_in.env_id, built_in.algo, built_in.scaler.name, built_in.rounds, built_in.seed, built_in.backend.kind)
    assert built_in.budget_usd is None and DEFAULTS["budget_usd"] == 0  # 0: no limit
    # 0: the preset's, which depends on the env: a prefilled 256 would be sent as the user's choice
    assert DEFAULTS["steps_per_actor"] == 0 and built_in.steps_per_actor == 256
    atari = config_from_parameters({**DEFAULTS, "env_id": "ALE/Qbert-v5"})
    assert atari.steps_per_actor == 128
    assert config_from_parameters({**DEFAULTS, "env_id": "ALE/Qbert-v5", "steps_per_actor": 256}).steps_per_actor == 256


def test_fields_left_at_their_default_keep_the_config_files_values(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text("rounds: 20\nseed: 3\nscaler:\n  name: fixed\n  fixed_actors: 4\n")
    config = config_from_parameters({**DEFAULTS, "config_path": str(path), "seed": 9,
                                     "overrides": ["scaler.fixed_actors=6"]})
    assert config.rounds == 20 and config.scaler.name == "fixed"  # form left at default: the file wins
    assert config.seed == 9 and config.scaler.fixed_actors == 6  # changed in the form / an override


METRICS = {"train_return_mean": 12.5, "eval_return_mean": math.nan, "hessian_R": 0.5, "actors_failed": 0,
           "actors_launched": 8, "actors_wanted": 8, "env_steps": 4096, "spend_total_usd": 0.0021, "round_s": 4.1}


def test_rounds_are_numbered_from_zero_in_the_cli_line():
    """The same index as Prefect's `<run id>-round-<k>`, the table's `round` and MLflow's step."""
    assert round_line(0, METRICS, 15).startswith("round 0 of 0..14: actors=8 ")
    assert round_line(14, METRICS, 15).startswith("round 14 of 0..14: ")
    assert "capped" not in round_line(0, {**METRICS, "actors_wanted": 8}, 15)


def test_the_cli_line_says_when_the_budget_cut_the_scalers_count():
    line = round_line(3, {**METRICS, "actors_launched": 5, "actors_wanted": 16}, 15)
    assert line.startswith("round 3 of 0..14: actors=5 (capped by budget: 16 wanted) ")


def test_table_artifact_payload_is_json_with_nulls_and_whole_numbers():
    rows = [{"round": 0.0, "eval_return_mean": math.nan, "spend_total_usd": 0.00123456, "actors_launched": 8.0}]
    assert json.loads(_encode("table", rows)) == [
        {"round": 0, "eval_return_mean": None, "spend_total_usd": 0.0012, "actors_launched": 8}]
    assert artifact_key("rounds", "run-ABC_1") == "nitro-rounds-run-abc-1"


def _nitro(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_compare_with_an_unknown_experiment_is_one_line(tracking_uri: str):
    from nitro.tracking.tracker import RunTracker

    RunTracker(tracking_uri, "known")
    done = _nitro("compare", "--experiment", "nope", "--tracking-uri", tracking_uri)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["nitro: error: unknown MLflow experiment 'nope'; known: Default, known"]
    assert "Traceback" not in done.stderr
    done = _nitro("compare", "--tag", "scaler", "--tracking-uri", tracking_uri)
    assert done.returncode == 2 and done.stderr.strip() == "nitro: error: --tag wants key=value, got 'scaler'"


@pytest.mark.slow
def test_compare_help_describes_every_option():
    done = _nitro("compare", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for option, words in (("--experiment NAME", "only this MLflow experiment"),
                          ("--tag key=value", "only runs with this tag value"),
                          ("--tracking-uri URI", "MLflow store")):
        assert option in text and words in text, (option, text)


@pytest.mark.parametrize("section", ["Run it from Prefect"])
def test_readme_creates_every_pool_that_prefect_yaml_deploys_to(section: str):
    """`prefect --no-prompt deploy --all` fails when a deployment's pool is missing (issue 12, item 1)."""
    import yaml

    readme = (REPO / "README.md").read_text()
    block = readme[readme.index(section):]
    created = {line.split()[3] for line in block.splitlines() if line.strip().startswith("prefect work-pool create")}
    pools = {d["work_pool"]["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    assert pools <= created, f"README creates {created}, prefect.yaml deploys to {pools}"
