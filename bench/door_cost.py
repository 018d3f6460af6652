"""Benchmark of the learner's door: what the plausibility checks cost per batch, against one PPO
update on the same batches (Hopper-v5, the default 2x256 policy, the `nitro` preset's PPO).

Per batch (real rollouts of the run's policy, `--actors` x `--steps` steps):
  * the full door: decode + shape/finite checks + stated bounds (nitro/validation.py),
  * the bounds alone (nitro.validation.check_bounds),
  * the recomputed behaviour log-probabilities: one forward pass (nitro/learners/behaviour.py),
and one `PPOLearner.update` on all the round's batches, so the door's share of an update is read
off directly. One torch thread, as the learner runs.

Usage:  python bench/door_cost.py [--actors 8] [--steps 256] [--repeats 20] [--out bench/results/door_cost.json]
Takes well under a minute; run it on a quiet machine.
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
from _common import RESULTS, machine

from nitro.actors.rollout import rollout
from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.learners import PPOLearner
from nitro.learners.behaviour import BehaviourPolicies
from nitro.serialization import dumps_tensors
from nitro.validation import bounds_for, check_bounds, decode_batch_meta

ENV = "Hopper-v5"


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS / "door_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    config = NitroConfig.from_yaml(None, [f"env_id={ENV}", f"steps_per_actor={args.steps}"])
    spec, arch = env_spec(ENV), config.model.architecture()
    learner = PPOLearner(spec, config.ppo, seed=0, arch=arch)
    weights = learner.weights()
    policy_bytes = dumps_tensors(weights, {"format": "nitro.policy/1", "env_id": ENV, "version": 0,
                                           "arch": arch.to_meta()})
    batches = [rollout(policy_bytes, ENV, seed=i, n_steps=args.steps).batch for i in range(args.actors)]
    payloads = [dumps_tensors(b, {"format": "nitro.batch/1", "env_id": ENV, "weights_version": 0}) for b in batches]
    bounds = bounds_for(spec, config.door)
    behaviour = BehaviourPolicies(spec, arch, atol=config.door.logp_atol, rtol=config.door.logp_rtol)
    behaviour.remember(0, weights)

    def door() -> None:
        for p in payloads:
            arrays, meta = decode_batch_meta(p, spec, args.steps, None, bounds)
            behaviour.check(arrays, int(meta["weights_version"]))

    def decode_and_bounds() -> None:
        for p in payloads:
            decode_batch_meta(p, spec, args.steps, None, bounds)

    def bounds_only() -> None:
        for b in batches:
            check_bounds(b, spec, bounds)

    def logp_only() -> None:
        for b in batches:
            behaviour.check(b, 0)

    per_batch = {name: _median_ms(fn, args.repeats) / args.actors
                 for name, fn in (("door_ms", door), ("decode_and_bounds_ms", decode_and_bounds),
                                  ("bounds_ms", bounds_only), ("recomputed_logp_ms", logp_only))}
    update_s = []
    for _ in range(3):
        fresh = PPOLearner(spec, config.ppo, seed=0, arch=arch)
        t0 = time.perf_counter()
        fresh.update(batches)
        update_s.append(time.perf_counter() - t0)
    update_ms = 1000 * statistics.median(update_s)
    door_round_ms = per_batch["door_ms"] * args.actors
    result = {
        "env_id": ENV, "actors": args.actors, "steps_per_actor": args.steps, "repeats": args.repeats,
        "per_batch_ms": per_batch, "ppo_update_ms": update_ms, "door_round_ms": door_round_ms,
        "door_share_of_update": door_round_ms / update_ms,
        "recomputed_logp_share_of_update": per_batch["recomputed_logp_ms"] * args.actors / update_ms,
        "machine": machine(loadavg=os.getloadavg()),
    }
    for name, ms in per_batch.items():
        print(f"{name:>22}: {ms:8.3f} ms per batch of {args.steps} steps")
    print(f"{'PPO update':>22}: {update_ms:8.1f} ms on {args.actors} batches ({args.actors * args.steps} samples)")
    print(f"{'door / update':>22}: {100 * result['door_share_of_update']:.2f}% "
          f"(recomputed log-probs alone {100 * result['recomputed_logp_share_of_update']:.2f}%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
