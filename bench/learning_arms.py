"""Compare arms of ``bench/learning.py`` runs with rliable: each arm one learner's runs from named files.

    python bench/learning_arms.py --env Humanoid-v5 --out learning_arms_humanoid_width.json \\
        --arm 'width 2x64=nitro@learning_ppo_trial_hidden_64_humanoid_seeds1234.json,...' \\
        --arm 'defaults=nitro@learning_ppo_humanoid_restore_fix.json,...' \\
        --arm 'SB3=sb3@learning_ppo_wall_compiled_humanoid.json,...'

``bench/learning_pooled.py`` pools Nitro against SB3; this compares any arms, two settings of one
learner included. An arm is ``NAME=LEARNER@FILE,FILE,...`` (files under bench/results/, LEARNER
``nitro`` or ``sb3``), and takes the last evaluation (5 whole episodes) of every run of LEARNER on
``--env`` in those files, with the training curve there (the mean of the last 100 whole training
games) where the run recorded one. It prints, per arm and score (each action mode, and the curve),
each seed's return, the mean and the IQM with rliable's stratified-bootstrap 95% CI, and the first
arm's probability of improvement over each other arm (P(X > Y), with its CI). Writes the same
under bench/results/ (``--out``). Nothing is run: no timing, so it may run beside anything.
"""

from __future__ import annotations

import argparse
import json

from _common import RESULTS

from nitro.experiments.aggregate import format_estimate, improvement_probability, interval

MODES = ("deterministic", "stochastic", "training")


def arm_runs(spec: str, env: str) -> tuple[str, dict]:
    """``NAME=LEARNER@FILE,...`` -> (NAME, {"seeds", "sources", "deterministic", "stochastic"})."""
    name, _, rest = spec.partition("=")
    learner, _, files = rest.partition("@")
    if not (name and learner in ("nitro", "sb3") and files):
        raise SystemExit(f"--arm {spec!r}: expected NAME=LEARNER@FILE,FILE with LEARNER nitro or sb3")
    runs: dict = {"seeds": [], "sources": [], **{mode: [] for mode in MODES}}
    for file in files.split(","):
        report = json.loads((RESULTS / file).read_text())
        for run in report["envs"].get(env, {}).get(learner, {}).get("runs", []):
            runs["seeds"].append(run["seed"])
            runs["sources"].append(file)
            for mode in MODES:
                if run["evals"][-1].get(mode) is not None:  # runs before 2026-11-27 recorded no curve
                    runs[mode].append(round(float(run["evals"][-1][mode]), 1))
    if not runs["seeds"]:
        raise SystemExit(f"--arm {name!r}: no {learner} run on {env} in {files}")
    return name, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True)
    parser.add_argument("--arm", action="append", required=True, help="NAME=LEARNER@FILE,FILE,... (two or more)")
    parser.add_argument("--out", required=True, help="the result file's name under bench/results/")
    args = parser.parse_args()
    arms = dict(arm_runs(spec, args.env) for spec in args.arm)
    first = next(iter(arms))
    modes = [mode for mode in MODES if all(runs[mode] for runs in arms.values())]
    for name, runs in arms.items():
        for mode in modes:
            scores = [[v] for v in runs[mode]]
            runs[f"{mode}_mean"] = interval(scores, "mean").as_dict()
            runs[f"{mode}_iqm"] = interval(scores, "IQM").as_dict()
            if name != first:
                runs[f"{mode}_p_{first}_better"] = improvement_probability(
                    [[v] for v in arms[first][mode]], scores).as_dict()
        print(f"{name}: {len(runs['seeds'])} runs, seeds {runs['seeds']}")
        for mode in modes:
            mean, iqm = (format_estimate(runs[f"{mode}_{stat}"], ".0f") for stat in ("mean", "iqm"))
            line = f"  {mode:13s} {' '.join(f'{v:.0f}' for v in runs[mode])}; mean {mean}, IQM {iqm}"
            if len(runs[mode]) < len(runs["seeds"]):
                line += f" ({len(runs[mode])} of {len(runs['seeds'])} runs)"
            if name != first:
                line += f"; P({first} > {name}) {format_estimate(runs[f'{mode}_p_{first}_better'], '.2f')}"
            print(line)
    out = RESULTS / args.out
    out.write_text(json.dumps({"env": args.env, "arms": arms}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
