"""One PPO update of the Atari learner (the paper's CNN, policy and critic) on the CPU, timed.

    python bench/cnn_update.py --label after --out cnn_update_pad.json   # 6 updates of 1024 Qbert frames
    python bench/cnn_update.py --label trunk --out cnn_update_shared_trunk.json \
        separate=model.shared_trunk=false shared=model.shared_trunk=true  # two arms, alternated

The batch is what a round of the 1M-frame runs trains on (docs/results/learning-vs-sb3): 2
actors x 512 steps over 4 games each, rolled out once with the learner's start weights. Each arm
(``NAME=OVERRIDE,...``, config overrides; one arm of the defaults when none is given) has its own
learner; one untimed update each, then ``--updates`` timed rounds, each timing one update of every
arm in turn, so that the host's drift falls on all arms alike. Prints each arm's median, and with
several arms each one's median ratio to the first's. To compare two versions of the code, run it
on each, alternating, on a quiet host. Appends the run, under its label, to bench/results/<--out>.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _common import RESULTS, ROOT, machine

sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arms", nargs="*", default=["default="], help="NAME=OVERRIDE,OVERRIDE (config overrides)")
    parser.add_argument("--env", default="ALE/Qbert-v5")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--label", required=True, help="what this run measures (say, the code's version)")
    parser.add_argument("--out", default="cnn_update.json", help="file under bench/results/ the run is appended to")
    args = parser.parse_args()

    import torch
    from gpu_timing import batches_for

    from nitro.config import NitroConfig
    from nitro.learners import make_learner

    torch.set_num_threads(args.threads)
    base = {"env_id": args.env, "learner_threads": args.threads, "steps_per_actor": 512, "envs_per_actor": 4}
    specs: dict[str, str] = {}
    for arm in args.arms:
        name, _, overrides = arm.partition("=")
        if name in specs:
            raise SystemExit(f"cnn_update: two arms are named {name!r}; name each arm once")
        specs[name] = overrides
    arms = {name: NitroConfig.load(base, [o for o in overrides.split(",") if o]) for name, overrides in specs.items()}
    batches = batches_for(next(iter(arms.values())), actors=2)  # the batches do not depend on the critic
    learners = {name: make_learner(config) for name, config in arms.items()}
    load_before = os.getloadavg()
    for learner in learners.values():
        learner.update(batches)  # untimed: the allocator's and the kernels' first calls
    seconds: dict[str, list[float]] = {name: [] for name in learners}
    for _ in range(args.updates):
        for name, learner in learners.items():
            started = time.perf_counter()
            learner.update(batches)
            seconds[name].append(time.perf_counter() - started)
    frames = sum(len(b["rewards"]) for b in batches)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    first = next(iter(medians.values()))
    for name, s in seconds.items():
        print(f"{args.env} update of {frames} frames on {args.threads} threads, {name}: median {medians[name]:.3f} s "
              f"({medians[name] / first:.2f}x {next(iter(medians))}) of {[round(x, 3) for x in s]}")
    out = RESULTS / args.out
    report = json.loads(out.read_text()) if out.exists() else {"benchmark": "cnn_update", "runs": []}
    machine_info = machine(load_avg_before=load_before, load_avg_after=os.getloadavg())
    for name, s in seconds.items():
        report["runs"].append({"label": args.label if len(seconds) == 1 else f"{args.label}: {name}",
                               "arm": f"{name}={specs[name]}", "env": args.env, "threads": args.threads,
                               "update_s": s, "median_s": medians[name], "machine": machine_info})
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
