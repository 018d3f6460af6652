"""The boostability probe (nitro/experiments/probe.py, flows/probe.py): the fork continues the trunk exactly,
the statistics against hand-worked values, spec errors, and a tiny probe through the flow (real
Redis, local actors, Hopper-v5, a real MLflow store)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
import yaml
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.actors.local import LocalActorPool
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import NitroConfig, ScalerConfig
from nitro.experiments.probe import (
    ProbeError,
    arm_config,
    fork,
    load_probe_spec,
    phi_at,
    predicted_gain,
    score_at,
    spearman_ci,
)
from nitro.run.engine import TrainingRun
from nitro.run.rundir import RunDir
from tests.test_engine import drive


@pytest.fixture(scope="module")
def pool():
    with LocalActorPool(workers=2, timeout_s=60, memory_mb=1024) as p:
        yield p


def _training(redis_url: str, run_id: str, home: Path) -> TrainingRun:
    cfg = NitroConfig.load(
        {
            "steps_per_actor": 128,
            "home": str(home),
            "eval": {"every_rounds": 0},
            "detector": {"subset_size": 128, "enabled": True},
            "scaler": {"name": "fixed", "fixed_actors": 2},
        }
    )
    return TrainingRun(
        cfg, run_id, TrajectoryCache(connect_redis(redis_url), run_id, ttl_s=600), actor_cache_url=redis_url
    )


@pytest.mark.slow
def test_a_fork_continues_the_trunk_exactly(redis_url, redis_client, pool, tmp_path):
    trunk = _training(redis_url, "probe-trunk", tmp_path)
    drive(trunk, pool, 3)  # rounds 0..2
    RunDir(tmp_path, "probe-trunk").save(2, trunk.state_dict())
    assert trunk.open_episodes, "Hopper episodes of a random policy end within 128 steps: one is always open"
    fork(redis_client, tmp_path, "probe-trunk", "probe-arm", 3, ttl_s=600)

    arm = _training(redis_url, "probe-arm", tmp_path)
    arm.load_state_dict(RunDir(tmp_path, "probe-arm").load(2)[1])
    # the arm trains on its own copies of the trunk's batches, and continues its own copies of the
    # trunk's unfinished episodes
    assert arm.mode.pending == trunk.mode.pending
    assert arm.open_episodes == [k.replace("nitro:probe-trunk:", "nitro:probe-arm:") for k in trunk.open_episodes]
    assert all(redis_client.exists(k) for k in arm.open_episodes)
    # round 3's update and detection are the trunk's: the same samples, losses and R
    ua, ut = arm.mode.update(3), trunk.mode.update(3)
    assert ua.samples == ut.samples == 256
    assert ua.diagnostics["policy_loss"] == pytest.approx(ut.diagnostics["policy_loss"], rel=1e-6)
    arm_r = arm.detect_boosting(3, ua).R
    assert arm_r == pytest.approx(trunk.detect_boosting(3, ut).R, rel=1e-6)

    # the trunk's round 3 leaves round 2's entries in place (a resume from checkpoint 2 needs them);
    # once they are gone (checkpoint_run deletes them when checkpoint 4 is durable) it can no
    # longer be forked there
    decision = trunk.decide_actors(3, None, ut, time.perf_counter())
    events = trunk.plan_invocations(3, decision, trunk.publish_weights(3))
    trunk.end_round(3, ut, None, decision, pool.invoke_many(events), actor_s=0.0, elapsed_s=1.0)
    fork(redis_client, tmp_path, "probe-trunk", "probe-still", 3, ttl_s=600)
    trunk.cache.delete_round(2)
    with pytest.raises(ProbeError, match="are gone"):
        fork(redis_client, tmp_path, "probe-trunk", "probe-late", 3, ttl_s=600)
    with pytest.raises(ProbeError, match="no checkpoint of round 6"):
        fork(redis_client, tmp_path, "probe-trunk", "probe-late", 7, ttl_s=600)


def test_spearman_and_its_interval_against_hand_values():
    # ranks of y against x differ by one everywhere: sum d^2 = 6, rho = 1 - 6*6 / (6*35) = 0.828571;
    # Fisher z = atanh(rho) = 1.18380, se = sqrt((1 + rho^2/2) / 3) = 0.66914, z -+ 1.95996 se -> tanh
    c = spearman_ci([1, 2, 3, 4, 5, 6], [2, 1, 4, 3, 6, 5])
    assert c["rho"] == pytest.approx(0.828571, abs=1e-6)
    assert c["ci_low"] == pytest.approx(-0.127245, abs=1e-5) and c["ci_high"] == pytest.approx(0.986482, abs=1e-5)
    assert c["n"] == 6 and 0.0 < c["p_value"] < 0.05
    assert spearman_ci([3, 2, 1, 0], [1, 2, 3, 4])["rho"] == pytest.approx(-1.0)
    assert math.isnan(spearman_ci([1, 2, 3], [1, 2, 3])["rho"])  # too few for an interval
    assert spearman_ci([1, 2, float("nan"), 4, 5], [1, 2, 3, 4, 5])["n"] == 4  # NaN pairs are dropped


def test_score_at_is_the_nitro_scalers_score():
    cfg = ScalerConfig(window=3, decay=0.9)
    # round 3 sees the window [1.0, 2.0, 1.5]: S_3 = (2.0 - 1.5) / (2.0 - 1.0) * 0.9^3 = 0.3645
    assert score_at([(1, 1.0), (2, 2.0), (3, 1.5)], cfg, 3) == pytest.approx(0.3645)
    # with window 3, round 4 forgets round 1: [2.0, 1.5, 1.8] -> (2.0 - 1.8) / 0.5 * 0.9^4
    assert score_at([(1, 1.0), (2, 2.0), (3, 1.5), (4, 1.8)], cfg, 4) == pytest.approx(0.4 * 0.9**4)
    assert score_at([(1, 1.0)], cfg, 1) is None  # one value: max == min, no score


def _noise_row(k: int, frag: float, mean: float) -> dict[str, float]:
    """A history row whose update measured 4 fragments of 100 samples (the learner's diagnostics
    under its name, as the engine records them)."""
    return {"round": float(k), "ppo/noise_fragments": 4.0, "ppo/noise_fragment_samples": 100.0,
            "ppo/noise_policy_frag_sqnorm": frag, "ppo/noise_policy_mean_sqnorm": mean, "hessian_R": 1.0}


def test_phi_at_smooths_the_rounds_up_to_k_as_the_goodput_scaler_does():
    # round 1: |G|^2 = (4*2 - 5)/3 = 1, tr(Sigma) = (5 - 2)*4/3 = 4 per fragment = 400 per sample
    # round 2: |G|^2 = (4*3 - 9)/3 = 1, tr(Sigma) = (9 - 3)*4/3 = 8 -> 800
    # decay 0.5, bias-corrected: |G|^2 stays 1; tr(Sigma) = (0.25*400 + 0.5*800) / 0.75 = 666.67
    rows = [_noise_row(1, 5, 2), _noise_row(2, 9, 3), _noise_row(3, 30, 1)]
    assert phi_at(rows, 0.5, 1) == pytest.approx(400.0)
    assert phi_at(rows, 0.5, 2) == pytest.approx(2000.0 / 3)  # round 3 comes after k: not read
    assert phi_at([*rows[:1], {"round": 2.0, "hessian_R": 1.0}], 0.5, 2) is None  # round k measured nothing
    # a round of 6400 samples against one of 800 at phi = 400: (400 + 800) / (400 + 6400) x 8 - 1
    assert predicted_gain(400.0, 800, 6400) == pytest.approx(1200 / 6800 * 8 - 1)
    assert predicted_gain(4000.0, 800, 6400) > predicted_gain(400.0, 800, 6400) > 0  # grows with phi
    assert math.isnan(predicted_gain(None, 800, 6400))


@pytest.mark.parametrize("change, needle", [
    ({"branch_rounds": [1, 4]}, "k >= 2"),
    ({"branch_rounds": []}, "branch_rounds"),
    ({"horizon": 0}, "horizon"),
    ({"base": {"env_id": "Hopper-v5", "rounds": 9}}, "base.rounds"),
    ({"base": {"env_id": "NoSuchEnv-v0"}}, "NoSuchEnv-v0"),
    ({"boost_actors": -1}, "boost_actors"),
    ({"colour": "red"}, "colour"),
])
def test_bad_probe_spec_is_one_clear_line(change, needle):
    spec = {"name": "p", "base": {"env_id": "Hopper-v5"}, "branch_rounds": [2, 4], **change}
    with pytest.raises(ProbeError) as err:
        load_probe_spec(spec)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "examples")
                                         .glob("probe_*.yaml")))
def test_example_probe_specs_are_valid(name):
    spec = load_probe_spec(Path(__file__).resolve().parents[1] / "examples" / name)
    boost = arm_config(spec, 0, spec.branch_rounds[0], "boost")
    plain = arm_config(spec, 0, spec.branch_rounds[0], "plain")
    assert boost.scaler.actors_at == {spec.branch_rounds[0]: 64} and plain.scaler.actors_at == {}
    assert boost.model_dump(exclude={"scaler"}) == plain.model_dump(exclude={"scaler"})
    assert plain.scaler.measures_noise  # every probe reads phi_k beside R_k


@pytest.mark.slow
def test_tiny_probe_through_the_flow(prefect_api, tmp_path, redis_url):
    import json

    from flows.probe import probe
    from nitro.experiments.probe import read_branches

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = {
        "name": "tiny-probe",
        "base": {"env_id": "Hopper-v5", "steps_per_actor": 64, "backend": {"workers": 2},
                 "detector": {"subset_size": 64}, "eval": {"max_steps": 200},
                 "home": str(tmp_path / "home"), "tracking": {"mlflow_uri": uri}, "redis": {"url": redis_url}},
        "branch_rounds": [2, 3], "horizon": 1, "plain_actors": 2, "boost_actors": 5, "eval_episodes": 2,
    }
    out = tmp_path / "report"
    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(spec))
    result = asyncio.run(probe(spec_path=str(tmp_path / "probe.yaml"), report_dir=str(out)))
    rows = result["rows"]
    assert [r["round"] for r in rows] == [2, 3]
    for r in rows:
        assert (r["actors_plain"], r["actors_boost"]) == (2, 5)
        assert r["hessian_R"] == r["hessian_R_boost_arm"] and math.isfinite(r["hessian_R"])  # one update, forked
        assert r["phi"] > 0 and r["predicted_gain"] > 0  # the trunk and arms measure the gradient noise
        assert math.isfinite(r["gain"]) and r["gain"] == r["eval_boost"] - r["eval_plain"]
        # the boost's extra invocations are billed (requests; the learner's wall time is too noisy to compare)
        boost = RunDir(tmp_path / "home", r["boost_run"]).load()[1]["history"]
        plain = RunDir(tmp_path / "home", r["plain_run"]).load()[1]["history"]
        at_k = [
            (b["spend_requests_usd"], p["spend_requests_usd"]) for b, p in zip(boost, plain) if b["round"] == r["round"]
        ]
        assert len(at_k) == 1 and at_k[0][0] > at_k[0][1]
    # the plain arm of round 2 and the trunk made the same decisions up to round 2: same R at round 2
    trunk = RunDir(tmp_path / "home", "tiny-probe-s0-trunk").load()[1]["history"]
    plain = RunDir(tmp_path / "home", "tiny-probe-s0-k002-plain").load()[1]["history"]
    assert [h["hessian_R"] for h in plain if h["round"] == 2] == [h["hessian_R"] for h in trunk if h["round"] == 2]

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tiny-probe")
    runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [p.info.run_id for p in parents] == [result["parent_run_id"]]
    assert sorted(r.data.tags["nitro.probe_role"] for r in children) == ["boost", "boost", "plain", "plain", "trunk"]
    assert all(r.info.status == "FINISHED" for r in runs)
    names = {p.name for p in out.iterdir()}
    assert {"README.md", "branches.csv", "probe.json", "gain-vs-R.png", "gain-vs-score.png", "gain-vs-phi.png",
            "trunk-R.png"} <= names
    assert "Spearman" in (out / "README.md").read_text()
    # the per-branch rows are in branches.csv alone, and read back as the probe computed them
    assert "rows" not in json.loads((out / "probe.json").read_text())
    assert [(r["round"], r["gain"]) for r in read_branches(out)] == [(r["round"], r["gain"]) for r in rows]
    assert "report/README.md" in {a.path for a in client.list_artifacts(result["parent_run_id"], "report")}

    # re-running finds every run finished: nothing new in MLflow, the same rows
    again = asyncio.run(probe(spec_path=str(tmp_path / "probe.yaml"), report_dir=str(out)))
    assert again["parent_run_id"] == result["parent_run_id"]
    assert [(r["round"], r["gain"]) for r in again["rows"]] == [(r["round"], r["gain"]) for r in rows]
    assert len(client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=100)) == 6
