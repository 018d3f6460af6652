"""A learner function's snapshot loads per job on one warm instance: the fixed 8-entry cache it had
against one sized to the live set (``function.snapshots_kept``: twice what a job reads).

Hopper-v5 snapshots of the default [256, 256] networks, 21 live versions per job and the versions
moving on by one every second job: the picture of the 64-actor boost bench (issue 47), where each
job grew from about 36 ms to about 240 ms. Snapshots come from memory, so this is decode time only
(a Redis fetch adds to each miss).

    .venv/bin/python bench/stellaris_snapshot_cache.py --out bench/results/stellaris_snapshot_cache.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nitro.actors.worker import ActorState
from nitro.envs import env_spec
from nitro.models import Architecture
from nitro.models.networks import build_critic, build_policy
from nitro.stellaris.function import Profile, cached_snapshot, snapshots_kept
from nitro.stellaris.gradient import LossSettings
from nitro.stellaris.jobs import GradientJob
from nitro.stellaris.wire import snapshot_payload

LIVE, JOBS = 21, 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec, arch = env_spec("Hopper-v5"), Architecture(hidden=(256, 256))
    settings = LossSettings(0.99, 0.95, 1.0, 0.2, 0.2, 0.0, 10.0, 1.0, True, 1.0)
    policy, critic = build_policy(spec, 0, arch), build_critic(spec, 0, arch)
    store = {f"v{v}": snapshot_payload(policy, critic, env_id=spec.env_id, version=v, arch=arch, settings=settings)
             for v in range(JOBS // 2 + LIVE + 2)}

    class Memory:
        def fetch_weights(self, key: str) -> bytes:
            return store[key]

    def job(j: int) -> GradientJob:
        return GradientJob(run_id="bench", round=1, invocation_id=f"bench-g{j}", job=j, env_id=spec.env_id,
                           snapshot_key=f"v{j // 2}", snapshot_version=j // 2, behaviour_key="w",
                           live_keys=[f"v{j // 2 + 1 + i}" for i in range(LIVE)], actor_id="a", batch_key="b",
                           seed=0, epoch=0, slice=0, slice_samples=256, cache_url="redis://unused")

    rows = []
    for label in ("fixed 8", "sized to the live set"):
        state, profile = ActorState(), Profile()
        start = time.perf_counter()
        for j in range(JOBS):
            kept = 8 if label == "fixed 8" else snapshots_kept(job(j))
            for key in [job(j).snapshot_key, *job(j).live_keys]:
                cached_snapshot(state, Memory(), key, spec, kept, profile)
        rows.append({"cache": label, "kept": 8 if label == "fixed 8" else snapshots_kept(job(0)),
                     "load_ms_per_job": 1000 * (time.perf_counter() - start) / JOBS,
                     "decode_ms_per_job": 1000 * profile.seconds["decode_s"] / JOBS})
        print(rows[-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"snapshot_bytes": len(store["v0"]), "live_versions": LIVE, "jobs": JOBS, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
