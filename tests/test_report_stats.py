"""The report's statistics through rliable (issue 48 item 6): IQM and mean with stratified-bootstrap
CIs, the probability of improvement, performance profiles, and what the experiment report writes
from them; the ratio of means with arch's bootstrap, paired or not; the area under return vs
spend; each arm against the best of a grid."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nitro.experiments.aggregate import improvement_probability, interval, iqm, mean
from nitro.experiments.scores import (
    PROFILE_FILE,
    across_section,
    across_tasks,
    best_of_grid,
    format_task_table,
    normalisation,
    start_return,
    task_block,
    task_statistics,
)
from nitro.experiments.stats import paired_ratio_ci, ratio_ci, return_spend_area

REPS = 2_000  # enough resamples for the checks below; the report's default is BOOTSTRAP_REPS


def test_iqm_and_mean_by_hand():
    # 4 runs x 2 tasks: the 8 scores sorted are 1 2 3 4 10 20 30 1000; the IQM cuts int(8/4) = 2 off
    # each end and averages 3 4 10 20; the mean averages the task means 2.5 and 265
    scores = [[1, 10], [2, 20], [3, 30], [4, 1000]]
    assert iqm(scores) == (3 + 4 + 10 + 20) / 4
    assert mean(scores) == (2.5 + 265) / 2
    # one task's 5 runs: int(5/4) = 1 off each end, the middle 3 averaged; the outlier moves the mean only
    assert iqm([0.0, 1.0, 2.0, 3.0, 1e6]) == 2.0
    assert mean([0.0, 1.0, 2.0, 3.0, 1e6]) == pytest.approx(200_001.2)


def test_the_resampled_statistics_are_rliables_to_the_last_bit():
    # the bootstrap evaluates numpy twins of rliable's IQM, mean and probability of improvement;
    # tie-heavy small integers, run counts differing between arms, 1-3 tasks
    from rliable import library, metrics

    from nitro.experiments.aggregate import _improvement_fast, _iqm_fast, _mean_fast, _score_distribution

    rng = np.random.default_rng(3)
    for _ in range(100):
        tasks = int(rng.integers(1, 4))
        x = rng.integers(0, 5, (int(rng.integers(1, 9)), tasks)).astype(float)
        y = rng.integers(0, 5, (int(rng.integers(1, 9)), tasks)).astype(float)
        assert _iqm_fast(x) == pytest.approx(float(metrics.aggregate_iqm(x)), rel=1e-12, abs=1e-12)
        assert _mean_fast(x) == pytest.approx(float(metrics.aggregate_mean(x)), rel=1e-12, abs=1e-12)
        assert _improvement_fast(x, y) == pytest.approx(float(metrics.probability_of_improvement(x, y)), abs=1e-12)
        assert _improvement_fast(x, x) == 0.5
        taus = np.linspace(-1, 5, 13)
        assert np.array_equal(_score_distribution(x, taus), library.score_distributions(x, taus))


def test_interval_contains_its_estimate_narrows_with_more_runs_and_repeats():
    rng = np.random.default_rng(7)
    few, many = rng.normal(100, 20, (5, 2)), rng.normal(100, 20, (60, 2))
    widths = {}
    for name, x in (("few", few), ("many", many)):
        for stat in ("IQM", "mean"):
            e = interval(x, stat, reps=REPS)
            assert e.lo <= e.value <= e.hi
            widths[name, stat] = e.hi - e.lo
    assert widths["many", "IQM"] < widths["few", "IQM"] / 2 and widths["many", "mean"] < widths["few", "mean"] / 2
    state = np.random.get_state()[1].copy()
    assert interval(few, reps=REPS) == interval(few, reps=REPS)  # seeded: a rebuilt report says the same
    assert np.array_equal(np.random.get_state()[1], state)  # and numpy's global generator is left as it was
    # a single task's 2 runs have no interval
    two = interval([1.0, 2.0], "mean")
    assert two.value == 1.5 and math.isnan(two.lo) and math.isnan(two.hi)


def test_probability_of_improvement():
    x = np.array([[1.0, 5.0], [2.0, 6.0], [3.0, 7.0]])
    same = improvement_probability(x, x.copy(), reps=REPS)
    assert same.value == 0.5 and same.lo <= 0.5 <= same.hi
    better = improvement_probability(x + 10, x, reps=REPS)
    assert (better.value, better.lo, better.hi) == (1.0, 1.0, 1.0)  # every resample dominates too
    assert improvement_probability(x, x + 10, reps=REPS).value == 0.0
    # by hand, one task: of the 9 pairs of (1, 2, 3) against (2, 2, 0), X wins 1>0, 2>0, 3>2, 3>2,
    # 3>0 and ties 2=2 twice: (5 + 2 x 0.5) / 9; run counts may differ between the arms
    assert improvement_probability([1.0, 2.0, 3.0], [2.0, 2.0, 0.0]).value == pytest.approx(6 / 9)
    assert improvement_probability([1.0, 3.0], [2.0]).value == 0.5
    # averaged over tasks: task 0 always better (1), task 1 always worse (0)
    assert improvement_probability([[5.0, 0.0], [6.0, 1.0], [7.0, 2.0]], [[1.0, 5.0], [2.0, 6.0], [3.0, 7.0]],
                                   reps=REPS).value == 0.5


def test_ratio_ci_from_arch_by_hand():
    # one arm of {1, 1, 4}: its bootstrap means are 1, 2, 3 or 4 (8/27, 12/27, 6/27, 1/27), over a
    # fixed 2; 2.5% falls on 1/2 and 97.5% on 4/2 (1/27 = 3.7% of the draws)
    assert ratio_ci([1.0, 1.0, 4.0], [2.0, 2.0, 2.0]) == {"ratio": 1.0, "lo": 0.5, "hi": 2.0}
    r = ratio_ci([80.0, 100.0, 100.0, 120.0], [50.0, 60.0, 40.0])
    assert r["lo"] < r["ratio"] == 2.0 < r["hi"] and ratio_ci([80.0, 100.0, 100.0, 120.0], [50.0, 60.0, 40.0]) == r


def test_paired_ratio_ci_resamples_the_seeds_as_pairs():
    # each seed's pair is alike, though the seeds differ: every paired resample has the ratio 1, where
    # resampling the arms on their own (ratio_ci) draws 1 over 3 and 3 over 1
    assert paired_ratio_ci([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == {"ratio": 1.0, "lo": 1.0, "hi": 1.0}
    unpaired = ratio_ci([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert unpaired["lo"] < 0.7 and unpaired["hi"] > 1.4
    # over a constant: the resampled means of {1, 1, 4} are 1, 2, 3 or 4 (8/27, 12/27, 6/27, 1/27)
    assert paired_ratio_ci([1.0, 1.0, 4.0], [1.0, 1.0, 1.0]) == {"ratio": 2.0, "lo": 1.0, "hi": 4.0}
    nan_bounds = paired_ratio_ci([2.0, 4.0], [1.0, 1.0])
    assert nan_bounds["ratio"] == 3.0 and math.isnan(nan_bounds["lo"]) and math.isnan(nan_bounds["hi"])
    for a, b in (([1.0, 2.0], [1.0]), ([], []), ([1.0, 2.0, 3.0], [-1.0, 0.0, 1.0]), ([1.0, math.nan], [1.0, 1.0])):
        assert all(math.isnan(v) for v in paired_ratio_ci(a, b).values()), (a, b)


def test_return_spend_area_by_hand():
    nan = math.nan
    # evaluations of 10 at $0.01 (round 0: the initialised policy) and 30 at $0.03, none in between;
    # budget $0.05: 10 x 0.01 from $0, the trapezoid (0.03 - 0.01) x (10 + 30) / 2, then 30 x 0.02 to
    # the budget: (0.1 + 0.4 + 0.6) / 0.05 = 22
    history = [{"round": 2, "eval_return_mean": 30.0, "spend_total_usd": 0.03},
               {"round": 0, "eval_return_mean": 10.0, "spend_total_usd": 0.01},
               {"round": 1, "eval_return_mean": nan, "spend_total_usd": 0.02}, {"round": 3}]
    assert return_spend_area(history, 0.05) == pytest.approx(22.0)
    # a run that spent past its budget is integrated to its last spend: (0.1 + 0.4) / 0.03
    assert return_spend_area(history, 0.02) == pytest.approx(0.5 / 0.03)
    flat = [{"round": 0, "eval_return_mean": 7.0, "spend_total_usd": 0.02}]
    assert return_spend_area(flat, 0.05) == pytest.approx(7.0)  # one policy all along: its return
    assert math.isnan(return_spend_area([{"round": 0, "spend_total_usd": 0.01}], 0.05))


def test_best_of_grid_by_hand():
    """The grid g8, g16; arms cand (4 seeds) and half (seeds 0-1). On the late return g8 is best
    (mean 200 against 150), on the final return g16 (300 against 100)."""
    rows = []
    for label, late, final in (("g8", [190.0, 200.0, 210.0, 200.0], [100.0] * 4),
                               ("g16", [150.0] * 4, [300.0] * 4),
                               ("cand", [380.0, 200.0, 210.0, 100.0], [150.0, 300.0, 450.0, 300.0]),
                               ("half", [100.0, 100.0, math.nan, math.nan], [600.0, 600.0, math.nan, math.nan])):
        for seed in range(4):
            rows.append({"env": "E", "algo": "ppo", "label": label, "seed": seed, "status": "FINISHED",
                         "late_return": late[seed], "final_return": final[seed]})
    out = best_of_grid(rows, "E", "ppo", ["g8", "g16", "cand", "half"], ["g8", "g16"], reps=REPS)
    by = {(r["label"], r["metric"]): r for r in out}
    assert set(by) == {("cand", "late_return"), ("cand", "final_return"), ("half", "late_return"),
                       ("half", "final_return")}  # the grid is not compared with its own best
    late = by[("cand", "late_return")]
    assert late["best"] == "g8" and late["best_mean"] == 200.0 and late["seeds"] == [0, 1, 2, 3]
    assert late["per_seed"] == pytest.approx([2.0, 1.0, 1.0, 0.5])
    assert late["ratio"]["ratio"] == pytest.approx(890 / 800) and late["ratio"]["lo"] < 1 < late["ratio"]["hi"]
    # of g8's 4 seeds, 380 beats 4, 200 beats 1 and ties 2, 210 beats 3 and ties 1, 100 none (a tie: half)
    assert late["improvement"]["value"] == pytest.approx((4 + 2 + 3.5 + 0) / 16)
    final = by[("cand", "final_return")]
    assert final["best"] == "g16" and final["ratio"]["ratio"] == pytest.approx(1200 / 1200)
    half = by[("half", "final_return")]
    assert half["seeds"] == [0, 1] and half["ratio"]["ratio"] == 2.0 and math.isnan(half["ratio"]["lo"])
    # the task's block: the per-arm table, then this one
    stats = task_statistics(rows, "E", "ppo", ["g8", "g16", "cand", "half"], "g16", reps=200)
    block = "\n".join(task_block("E", "ppo", stats, "g16", 5, 200, against=out, grid=["g8", "g16"]))
    assert "Against the best of the grid (`g8`, `g16`)" in block
    assert "| cand | late return | `g8` (200.0) | 4 | 1.11 (" in block and "| 2.00, 1.00, 1.00, 0.50 |" in block
    assert "| half | final return | `g16` (300.0) | 2 | 2.00 (no CI: under 3 seeds) | 2.00, 2.00 | " in block
    assert "area under return vs spend" not in format_task_table(stats, "g16")  # no row has it
    with_area = [{**r, "return_area": r["late_return"] / 2} for r in rows]
    assert "area under return vs spend: IQM (95% CI)" in format_task_table(
        task_statistics(with_area, "E", "ppo", ["g8", "cand"], "g8", reps=200), "g8")


def test_start_return_is_the_round_0_evaluation():
    assert start_return([{"round": 1, "eval_return_mean": 50.0}, {"round": 0, "eval_return_mean": 12.5}]) == 12.5
    assert math.isnan(start_return([{"round": 0}, {"round": 5, "eval_return_mean": 50.0}]))


def _rows() -> list[dict]:
    """Two tasks, three arms, 4 seeds: on Hopper `good` beats `fixed` on every seed and `same`
    repeats fixed's returns; on Walker2d the same, 1000 higher. A third task never evaluated at round 0."""
    rows = []
    for env, start, offset in (("Hopper-v5", 0.0, 0.0), ("Walker2d-v5", 1000.0, 1000.0), ("Ant-v5", math.nan, 0.0)):
        for label, base in (("fixed", 100.0), ("good", 200.0), ("same", 100.0)):
            for seed in range(4):
                rows.append({"env": env, "algo": "ppo", "label": label, "seed": seed, "status": "FINISHED",
                             "start_return": start, "final_return": offset + base + 10 * seed,
                             "late_return": offset + base + 5 * seed})
    rows.append({**rows[0], "seed": 9, "status": "RUNNING", "final_return": -1e9, "late_return": -1e9})  # left out
    return rows


def test_normalisation_by_hand():
    rows = _rows()
    # Hopper: start 0, the best arm is `good` with final returns 200, 210, 220, 230 (mean 215)
    assert normalisation(rows, "Hopper-v5", "ppo", ["fixed", "good", "same"], "final_return") == {
        "start": 0.0, "best": 215.0, "best_label": "good"}
    assert normalisation(rows, "Ant-v5", "ppo", ["fixed"], "final_return") == {"reason": "no round-0 evaluation"}
    low = [{**r, "start_return": 1e6} for r in rows]
    reason = normalisation(low, "Hopper-v5", "ppo", ["fixed"], "final_return")["reason"]
    assert reason == "no arm's mean above the start, 1000000.0"
    agg = across_tasks(rows, [("Hopper-v5", "ppo"), ("Walker2d-v5", "ppo"), ("Ant-v5", "ppo")],
                       ["fixed", "good", "same"], "fixed", "final_return", reps=REPS)
    assert agg["tasks"] == ["Hopper-v5 · ppo", "Walker2d-v5 · ppo"]  # Ant left out
    good = np.array(agg["scores"]["good"])
    # seed 0 of `good`: 200 / 215 on Hopper and (1200 - 1000) / (1215 - 1000) on Walker2d
    assert good.shape == (4, 2) and good[0] == pytest.approx([200 / 215, 200 / 215])
    arms = {a["label"]: a for a in agg["arms"]}
    assert arms["good"]["mean"]["value"] == pytest.approx(1.0)  # the best arm's mean is 1 on every task
    assert arms["good"]["improvement"] == {"value": 1.0, "lo": 1.0, "hi": 1.0}
    assert arms["same"]["improvement"]["value"] == 0.5 and arms["fixed"]["improvement"] is None


def test_task_table_and_across_section_write_the_figures_and_the_profile(tmp_path):
    rows = _rows()
    labels = ["fixed", "good", "same"]
    reps = 500  # the figures' format is checked here, not their bootstrap precision
    stats = task_statistics(rows, "Hopper-v5", "ppo", labels, "fixed", reps=reps)
    by_label = {s["label"]: s for s in stats}
    late = by_label["good"]["late_return"]
    # good's late returns 200, 205, 210, 215: IQM of the middle two 207.5, the mean too
    assert late["seeds"] == 4 and late["IQM"]["value"] == 207.5 and late["mean"]["value"] == 207.5
    assert late["improvement"] == {"value": 1.0, "lo": 1.0, "hi": 1.0}
    assert by_label["fixed"]["late_return"]["improvement"] is None
    table = format_task_table(stats, "fixed")
    iqm_ci = late["IQM"]
    assert f"| good | 4 | 207.5 ({iqm_ci['lo']:.1f} to {iqm_ci['hi']:.1f}) |" in table
    assert "| 1.00 (1.00 to 1.00) |" in table and "P(> fixed)" in table
    assert "| same | 4 | 107.5 (" in table and "| 0.50 (" in table

    md, per_metric, png = across_section(rows, [("Hopper-v5", "ppo"), ("Walker2d-v5", "ppo"), ("Ant-v5", "ppo")],
                                         labels, "fixed", tmp_path, reps=reps, profile_reps=100)
    text = "\n".join(md)
    assert png == tmp_path / PROFILE_FILE and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"![performance-profile]({PROFILE_FILE})" in text
    assert "- Ant-v5 · ppo, final return: left out (no round-0 evaluation)." in text
    assert "- Hopper-v5 · ppo, final return: 0 = 0.0 (round-0 evaluation), 1 = 215.0 (`good`'s mean)." in text
    good_final = next(a for a in per_metric[1]["arms"] if a["label"] == "good")
    assert f"| good | final return | 4 | {good_final['IQM']['value']:.2f} (" in text
    assert "| good | late return | 4 |" in text and "| 1.00 (1.00 to 1.00) |" in text

    # nothing to normalise: no picture, and the section says why
    bare = [{**r, "start_return": math.nan} for r in rows]
    md, _, png = across_section(bare, [("Hopper-v5", "ppo")], labels, "fixed", tmp_path / "bare", reps=reps)
    assert png is None and "No task can be normalised yet" in "\n".join(md)
