"""Benchmark of the boosting detector on the default Hopper configuration (2x256 policy).

Measures, on real rounds (4096 steps collected with nitro.actors.rollout as 8 actors x 512 steps, then a
real PPOLearner update):
  * detection time as a share of a round's wall time (target <= 5%);
  * subset (512, and 256) vs full-batch detection time: the speed-up;
  * agreement of the subset's R with the full batch's R, over several rounds and subset seeds;
  * our Lanczos against PyHessian 0.1's density() (with the torch.eig shim): time and eigenvalues.

Usage:  python bench/detector.py [--rounds 3] [--seeds 3] [--out bench/results/detector.json]
Keeps to about two minutes on two shared CPU cores.
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

import numpy as np
import torch
from _common import machine

from nitro.actors.rollout import rollout
from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.learners import PPOLearner
from nitro.scaling.detector import detect_on_batch, hessian_extremes, pyhessian_extremes

ACTORS, STEPS_PER_ACTOR = 8, 512  # 4096 steps per round


def collect(learner: PPOLearner, round_idx: int) -> tuple[list[dict], list[float], float]:
    weights = {k: v.numpy() for k, v in learner.weights().items()}
    durations, batches = [], []
    start = time.perf_counter()
    for i in range(ACTORS):
        seed = 1000 * round_idx + i
        try:
            res = rollout(weights, "Hopper-v5", seed=seed, n_steps=STEPS_PER_ACTOR)
        except ValueError as exc:  # rollout() fails when the last step terminated and nothing was
            # truncated (np.stack of an empty bootstrap list): reported to its owner; use another seed
            print(f"   (rollout seed {seed} failed: {exc}; using seed {seed + 500})")
            res = rollout(weights, "Hopper-v5", seed=seed + 500, n_steps=STEPS_PER_ACTOR)
        batches.append(res.batch)
        durations.append(res.summary.duration_s)
    return batches, durations, time.perf_counter() - start


def rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return abs(a - b) / abs(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3, help="subset draws per round")
    ap.add_argument("--steps", type=int, default=20, help="Lanczos steps")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default: on 2 shared cores, 2 threads oversubscribe and slow "
                         "everything (collection, update, detection) several-fold")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "detector.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = NitroConfig.load({})
    spec = env_spec("Hopper-v5")
    learner = PPOLearner(spec, cfg.ppo, seed=0)
    n_params = sum(p.numel() for p in learner.policy_parameters())
    print(f"Hopper-v5, policy 2x256 ({n_params} parameters), {ACTORS}x{STEPS_PER_ACTOR} steps/round, "
          f"torch threads {torch.get_num_threads()}, Lanczos steps {args.steps}")

    rounds = []
    for r in range(args.rounds):
        batches, actor_s, collect_s = collect(learner, r)
        t0 = time.perf_counter()
        metrics = learner.update(batches).diagnostics
        update_s = time.perf_counter() - t0
        # the detection of the round: on the update's batch, after the update (engine step 2)
        n = learner.trained_samples()
        full = detect_on_batch(learner, n, steps=args.steps, seed=0)
        full_s1 = detect_on_batch(learner, n, steps=args.steps, seed=1)  # Lanczos start only
        subs = {size: [detect_on_batch(learner, size, steps=args.steps, seed=s) for s in range(args.seeds)]
                for size in (512, 256)}
        row = {
            "round": r,
            "collect_s_sequential": collect_s,
            "actor_s": actor_s,
            "update_s": update_s,
            "grad_noise_scale": metrics.get("grad_noise_scale"),
            "full": full.to_dict(),
            "full_other_start": full_s1.to_dict(),
            "subsets": {str(k): [d.to_dict() for d in v] for k, v in subs.items()},
        }
        rounds.append(row)
        print(f"round {r}: collect {collect_s:.2f}s (slowest actor {max(actor_s):.2f}s), update {update_s:.2f}s, "
              f"full detection {full.seconds:.3f}s R={full.R} [{full.status}] "
              f"(another start: R={full_s1.R})")
        for size, dets in subs.items():
            Rs = ", ".join(f"{d.R:.4g}" if d.R is not None else d.status for d in dets)
            print(f"   subset {size}: {statistics.mean(d.seconds for d in dets):.3f}s  R = {Rs}")

    # -- summaries -------------------------------------------------------------------------------
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return statistics.mean(xs) if xs else None

    full_s = mean([r["full"]["seconds"] for r in rounds])
    sub_s = {k: mean([d["seconds"] for r in rounds for d in r["subsets"][k]]) for k in ("512", "256")}
    speedup = {k: full_s / v for k, v in sub_s.items()}
    update_s = mean([r["update_s"] for r in rounds])
    collect_seq = mean([r["collect_s_sequential"] for r in rounds])
    slowest_actor = mean([max(r["actor_s"]) for r in rounds])
    det512 = sub_s["512"]
    round_seq = collect_seq + update_s + det512
    round_par = slowest_actor + update_s + det512
    share = {
        "sequential_collection": det512 / round_seq,
        "parallel_actors": det512 / round_par,
    }
    agreement = {}
    for k in ("512", "256"):
        errs = [rel(d["R"], r["full"]["R"]) for r in rounds for d in r["subsets"][k]]
        errs = [e for e in errs if e is not None]
        lmax_errs = [rel(d["lambda_max"], r["full"]["lambda_max"]) for r in rounds for d in r["subsets"][k]]
        lmin_errs = [rel(d["lambda_min"], r["full"]["lambda_min"]) for r in rounds for d in r["subsets"][k]]
        agreement[k] = {
            "R_rel_err_mean": mean(errs), "R_rel_err_max": max(errs) if errs else None,
            "lambda_max_rel_err_mean": mean(lmax_errs), "lambda_min_rel_err_mean": mean(lmin_errs),
            "n": len(errs),
        }
    # subset noise against the signal: spread of R over subset draws within a round, against the
    # spread of the rounds' full-batch R
    def cv(values: list[float]) -> float:
        return statistics.pstdev(values) / statistics.mean(values)

    within_cv = {k: mean([cv([d["R"] for d in r["subsets"][k]]) for r in rounds]) for k in ("512", "256")}
    full_Rs = [r["full"]["R"] for r in rounds]
    between_cv_full = statistics.pstdev(full_Rs) / statistics.mean(full_Rs) if len(full_Rs) > 1 else None
    full_start_err = mean([rel(r["full_other_start"]["R"], r["full"]["R"]) for r in rounds])
    # does the subset preserve the ordering of rounds by R (what the scaler's min-max uses)?
    order_full = list(np.argsort([r["full"]["R"] for r in rounds]))
    order_sub = {k: list(np.argsort([mean([d["R"] for d in r["subsets"][k]]) for r in rounds])) for k in ("512", "256")}

    # -- ours vs PyHessian, on the last round's 512 subset ------------------------------------------
    idx = np.sort(np.random.default_rng(0).choice(n, size=512, replace=False))
    closure = learner.objective(idx)
    ours, ph = [], []
    for s in range(5):  # interleaved, so that load from other jobs hits both alike; min is reported too
        ours.append(hessian_extremes(closure, learner.policy_parameters(), steps=args.steps, seed=s, negate=True))
        ph.append(pyhessian_extremes(closure, learner.policy, steps=args.steps, seed=s, negate=True))
    ours60 = hessian_extremes(closure, learner.policy_parameters(), steps=60, seed=0, negate=True)
    steps_sweep = []
    for k in (6, 8, 10, 12, 15, 20, 30):
        runs = [hessian_extremes(closure, learner.policy_parameters(), steps=k, seed=0, negate=True) for _ in range(2)]
        d = runs[0]
        steps_sweep.append({"steps": k, "seconds": min(x.seconds for x in runs), "R": d.R,
                            "lambda_max_rel_err_vs_60": rel(d.lambda_max, ours60.lambda_max),
                            "lambda_min_rel_err_vs_60": rel(d.lambda_min, ours60.lambda_min)})
    print("\nLanczos steps sweep (512 subset; error against 60 steps):")
    for row in steps_sweep:
        print(f"   {row['steps']:>2} steps {row['seconds']:.3f}s (min of 2)  "
              f"λmax err {row['lambda_max_rel_err_vs_60']:.1e}  λmin err {row['lambda_min_rel_err_vs_60']:.1e}")
    comparison = {
        "ours": [d.to_dict() for d in ours],
        "pyhessian": [d.to_dict() for d in ph],
        "reference_60_steps": ours60.to_dict(),
        "ours_mean_s": mean([d.seconds for d in ours]),
        "pyhessian_mean_s": mean([d.seconds for d in ph]),
    }
    print("\nours vs PyHessian density() on a 512 subset, "
          f"{args.steps} steps (reference: ours at 60 steps "
          f"λmax={ours60.lambda_max:.6g} λmin={ours60.lambda_min:.6g}):")
    for a, b in zip(ours, ph):
        print(f"   ours {a.seconds:.3f}s λmax={a.lambda_max:.6g} λmin={a.lambda_min:.6g} R={a.R:.5g} | "
              f"pyhessian {b.seconds:.3f}s λmax={b.lambda_max:.6g} λmin={b.lambda_min:.6g} R={b.R:.5g}")

    summary = {
        "detection_s": {"full_4096": full_s, "subset_512": sub_s["512"], "subset_256": sub_s["256"]},
        "speedup_vs_full": speedup,
        "round_s": {
            "collect_sequential_4096": collect_seq, "slowest_actor_512": slowest_actor, "ppo_update": update_s,
            "round_sequential": round_seq, "round_parallel_actors": round_par,
        },
        "detection_share_of_round": share,
        "R_agreement_subset_vs_full": agreement,
        "R_full_other_lanczos_start_rel_diff": full_start_err,
        "R_subset_draw_cv_within_round": within_cv,
        "R_full_cv_between_rounds": between_cv_full,
        "R_mean_ratio_subset_over_full": {
            k: mean([statistics.mean([d["R"] for d in r["subsets"][k]]) / r["full"]["R"] for r in rounds])
            for k in ("512", "256")},
        "lanczos_steps_sweep_512": steps_sweep,
        "round_order_by_R": {"full": [int(i) for i in order_full],
                             **{k: [int(i) for i in v] for k, v in order_sub.items()}},
        "ours_vs_pyhessian": {
            "time_ratio_pyhessian_over_ours": comparison["pyhessian_mean_s"] / comparison["ours_mean_s"],
        "ours_min_s": min(d.seconds for d in ours),
        "pyhessian_min_s": min(d.seconds for d in ph),
            "lambda_max_rel_diff": mean([rel(b.lambda_max, a.lambda_max) for a, b in zip(ours, ph)]),
            "lambda_min_rel_diff": mean([rel(b.lambda_min, a.lambda_min) for a, b in zip(ours, ph)]),
            "ours_lambda_max_rel_err_vs_60": mean([rel(a.lambda_max, ours60.lambda_max) for a in ours]),
            "ours_lambda_min_rel_err_vs_60": mean([rel(a.lambda_min, ours60.lambda_min) for a in ours]),
            "pyhessian_lambda_max_rel_err_vs_60": mean([rel(b.lambda_max, ours60.lambda_max) for b in ph]),
            "pyhessian_lambda_min_rel_err_vs_60": mean([rel(b.lambda_min, ours60.lambda_min) for b in ph]),
        },
    }
    print("\nsummary:")
    print(json.dumps(summary, indent=2))

    out = {
        "env": "Hopper-v5", "policy": "2x256 tanh", "n_params": n_params, "steps_per_round": ACTORS * STEPS_PER_ACTOR,
        "lanczos_steps": args.steps, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": machine(),
        "note": ("CPU only, 2 cores shared with other jobs: timings are noisy. 'round_sequential' collects the "
                 "4096 steps in this process one actor after another; 'round_parallel_actors' takes the slowest "
                 "actor as the collection time (actors run concurrently), which is the more demanding share. "
                 "Neither includes Prefect/Redis/invocation overheads, which would lower the share further."),
        "summary": summary, "rounds": rounds, "comparison": comparison,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
