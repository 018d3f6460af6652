"""Off-policy overlap: how much learner idle time the asynchronous IMPACT round removes.

    python bench/impact_overlap.py [--rounds 8] [--actors 8]

Runs IMPACT on Hopper twice in one process, asynchronously (the update overlaps the actors,
replaying while the cache is empty) and synchronously (update on the previous round's batches,
then act), and reports the learner's idle share of round wall time for each. Writes
bench/results/impact_overlap.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from _common import RESULTS, isolated_home, machine, run_overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--actors", type=int, default=8)
    args = parser.parse_args()
    home = isolated_home("impact-overlap")

    from flows.training import train
    from nitro.run.rundir import RunDir

    out = {"rounds": args.rounds, "actors": args.actors, "machine": machine()}
    for mode in ("asynchronous", "synchronous"):
        run_id = f"impact-{mode}"
        asyncio.run(train(env_id="Hopper-v5", algo="impact", scaler="fixed", rounds=args.rounds, run_id=run_id,
                          overrides=[*run_overrides(home), f"scaler.fixed_actors={args.actors}",
                                     f"impact.asynchronous={mode == 'asynchronous'}"]))
        _, state = RunDir(home, run_id).load()
        rows = state["history"][1:]  # round 0 of the synchronous run has nothing to learn from
        busy = [r["learner_s"] for r in rows]
        wall = [r["round_s"] for r in rows]
        idle = [1 - b / w for b, w in zip(busy, wall)]
        out[mode] = {"round_s_median": statistics.median(wall), "learner_busy_s_median": statistics.median(busy),
                     "learner_idle_share_median": statistics.median(idle),
                     "updates_per_round": statistics.median(r.get("impact/updates", 1.0) for r in rows),
                     "replay_updates_per_round": statistics.median(r.get("impact/replay_updates", 0.0) for r in rows),
                     "return_last": rows[-1]["train_return_mean"]}
    a, s = out["asynchronous"], out["synchronous"]
    out["idle_share_removed"] = s["learner_idle_share_median"] - a["learner_idle_share_median"]
    (RESULTS / "impact_overlap.json").write_text(json.dumps(out, indent=1))
    for mode in ("asynchronous", "synchronous"):
        m = out[mode]
        print(f"{mode:>12}: round {m['round_s_median']:.2f} s, learner busy {m['learner_busy_s_median']:.2f} s, "
              f"idle {100 * m['learner_idle_share_median']:.0f}% of the round, "
              f"{m['updates_per_round']:.0f} updates + {m['replay_updates_per_round']:.0f} replays per round")
    print(f"the overlap removes {100 * out['idle_share_removed']:.0f} points of learner idle time "
          f"({100 * s['learner_idle_share_median']:.0f}% -> {100 * a['learner_idle_share_median']:.0f}%)")


if __name__ == "__main__":
    main()
