"""Where a round's time goes: the actor's step, the learner's update, and the whole round.

    python bench/round_profile.py                 # Hopper-v5, Nitro's defaults, 8 local actors
    python bench/round_profile.py --rounds 12 key=value ...
    python bench/round_profile.py --env Humanoid-v5 --out round_profile_humanoid.json

Three measurements, each alone in this process, on the same machine (run it on a quiet one):

1. One actor step, split: ``env.step`` against the policy's action, with the numpy policy actors
   use and with the torch module (what an actor ran before), per step in microseconds.
2. One learner update on 8 real batches, with cProfile: the top functions by cumulative time.
3. A short real run through the pipeline (``nitro train``'s flow: Prefect, Redis, MLflow, local
   actors) with the median per-round split into learner, detection, actors and orchestration.

Writes bench/results/round_profile.json (``--out``: another name).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import time

from _common import RESULTS, isolated_home, machine, run_overrides


def step_costs(env_id: str, overrides: list[str], steps: int = 3000) -> dict:
    import numpy as np
    import torch

    from nitro.config import NitroConfig
    from nitro.envs import env_spec, make_env
    from nitro.models.acting import acting_policy
    from nitro.models.networks import build_policy

    torch.set_num_threads(1)
    cfg = NitroConfig.load(overrides=[f"env_id={env_id}", *overrides])
    arch = cfg.model.architecture()
    policy = build_policy(env_spec(env_id), seed=0, arch=arch).eval()
    fast = acting_policy(env_spec(env_id), arch, {k: v.numpy() for k, v in policy.state_dict().items()})
    env = make_env(env_id, seed=0)
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    observations, t_env = [], time.perf_counter()
    for _ in range(steps):
        observations.append(obs)
        obs, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            obs, _ = env.reset()
    t_env = time.perf_counter() - t_env
    out = {"env_step_us": 1e6 * t_env / steps}
    for name, actor in (("numpy", fast), ("torch", policy)):
        t = time.perf_counter()
        for o in observations:
            actor.sample(np.asarray(o), rng)
        out[f"policy_sample_{name}_us"] = 1e6 * (time.perf_counter() - t) / steps
    return out


def update_profile(env_id: str, overrides: list[str], actors: int) -> dict:
    import torch

    from nitro.actors.rollout import rollout
    from nitro.config import NitroConfig
    from nitro.learners import make_learner

    torch.set_num_threads(1)
    cfg = NitroConfig.load(overrides=[f"env_id={env_id}", *overrides])
    learner = make_learner(cfg)
    weights = {k: v.numpy() for k, v in learner.weights().items()}
    batches = [rollout(weights, env_id, i, cfg.steps_per_actor, arch=cfg.model.architecture()).batch
               for i in range(actors)]
    learner.update(batches)  # warm-up: first-update statistics, allocator
    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.enable()
    metrics = learner.update(batches).diagnostics
    profiler.disable()
    seconds = time.perf_counter() - t
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    return {"update_s": seconds, "samples": int(metrics["n_samples"]), "profile_top25": text.getvalue()}


def pipeline_rounds(env_id: str, overrides: list[str], actors: int, rounds: int) -> dict:
    from flows.training import train
    from nitro.run.rundir import RunDir

    home = isolated_home("round-profile")
    result = asyncio.run(train(env_id=env_id, rounds=rounds, seed=1, run_id="bench-round-profile", overrides=[
        *run_overrides(home), "scaler.name=fixed", f"scaler.fixed_actors={actors}", *overrides]))
    _, state = RunDir(home, "bench-round-profile").load()
    steady = state["history"][2:]  # round 0 has no update; round 1 is the first (statistics) update
    keys = ("round_s", "learner_s", "detection_s", "actor_s", "orchestration_s")
    med = {k: statistics.median(r[k] for r in steady) for k in keys}
    return {"rounds": result.rounds_done, "median": med,
            "shares": {k: med[k] / med["round_s"] for k in keys if k != "round_s"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="Hopper-v5")
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="round_profile.json", help="file under bench/results/")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    isolated_home("round-profile-setup")
    load_before = os.getloadavg()
    report = {"env": args.env, "actors": args.actors, "overrides": args.overrides, "load_average_before": load_before,
              "step": step_costs(args.env, args.overrides),
              "update": update_profile(args.env, args.overrides, args.actors),
              "pipeline": pipeline_rounds(args.env, args.overrides, args.actors, args.rounds),
              "load_average_after": os.getloadavg(), "machine": machine()}
    out = RESULTS / args.out
    out.write_text(json.dumps(report, indent=1))
    s, u, p = report["step"], report["update"], report["pipeline"]
    print(f"actor step: env.step {s['env_step_us']:.0f} us, policy numpy {s['policy_sample_numpy_us']:.0f} us "
          f"(torch {s['policy_sample_torch_us']:.0f} us)")
    print(f"update of {u['samples']} samples: {u['update_s']:.2f} s")
    print("steady round (median): " + ", ".join(f"{k} {v:.2f} s" for k, v in p["median"].items()))
    print(f"load average before {load_before}, after {report['load_average_after']}; wrote {out}")


if __name__ == "__main__":
    main()
