"""A short Hopper run with ``scaler=nitro`` and a budget: per-round R, score, actors and spend.

    python bench/boosting_run.py [--rounds 20] [--budget 0.08] [key=value ...]

Shows the actor counts following the boosting score inside [I_min, I_max], and the spend staying
under the budget. The same numbers are in the run's MLflow metrics; this reads them back from
MLflow and writes bench/results/boosting_run.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

from _common import RESULTS, isolated_home, machine, mlflow_uri, run_overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--budget", type=float, default=0.08)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    home = isolated_home("boosting")

    from mlflow.tracking import MlflowClient

    from flows.training import train

    # backend.timeout_s bounds what one actor can cost, which the budget cap has to assume.
    overrides = [*run_overrides(home), "backend.timeout_s=20", *args.overrides]
    started = time.perf_counter()
    result = asyncio.run(train(env_id="Hopper-v5", scaler="nitro", rounds=args.rounds, budget_usd=args.budget,
                               overrides=overrides, run_id="bench-boosting"))
    wall = time.perf_counter() - started
    client = MlflowClient(tracking_uri=mlflow_uri(home))
    names = ("hessian_R", "lambda_max", "lambda_min", "boost_score", "actors_launched", "spend_round_usd",
             "spend_total_usd", "train_return_mean", "detection_s", "round_s")
    series = {n: {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, n)} for n in names}
    rows = [{n: (None if math.isnan(series[n][k]) else round(series[n][k], 6)) for n in names} | {"round": k}
            for k in sorted(series["actors_launched"])]
    actors = [r["actors_launched"] for r in rows]
    summary = {
        "rounds_done": result.rounds_done, "stop_reason": result.stop_reason, "budget_usd": args.budget,
        "spend_usd": result.spend_usd, "actors_min": min(actors), "actors_max": max(actors),
        "distinct_actor_counts": sorted(set(actors)), "wall_s": round(wall, 1), "machine": machine(), "rounds": rows,
    }
    out = RESULTS / "boosting_run.json"
    out.write_text(json.dumps(summary, indent=1))

    def fmt(v: float | None, f: str) -> str:
        return "-" if v is None else format(v, f)

    print(f"{'round':>5} {'R':>9} {'score':>7} {'actors':>6} {'spend':>9} {'return':>8}")
    for r in rows:
        print(f"{r['round']:>5} {fmt(r['hessian_R'], '9.4f')} {fmt(r['boost_score'], '7.3f')} "
              f"{int(r['actors_launched']):>6} {r['spend_total_usd']:>9.5f} {fmt(r['train_return_mean'], '8.1f')}")
    print(f"stopped by {result.stop_reason} after {result.rounds_done} rounds; spent ${result.spend_usd:.5f} "
          f"of ${args.budget}; actors in [{min(actors)}, {max(actors)}]; wrote {out}")


if __name__ == "__main__":
    main()
