"""Pool the final evaluations of several ``bench/learning.py`` results: Nitro against SB3 over every run.

    python bench/learning_pooled.py learning_ppo.json learning_ppo_hopper_seeds_4_5.json \\
        learning_ppo_walker2d_seeds_4_5.json learning_ppo_intel_2026-11-24.json

Three seeds cannot separate two learners that are within 10-20% of each other, and a seed's run
repeats only on one CPU model: runs of the same seed on another CPU are independent draws. This
takes each run's last evaluation (5 whole episodes, the mean action and sampled actions) from every
file named (under bench/results/), and prints per env and learner the mean and 95% CI over all runs,
Nitro's ratio to SB3 and Welch's t-test p-value for the difference. Writes
bench/results/learning_ppo_pooled.json. Nothing is run: no timing, so it may run beside anything.
"""

from __future__ import annotations

import argparse
import json

from _common import RESULTS

from nitro.tracking.plots import mean_ci95  # setup.sh installs the package into .venv

LEARNERS = ("nitro", "sb3")
MODES = ("deterministic", "stochastic")


def final_evaluations(files: list[str]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """env -> learner -> {"deterministic", "stochastic", "wall_s", "source"}: one entry per run."""
    pooled: dict = {}
    for name in files:
        report = json.loads((RESULTS / name).read_text())
        for env, by_learner in report["envs"].items():
            for learner in LEARNERS:
                for run in by_learner.get(learner, {}).get("runs", []):
                    cell = pooled.setdefault(env, {}).setdefault(learner, {k: [] for k in (*MODES, "wall_s", "source")})
                    for mode in MODES:
                        cell[mode].append(float(run["evals"][-1][mode]))
                    cell["wall_s"].append(float(run["wall_s"]))
                    cell["source"].append(name)
    return pooled


def main() -> None:
    from scipy.stats import ttest_ind

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="result files under bench/results/")
    parser.add_argument("--out", default="learning_ppo_pooled.json")
    args = parser.parse_args()
    summary: dict = {"files": args.files, "envs": {}}
    for env, cells in final_evaluations(args.files).items():
        row: dict = {}
        for learner, cell in cells.items():
            row[learner] = {"runs": len(cell["wall_s"]),
                            "wall_s_mean": round(sum(cell["wall_s"]) / len(cell["wall_s"]), 1),
                            "sources": cell["source"]}  # the file of each run, in the order of "values"
            for mode in MODES:
                mean, half = mean_ci95(cell[mode])
                row[learner][mode] = {"mean": round(mean, 1), "ci95": round(half, 1),
                                      "values": [round(v, 1) for v in cell[mode]]}
            print(f"{env:12s} {learner:5s} {row[learner]['runs']} runs: "
                  + "  ".join(f"{m} {row[learner][m]['mean']:.0f} ± {row[learner][m]['ci95']:.0f}" for m in MODES)
                  + f"  wall {row[learner]['wall_s_mean']:.0f} s")
        if all(name in cells for name in LEARNERS):
            for mode in MODES:
                nitro, sb3 = cells["nitro"][mode], cells["sb3"][mode]
                row.setdefault("nitro_over_sb3", {})[mode] = {
                    "ratio": round(row["nitro"][mode]["mean"] / row["sb3"][mode]["mean"], 3),
                    "welch_p": round(float(ttest_ind(nitro, sb3, equal_var=False).pvalue), 3)}
            row["nitro_over_sb3"]["wall"] = round(row["nitro"]["wall_s_mean"] / row["sb3"]["wall_s_mean"], 3)
            print(f"{env:12s} Nitro / SB3: " + ", ".join(f"{k} {v}" for k, v in row["nitro_over_sb3"].items()))
        summary["envs"][env] = row
    out = RESULTS / args.out
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
