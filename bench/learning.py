"""Learning curve: train with local actors through the real pipeline and record return vs steps.

    python bench/learning.py                       # PPO on Hopper-v5, 369k steps, about 15 minutes on 2 cores
    python bench/learning.py --rounds 10 --algo ppo key=value ...

Runs the same flow as ``nitro train`` (Prefect, Redis, MLflow) with a fixed number of actors, so
the curve measures the learner and the actors, not the scaler. Writes
bench/results/learning_<algo>_<env>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

from _common import RESULTS, isolated_home, machine, run_overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="ppo")
    parser.add_argument("--env", default="Hopper-v5")
    parser.add_argument("--rounds", type=int, default=90)
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--steps", type=int, default=512, help="steps per actor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="extra config overrides, key=value")
    args = parser.parse_args()

    home = isolated_home("learning")

    from flows.training import train
    from nitro.checkpoint import load_checkpoint

    overrides = [
        *run_overrides(home), "scaler.name=fixed",
        f"scaler.fixed_actors={args.actors}", f"steps_per_actor={args.steps}", "detector.enabled=false",
        *args.overrides,
    ]
    started = time.perf_counter()
    result = asyncio.run(train(env_id=args.env, algo=args.algo, rounds=args.rounds, seed=args.seed,
                               overrides=overrides, run_id="bench-learning"))
    wall = time.perf_counter() - started
    _, state = load_checkpoint(home, "bench-learning")
    curve = [{"round": int(r["round"]), "env_steps_total": int(r["env_steps_total"]),
              "return_mean": None if math.isnan(r["return_mean"]) else round(r["return_mean"], 2)}
             for r in state["history"]]
    returns = [c["return_mean"] for c in curve if c["return_mean"] is not None]
    first, last = returns[:5], returns[-5:]
    summary = {
        "algo": args.algo, "env": args.env, "rounds": result["rounds_done"], "actors": args.actors,
        "steps_per_actor": args.steps, "seed": args.seed, "overrides": args.overrides,
        "env_steps": curve[-1]["env_steps_total"] if curve else 0, "wall_s": round(wall, 1),
        "return_first5_mean": round(sum(first) / len(first), 1) if first else None,
        "return_last5_mean": round(sum(last) / len(last), 1) if last else None,
        "return_best": max(returns) if returns else None,
        "machine": machine(),
        "curve": curve,
    }
    out = RESULTS / f"learning_{args.algo}_{args.env.replace('/', '_')}.json"
    out.write_text(json.dumps(summary, indent=1))
    print(f"{args.algo} on {args.env}: {summary['env_steps']} env steps in {wall:.0f} s; "
          f"mean return first 5 rounds {summary['return_first5_mean']}, last 5 rounds {summary['return_last5_mean']}, "
          f"best round {summary['return_best']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
