"""How far Nitro's PPO updates move the policy, one setting at a time, outside the pipeline.

    python bench/update_size.py --label defaults
    python bench/update_size.py --label width_256 "model.hidden=[256,256]"
    python bench/update_size.py --label one_actor_2048 --actors 1 steps_per_actor=2048

Each run builds the learner of a config (``env_id`` Humanoid-v5 unless overridden, seed 5, eager
PyTorch), and for ``--updates`` rounds lets ``--actors`` rollouts continue their episodes from the
round before (``rollout``'s carry, as the pipeline's actors do) with the learner's published
weights, then runs one ``update`` on them. It reports the mean over the updates of the clip
fraction (the share of an update's samples whose probability ratio left 1 +- clip), the mean over
an update's minibatches of the exact KL from the pre-update policy, and the last update's standard
deviation. The same start and the same rollout seeds for every setting, so settings compare one
change at a time. The first 18 updates of 2x256 networks (Humanoid's default until 2026-11-30, now
2x64: ``TASK_PRESETS`` in nitro/config/presets.py) in a full run clipped 0.688-0.689 at a KL of
0.084 (docs/results/learning-vs-sb3); this script gives 0.691 / 0.085.

Appends its result to bench/results/update_size_<env>.json, by label.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from _common import RESULTS, ROOT, machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="the setting's name in the results file")
    ap.add_argument("--actors", type=int, default=8)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from nitro.actors.rollout import rollout
    from nitro.config import NitroConfig
    from nitro.learners import make_learner
    from nitro.learners.contract import Progress

    torch.set_num_threads(1)
    config = NitroConfig.load(overrides=["env_id=Humanoid-v5", "seed=5", "learner_compile=false", *args.overrides])
    learner, arch = make_learner(config), config.model.architecture()
    carries: list[list] = [[] for _ in range(args.actors)]
    load_before, started = os.getloadavg(), time.perf_counter()
    rows = []
    for k in range(args.updates):
        weights = {name: t.numpy() for name, t in learner.weights().items()}
        batches = []
        for a in range(args.actors):
            got = rollout(weights, config.env_id, seed=1000 * k + a, n_steps=config.steps_per_actor,
                          resume=carries[a], arch=arch)
            carries[a] = got.carry
            batches.append(got.batch)
        d = learner.update(batches, progress=Progress(round=k + 1, rounds=args.updates + 1)).diagnostics
        rows.append((d["clip_frac"], d["kl_minibatch_mean"], d.get("action_std", float("nan"))))
    a = np.array(rows)
    result = {"actors": args.actors, "steps_per_actor": config.steps_per_actor, "overrides": args.overrides,
              "updates": args.updates, "clip_frac": round(float(a[:, 0].mean()), 4),
              "kl": round(float(a[:, 1].mean()), 5),
              "action_std_last": round(float(a[-1, 2]), 4), "seconds": round(time.perf_counter() - started, 1),
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    print(json.dumps({"label": args.label, **result}), flush=True)
    out = RESULTS / f"update_size_{config.env_id.replace('/', '_')}.json"
    report = json.loads(out.read_text()) if out.exists() else {"settings": {}}
    report["settings"][args.label] = result
    report["machine"] = machine()
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
