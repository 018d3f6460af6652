"""Stellaris against the synchronous PPO learner, at equal spend on the Lambda-projected clock.

    python bench/stellaris.py                               # everything below (about an hour on 2 cores)
    python bench/stellaris.py --part main --seeds 2 --rounds 10    # a quick look

Every run is ``nitro train`` (a Prefect flow per round, local Redis, warm local workers running the
actors and the learner functions) with the tuned preset, 8 fixed actors of 256 steps, the
Lambda-projected clock, and an evaluation every ``--eval-every`` rounds (5 whole episodes with the
mean action, 5 with sampled actions).

Parts:

* ``main``: ``sync`` (the tuned PPO learner: 10 epochs of 64-sample minibatches, 320 Adam steps a
  round) and ``stellaris`` (the defaults: 256-sample slices, 10 passes, 80 gradients a round, half
  a learner function per actor) on Hopper-v5 and Walker2d-v5, ``--seeds`` seeds each. A Stellaris
  round costs less (its parameter server is a c5.large, its functions are billed per use), so it
  runs ``--stellaris-factor`` x the rounds; both are then compared at the same spend S, the
  smallest total spend of any run of the env: each run's return is its last evaluation at a
  cumulative spend <= S.
* ``ablations`` (Hopper-v5, ``--ablation-seeds`` seeds): ``stellaris-no-trunc``
  (``learner.is_truncation=false``), ``stellaris-uniform`` (``learner.weighting=none``, what the
  official code does) and ``sync-80`` (the sync learner with 256-sample minibatches: 80 Adam
  steps a round, Stellaris's count, so update count is not confounded with asynchrony).
* ``boost``: two rounds of 8, 16, 32 and 64 actors for sync and stellaris; round 1's learner time
  on the projected clock: sync's update (it runs alone on the learner) and Stellaris's learning
  window, from the first batch's landing to the last gradient's application (the schedule
  replayed with the measured durations, and never shorter than the parameter server's busy time).
  ``--measured`` adds ``stellaris-measured`` (``learner.schedule=measured``: the staleness the
  local workers' real arrivals make, against the seeded schedule's); ``--lingers 0.05 1`` adds
  ``stellaris-linger-<x>`` (``learner.lane_linger_s``: a lane's invocation waits that long for its
  next job). Every row has the round's Lambda bill (``lambda_usd``: actors and learner functions,
  compute and requests). Each Stellaris row carries
  where the parameter server's busy time went (``stellaris_server_*``) and a job's mean seconds by
  part (``stellaris_job_*``).
* ``server``: the parameter server's own work for the boost sizes, alone on the host (no
  functions, no flow): read and check each gradient, one step and one version per group.

Stated before running: the return thresholds for time-to-threshold are 400 on Hopper-v5 and 300
on Walker2d-v5 (mean-action evaluations); time is the cumulative projected round time at the first
evaluation at or above the threshold. Writes bench/results/stellaris_<part>.json with every run's
rounds; prints the summaries. Run it alone on the machine (it records the load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time

import numpy as np
from _common import RESULTS, isolated_home, machine, run_overrides

from nitro.experiments.aggregate import improvement_probability
from nitro.experiments.stats import ratio_ci, time_to_threshold

PROFILE = ("ppo/stellaris_server_", "ppo/stellaris_job_")  # where the parameter server's and a job's time goes
THRESHOLDS = {"Hopper-v5": 400.0, "Walker2d-v5": 300.0}
ARMS = {
    "sync": [],
    "stellaris": ["learner.mode=stellaris"],
    "stellaris-measured": ["learner.mode=stellaris", "learner.schedule=measured"],
    "stellaris-no-trunc": ["learner.mode=stellaris", "learner.is_truncation=false"],
    "stellaris-uniform": ["learner.mode=stellaris", "learner.weighting=none"],
    "sync-80": ["ppo.minibatch_size=256"],
}


def run(env_id: str, arm: str, seed: int, rounds: int, extra: list[str], tag: str) -> dict:
    """One training run; its rounds as the checkpoint's history holds them."""
    from flows.training import train
    from nitro.run.rundir import RunDir

    home = isolated_home(f"stellaris-{tag}-{seed}")
    run_id = f"bench-{tag}-{env_id.split('-')[0].lower()}-{arm}-{seed}"
    started = time.perf_counter()
    asyncio.run(train(env_id=env_id, rounds=rounds, seed=seed, run_id=run_id, overrides=[
        *run_overrides(home), "clock.kind=lambda", *ARMS[arm], *extra]))
    _, state = RunDir(home, run_id).load()
    keep = ("round", "spend_round_usd", "round_lambda_s", "round_s", "learner_s", "actor_s", "eval_return_mean",
            "eval_stochastic_return_mean", "ppo/stellaris_staleness_mean", "ppo/stellaris_projected_s",
            "ppo/stellaris_gradients_lost", "ppo/stellaris_learning_s", "ppo/sgd_steps", "ppo/stellaris_versions",
            "spend_learner_usd", "spend_lambda_compute_usd", "spend_requests_usd")
    rows = [{k: r.get(k) for k in keep} | {k: v for k, v in r.items() if k.startswith(PROFILE)}
            for r in state["history"]]
    print(f"  {env_id} {arm} seed {seed}: {len(rows)} rounds in {time.perf_counter() - started:.0f} s, "
          f"spend ${sum(r['spend_round_usd'] for r in rows):.4f}", flush=True)
    return {"env_id": env_id, "arm": arm, "seed": seed, "rounds": rows, "wall_s": time.perf_counter() - started}


def at_spend(rows: list[dict], spend: float, key: str) -> float:
    """The run's last evaluation whose cumulative spend is <= ``spend``."""
    total, last = 0.0, math.nan
    for r in rows:
        total += r["spend_round_usd"]
        value = r.get(key)
        if total <= spend + 1e-12 and value is not None and not math.isnan(value):
            last = value
    return last


def mean_ci(values: list[float]) -> dict:
    x = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    if len(x) == 0:
        return {"mean": math.nan, "ci95": math.nan, "n": 0}
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.nan
    return {"mean": float(x.mean()), "ci95": half, "n": len(x)}


def compare(runs: list[dict], arms: list[str], base: str) -> dict:
    """Per env: every arm's return at the common spend (both evaluation modes) and its time to the
    threshold, and each arm's ratio to ``base`` (arch's bootstrap CI) and its probability of
    improvement over ``base`` at mean action (rliable's, with its CI)."""
    out = {}
    for env_id in sorted({r["env_id"] for r in runs}):
        env_runs = [r for r in runs if r["env_id"] == env_id and r["arm"] in arms]
        spend = min(sum(x["spend_round_usd"] for x in r["rounds"]) for r in env_runs)
        per_arm = {}
        for arm in arms:
            mine = [r for r in env_runs if r["arm"] == arm]
            det = [at_spend(r["rounds"], spend, "eval_return_mean") for r in mine]
            sto = [at_spend(r["rounds"], spend, "eval_stochastic_return_mean") for r in mine]
            times = [time_to_threshold(r["rounds"], THRESHOLDS[env_id], clock="round_lambda_s") for r in mine]
            per_arm[arm] = {"return_mean_action": mean_ci(det), "return_sampled": mean_ci(sto),
                            "returns_mean_action": det, "returns_sampled": sto,
                            "time_to_threshold_s": times, "reached": sum(math.isfinite(t) for t in times),
                            "rounds": [len(r["rounds"]) for r in mine],
                            "spend_usd": [sum(x["spend_round_usd"] for x in r["rounds"]) for r in mine]}
        for arm in arms:
            if arm != base:
                mine_det, base_det = per_arm[arm]["returns_mean_action"], per_arm[base]["returns_mean_action"]
                per_arm[arm]["return_ratio_to_" + base] = ratio_ci(mine_det, base_det)
                # rliable's probability of improvement: a seed of this arm above a seed of base's
                mine_ok, base_ok = [v for v in mine_det if math.isfinite(v)], [v for v in base_det if math.isfinite(v)]
                per_arm[arm]["improvement_over_" + base] = (
                    improvement_probability(mine_ok, base_ok).as_dict() if mine_ok and base_ok else None)
                a, b = per_arm[arm]["time_to_threshold_s"], per_arm[base]["time_to_threshold_s"]
                per_arm[arm]["time_ratio_to_" + base] = ratio_ci(a, b) if all(map(math.isfinite, a + b)) else \
                    {"ratio": math.nan, "note": "not every run reached the threshold"}
        out[env_id] = {"common_spend_usd": spend, "threshold": THRESHOLDS[env_id], "arms": per_arm}
    return out


def boost(args: argparse.Namespace) -> dict:
    rows = []
    lingers = [f"stellaris-linger-{x:g}" for x in args.lingers]
    ARMS.update({arm: ["learner.mode=stellaris", f"learner.lane_linger_s={x}"]
                 for arm, x in zip(lingers, args.lingers)})
    for n in args.boost:
        for arm in ("sync", "stellaris", *(("stellaris-measured",) if args.measured else ()), *lingers):
            r = run("Hopper-v5", arm, 0, 2, ["scaler.name=fixed", f"scaler.fixed_actors={n}", "eval.every_rounds=0",
                                             f"scaler.i_max={max(64, n)}"], f"boost{n}")
            last = r["rounds"][-1]  # round 1: sync updates on round 0's samples; stellaris learns beside its actors
            # sync: its update, alone on the learner; stellaris: from the first batch's landing to the
            # last gradient's application (the functions and the parameter server), projected
            learner = last["learner_s"] if arm == "sync" else last["ppo/stellaris_learning_s"]
            rows.append({"actors": n, "arm": arm, "learner_projected_s": learner,
                         "round_lambda_s": last["round_lambda_s"], "learner_busy_s": last["learner_s"],
                         "staleness_mean": last.get("ppo/stellaris_staleness_mean"),
                         "sgd_steps": last.get("ppo/sgd_steps"), "versions": last.get("ppo/stellaris_versions"),
                         "lambda_usd": last["spend_lambda_compute_usd"] + last["spend_requests_usd"]}
                        | {k.removeprefix("ppo/"): v for k, v in last.items() if k.startswith(PROFILE)})
            print(f"  boost {n} {arm}: learner {learner:.2f} s, round {last['round_lambda_s']:.2f} s, "
                  f"Lambda ${rows[-1]['lambda_usd']:.6f}", flush=True)
    base = {arm: next(r["learner_projected_s"] for r in rows if r["arm"] == arm and r["actors"] == args.boost[0])
            for arm in {r["arm"] for r in rows}}
    for r in rows:
        r["ratio_to_smallest"] = r["learner_projected_s"] / base[r["arm"]] if base[r["arm"]] else math.nan
    return {"rows": rows}


def server_alone(args: argparse.Namespace) -> dict:
    """The parameter server's own work for a boosted round, alone on the host: what the boost
    part's ``stellaris_server_*`` figures cost without the functions, Redis's other clients and
    the flow's tasks beside it on the same cores. For each size, ``--server-groups`` (the groups
    the boost part's seeded arm applied): the round's gradients (random, Hopper's shapes, 256
    samples each) stored in the engine's Redis (a ``LocalRedisServer`` with its defaults), then
    timed as the server takes them: read and checked at the door, one step per group, one
    published version per group. Not included: each batch's door check (once an actor) and the
    closing merge of statistics (``stellaris_server_closing_s`` in the boost part)."""
    import tempfile

    import torch

    from nitro.cache import TrajectoryCache, connect_redis
    from nitro.cache.server import LocalRedisServer
    from nitro.config import NitroConfig
    from nitro.envs import env_spec
    from nitro.learners import Progress
    from nitro.learners.ppo import PPOLearner
    from nitro.stellaris.server import Landed, ParameterServer
    from nitro.stellaris.wire import check_gradient, gradient_payload

    rows = []
    cfg = NitroConfig.load({"env_id": "Hopper-v5", "learner": {"mode": "stellaris"}})
    with tempfile.TemporaryDirectory() as tmp, LocalRedisServer(tmp) as redis_server:
        client = connect_redis(redis_server.url)
        for actors, groups in zip(args.boost, args.server_groups):
            learner = PPOLearner(env_spec("Hopper-v5"), cfg.ppo, seed=0, arch=cfg.model.architecture())
            server = ParameterServer(learner, cfg.learner, TrajectoryCache(client, f"alone{actors}"))
            gradients = actors * 10  # 10 passes of one 256-sample slice per actor, the boost part's jobs
            shapes = server.expected_shapes
            for g in range(gradients):
                payload = gradient_payload({n: 0.01 * torch.randn(shape) for n, shape in shapes.items()},
                                           invocation_id=f"g{g}", snapshot_version=0, metrics={"samples": 256.0})
                client.set(f"alone{actors}:g{g}", payload)
            took = {"receiving": 0.0, "stepping": 0.0, "publishing": 0.0}
            landed = []
            started = time.perf_counter()
            for g in range(gradients):
                landed.append(Landed(check_gradient(client.get(f"alone{actors}:g{g}"), expected=shapes,
                                                    invocation_id=f"g{g}", snapshot_version=0), staleness=1))
            took["receiving"] = time.perf_counter() - started
            for group in np.array_split(np.arange(gradients), groups):
                started = time.perf_counter()
                server.apply([landed[i] for i in group], Progress(1, 10))
                took["stepping"] += time.perf_counter() - started
                started = time.perf_counter()
                server.publish(1, "alone")
                took["publishing"] += time.perf_counter() - started
            rows.append({"actors": actors, "gradients": gradients, "groups": groups,
                         **{f"{part}_s": seconds for part, seconds in took.items()},
                         "busy_s": sum(took.values())})
            print(f"  server alone, {actors} actors: {gradients} gradients in {groups} groups: "
                  + ", ".join(f"{part} {seconds:.3f} s" for part, seconds in took.items()), flush=True)
    return {"rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("main", "ablations", "boost", "server", "all"), default="all")
    p.add_argument("--envs", nargs="+", default=["Hopper-v5", "Walker2d-v5"])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--ablation-seeds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=30, help="sync's rounds; stellaris runs --stellaris-factor x as many")
    p.add_argument("--stellaris-factor", type=float, default=1.6)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--boost", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--measured", action="store_true", help="boost: a stellaris arm on real arrivals too")
    p.add_argument("--lingers", type=float, nargs="*", default=[],
                   help="boost: a stellaris arm for each of these learner.lane_linger_s values too")
    p.add_argument("--server-groups", type=int, nargs="+", default=[49, 64],
                   help="server: the groups applied at each --boost size (the boost part's seeded arm)")
    p.add_argument("--out", default=None, help="file under bench/results/ (default: stellaris_<part>.json)")
    args = p.parse_args()
    if args.out and args.part == "all":
        p.error("--out names one part's file: give --part too")
    common = ["scaler.name=fixed", "scaler.fixed_actors=8", f"eval.every_rounds={args.eval_every}"]
    parts = ("main", "ablations", "boost") if args.part == "all" else (args.part,)
    for part in parts:
        load_before = os.getloadavg()
        started = time.perf_counter()
        if part == "boost":
            result = boost(args)
        elif part == "server":
            result = server_alone(args)
        else:
            arms = ["sync", "stellaris"] if part == "main" else ["sync", "stellaris", "stellaris-no-trunc",
                                                                   "stellaris-uniform", "sync-80"]
            envs = args.envs if part == "main" else ["Hopper-v5"]
            seeds = args.seeds if part == "main" else args.ablation_seeds
            runs = []
            for env_id in envs:
                for seed in range(seeds):
                    for arm in arms:
                        if (part == "ablations" and arm in ("sync", "stellaris") and seed < args.seeds
                                and "Hopper-v5" in args.envs):
                            continue  # the main part's runs of the same seeds serve here
                        rounds = (args.rounds if arm.startswith("sync")
                                  else math.ceil(args.rounds * args.stellaris_factor))
                        runs.append(run(env_id, arm, seed, rounds, common, part))
            if part == "ablations" and "Hopper-v5" in args.envs and (RESULTS / "stellaris_main.json").exists():
                main_runs = json.loads((RESULTS / "stellaris_main.json").read_text())["runs"]
                runs += [r for r in main_runs if r["env_id"] == "Hopper-v5" and r["seed"] < seeds]
            result = {"runs": runs, "summary": compare(runs, arms, "sync")}
        result.update({"part": part, "args": vars(args), "wall_s": time.perf_counter() - started,
                       "machine": machine(load_before=load_before, load_after=os.getloadavg())})
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / (args.out or f"stellaris_{part}.json")
        out.write_text(json.dumps(result, indent=1, default=float))
        summary = result.get("summary", result.get("rows"))
        print(json.dumps(summary, indent=1, default=float)[:6000])
        print(f"wrote {out} (load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
