"""One PPO update of the Atari learner (the paper's CNN, policy and critic) on the CPU, timed.

    python bench/cnn_update.py --label after --out cnn_update_pad.json   # 6 updates of 1024 Qbert frames

The batch is what a round of the 1M-frame runs trains on (docs/results/learning-vs-sb3): 2
actors x 512 steps over 4 games each, rolled out once with the learner's start weights. One
untimed update, then ``--updates`` timed ones; prints their median. To compare two versions of
the code, run it on each, alternating, on a quiet host, and compare the medians pair by pair:
the host's noise is larger than a run's spread. Appends the run, under its label, to
bench/results/<--out>.
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
    config = NitroConfig.load({"env_id": args.env, "learner_threads": args.threads, "steps_per_actor": 512,
                               "envs_per_actor": 4})
    batches = batches_for(config, actors=2)
    learner = make_learner(config)
    load_before = os.getloadavg()
    learner.update(batches)  # untimed: the allocator's and the kernels' first calls
    seconds = []
    for _ in range(args.updates):
        started = time.perf_counter()
        learner.update(batches)
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    print(f"{args.env} update of {sum(len(b['rewards']) for b in batches)} frames on {args.threads} threads: "
          f"median {median:.3f} s of {[round(s, 3) for s in seconds]}")
    out = RESULTS / args.out
    report = json.loads(out.read_text()) if out.exists() else {"benchmark": "cnn_update", "runs": []}
    report["runs"].append({"label": args.label, "env": args.env, "threads": args.threads, "update_s": seconds,
                           "median_s": median, "machine": machine(load_avg_before=load_before,
                                                                  load_avg_after=os.getloadavg())})
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
