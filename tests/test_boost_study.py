"""bench/boost_study.py's arithmetic against answers worked by hand: an actor's marginal cost from
rounds billed by a known formula, a probe report's rho and mean gain, and a study read from a report
written the way ``nitro experiment`` writes it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import boost_study

from nitro.experiments.stats import mean_pm


def _rounds(actors: list[int], a: float, b: float, c: float) -> list[dict]:
    """A run whose round k is billed a + b x actors_k + c x actors_(k-1) exactly."""
    return [{"round": k, "actors_launched": float(n),
             "spend_round_usd": a + b * n + c * (actors[k - 1] if k else 0)} for k, n in enumerate(actors)]


def test_marginal_cost_recovers_the_billing_formula():
    a, b, c = 1e-3, 2e-5, 3e-5
    runs = [_rounds([8, 8, 64, 8, 8, 32, 16, 8, 64, 64, 8, 8], a, b, c), _rounds([16, 8, 8, 40, 8, 24, 8, 8], a, b, c)]
    cost = boost_study.marginal_cost(runs)
    assert cost["a"] == pytest.approx(a, rel=1e-9) and cost["per_actor"] == pytest.approx(b + c, rel=1e-9)
    # 64 actors cost 1e-3 + 64 x 5e-5 = 4.2e-3 (15238 samples-units per $); 8 cost 1.4e-3 (5714)
    assert cost["samples_per_usd_64_over_8"] == pytest.approx((64 / 4.2e-3) / (8 / 1.4e-3), rel=1e-9)
    assert cost["rounds"] == 9 + 5  # each run's first and last rounds left out


def test_marginal_cost_is_nan_when_the_actors_never_vary():
    cost = boost_study.marginal_cost([_rounds([8] * 10, 1e-3, 2e-5, 3e-5)])
    assert math.isnan(cost["per_actor"]) and math.isnan(cost["samples_per_usd_64_over_8"])


def test_the_per_run_ratio_holds_across_hosts_of_different_pace():
    # the same billing on a host twice as slow (a, b and c doubled), with boosts in other rounds: each
    # run's own fit gives the formula's ratio, while one fit pooled over both runs does not
    a, b, c = 1e-3, 2e-5, 3e-5
    fast = _rounds([8, 8, 64, 8, 8, 32, 16, 8, 64, 64, 8, 8], a, b, c)
    slow = _rounds([8, 16, 8, 8, 40, 8, 24, 8, 8, 8], 2 * a, 2 * b, 2 * c)
    exact = (64 / (a + 64 * (b + c))) / (8 / (a + 8 * (b + c)))
    per_run = boost_study.per_run_ratio([fast, slow, _rounds([8] * 10, a, b, c)])
    assert per_run["runs"] == 2  # the run whose actors never vary has no ratio
    assert per_run["median"] == pytest.approx(exact, rel=1e-9)
    assert per_run["low"] == pytest.approx(exact, rel=1e-9) and per_run["high"] == pytest.approx(exact, rel=1e-9)
    assert boost_study.marginal_cost([fast, slow])["samples_per_usd_64_over_8"] != pytest.approx(exact, rel=1e-2)


def test_probe_reads_rho_and_the_mean_gain(tmp_path):
    # a branch with no gain (an arm without an evaluation) is an empty field in branches.csv
    (tmp_path / "branches.csv").write_text("seed,round,gain\n0,4,10.0\n0,8,-4.0\n1,4,6.0\n1,8,\n")
    (tmp_path / "probe.json").write_text(
        json.dumps(
            {
                "spec": {
                    "name": "p",
                    "base": {"env_id": "Hopper-v5", "ppo": {"minibatches": 32}},
                    "horizon": 8,
                    "seeds": [0, 1],
                },
                "correlations": {"hessian_R~gain": {"n": 3, "rho": -0.5, "ci_low": -0.9, "ci_high": 0.4}},
                "machine": {"cpu": "cpu"},
            }
        )
    )
    p = boost_study.probe(tmp_path)
    assert (p["horizon"], p["seeds"], p["branches"], p["minibatches"]) == (8, 2, 3, 32)
    assert p["gain_mean"] == pytest.approx(4.0)
    # t(0.975, 2) = 4.303 (to the table's three decimals); the sample sd of (10, -4, 6) is sqrt(52)
    assert p["gain_ci95"] == pytest.approx(4.302653 * math.sqrt(52) / math.sqrt(3), rel=1e-3)
    assert p["rho_R_gain"]["rho"] == -0.5


def test_a_one_seed_group_prints_its_mean_without_an_interval():
    # a study stopped after one seed stores no interval (None); the table says n=1 rather than failing
    assert mean_pm(3476.2, None, ".0f") == "3476 (n=1)"
    assert mean_pm(2848.4, 1219.3, ".0f") == "2848 ± 1219"


def test_study_reads_a_reports_rounds_from_its_compressed_rounds_file(tmp_path, monkeypatch):
    from nitro.experiments import rounds as rounds_file
    from nitro.experiments.stats import summarize

    a, b, c = 1e-3, 2e-5, 3e-5
    actors = {"nitro": [8, 8, 64, 8, 8, 32, 16, 8, 64, 64, 8, 8], "fixed": [16] * 12}
    runs, round_rows = [], []
    for label, counts in actors.items():
        for seed in (0, 1):
            name = f"study-{label}-s{seed}"
            rounds = _rounds(counts, a, b, c)
            runs.append({"run_name": name, "env": "Hopper-v5", "algo": "ppo", "label": label, "status": "FINISHED",
                         "variant": None, "final_return": 100.0 + seed, "total_spend_usd": 0.05, "rounds_done": 12,
                         "env_steps_total": 256.0 * sum(counts)})
            round_rows += [{"run_name": name, "label": label, "env": "Hopper-v5", "algo": "ppo", "seed": seed, **r}
                           for r in rounds]
    (tmp_path / "results.json").write_text(json.dumps({
        "experiment": "study", "machine": {"cpu": "cpu"}, "spec": {"compare": "budget", "budget_usd": 0.05},
        "summary": summarize(runs, ["nitro", "fixed"]), "runs": runs}))
    monkeypatch.setattr(rounds_file, "GZIP_ABOVE_BYTES", 0)  # a large report's rounds, as the report writes them
    written = rounds_file.write_rounds(tmp_path, round_rows, ["run_name", "label", "env", "algo", "seed", "round",
                                                              "actors_launched", "spend_round_usd"])
    assert written.name == "rounds.csv.gz" and not (tmp_path / "rounds.csv").exists()

    groups = {g["label"]: g for g in boost_study.study(tmp_path)["groups"]}
    nitro = groups["nitro"]["cost"]
    assert nitro["per_actor"] == pytest.approx(b + c, rel=1e-9) and nitro["rounds"] == 2 * 9
    assert groups["nitro"]["ratio_per_run"]["runs"] == 2 and math.isnan(groups["fixed"]["cost"]["per_actor"])
    assert groups["nitro"]["late_improvement_over_fixed"] is None  # these rounds never evaluated
