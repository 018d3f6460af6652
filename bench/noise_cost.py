"""What goodput's noise measurement costs the update (issue 48: under 5% of it): one PPO update of
the tuned preset on a round of ``--actors`` actors x ``steps_per_actor`` steps, with and without
the fragment gradients (``nitro/learners/fragments.py``), on the same batches, alternated
``--repeats`` times; the medians and their ratio, and the measurement's own ``noise_seconds``.

Usage:  python bench/noise_cost.py [--env Hopper-v5] [--actors 8,16,64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "disable")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench._common import machine
from nitro.actors.rollout import rollout
from nitro.config import NitroConfig
from nitro.learners import PPOLearner, make_learner

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="Hopper-v5")
    parser.add_argument("--actors", default="8,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "noise_cost.json")
    args = parser.parse_args()
    config = NitroConfig.load({"env_id": args.env, "scaler": {"name": "goodput"}})
    torch.set_num_threads(config.torch_threads())
    load_before = os.getloadavg()
    rows = []
    for n in (int(a) for a in args.actors.split(",")):
        learner = make_learner(config)
        assert isinstance(learner, PPOLearner)
        weights = {k: v.numpy() for k, v in learner.weights().items()}
        batches = [rollout(weights, config.env_id, seed=i, n_steps=config.steps_per_actor,
                           arch=config.model.architecture()).batch for i in range(n)]
        times: dict[bool, list[float]] = {False: [], True: []}
        noise_s: list[float] = []
        for _ in range(args.repeats):
            for measure in (False, True):
                fresh = make_learner(config.model_copy(update={
                    "scaler": config.scaler.model_copy(update={"measure_noise": measure})}))
                assert isinstance(fresh, PPOLearner) and fresh.fragment_noise == measure
                start = time.perf_counter()
                result = fresh.update(batches)
                times[measure].append(time.perf_counter() - start)
                if measure:
                    noise_s.append(result.diagnostics["noise_seconds"])
        plain, measured = statistics.median(times[False]), statistics.median(times[True])
        row = {"actors": n, "samples": n * config.steps_per_actor, "update_s": plain, "measured_update_s": measured,
               "ratio": measured / plain, "noise_s": statistics.median(noise_s),
               "noise_share": statistics.median(noise_s) / plain}
        rows.append(row)
        print(f"{args.env} {n:3d} actors: update {plain:.3f} s, with the measurement {measured:.3f} s "
              f"({row['ratio']:.3f}x); the measurement {row['noise_s']:.3f} s = {100 * row['noise_share']:.1f}%")
    out = {"env": args.env, "preset": config.preset, "repeats": args.repeats, "rows": rows,
           "machine": machine(load_before=load_before, load_after=os.getloadavg())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
