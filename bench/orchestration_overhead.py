"""Share of a round's wall time that goes to Prefect + MLflow bookkeeping (issue 3, target <= 5%).

    python bench/orchestration_overhead.py [--rounds 5] [--actors 16] [--steps 512] [--workers N]
                                           [--probe-calls 5] [--out bench/results/orchestration_overhead.json]

What runs: the REAL `nitro-train` flow (flows/training.py) on the default Hopper configuration with
`scaler.name=fixed scaler.fixed_actors=16 steps_per_actor=512 backend.workers=<CPU count>`, i.e. 16
local actors per round, against Prefect's ephemeral API server (what `nitro train` uses with no
PREFECT_API_URL) and a fresh MLflow SQLite store, in a temporary home.

Per round k the engine records `learner_s`, `detection_s`, `actor_s` (the work: learning, detection,
acting, the last one being the wall time of the mapped actor tasks) and `round_s` (the wall time of
`await training_round(...)` in flows/training.py), and `orchestration_s = round_s - work`. That metric
does NOT include the `record-round` task that follows each round (MLflow `log_batch`, checkpoint,
progress artifact). So this bench also measures, by wrapping functions at run time (no source edits):

* body_s        time inside the round flow's body (the flow function itself, timed from within);
* subflow_call  round_s - body_s: what calling the subflow costs (create run, states, heartbeat, exit);
* in_body_orch  body_s - work: the four Prefect tasks + mapped-task bookkeeping inside the round;
* record_s      wall time of the `record-round` task call, of which mlflow_log_s (RunTracker.log_round)
                and checkpoint_s (save_checkpoint);
* iteration_s   round_s + record_s: one turn of the loop over rounds;
* bookkeeping   iteration_s - work = subflow_call + in_body_orch + record_s.

Shares are ratios of sums over the rounds of one run. Round 0 has no policy update (nothing collected
yet), so figures are also given for rounds >= 1 ("steady").

Then a probe: in one async parent flow, N calls each of a trivial `async` subflow and a trivial sync
subflow, to check NOTES.md's "every sync subflow call costs ~1.1 s because the sync flow engine joins
a heartbeat thread that sleeps in 1 s steps" (prefect/flow_engine.py `_send_heartbeats`: the thread
sleeps in 1 s steps and the sync engine joins it with `join_on_exit=True`; the async engine passes
`join_on_exit=False`).

Finding (see the JSON): the async round subflow does not pay the heartbeat join, yet its call cost
~0.3-2.8 s. Cause: creating the subflow's parent task run (`POST /task_runs/`) waits ~2 s on the API
server's SQLite, which the `task_run_recorder` service is busy filling with the previous round's task-run
events ONE PER TRANSACTION (Prefect's default `batch_size=1`, `read_batch_size=1`). Configured away by
giving the server `PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=100` and
`..._READ_BATCH_SIZE=100`. By default this script runs the training twice, each in a child process with
its own ephemeral API server: Prefect's defaults ("recorder_batch_1") and the setting ("recorder_batch_100").
`--recorder-batch-size N` runs one configuration in this process.

Caveat: 2 shared cores here (actors, learner, the ephemeral API server and other engineers' jobs all
compete); numbers are noisy: read them as ratios from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_TMP = tempfile.mkdtemp(prefix="nitro-bench-orch-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP, "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MUJOCO_GL", "disable")
os.environ.pop("NITRO_INJECT_FAILURE_AT_ROUND", None)

RECORDER_ENV = ("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE",
                "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE")


def _timed(store: list, fn):
    """Wrap sync or async ``fn``; append its wall seconds to ``store``."""
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                store.append(time.perf_counter() - t0)
        return awrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store.append(time.perf_counter() - t0)
    return wrapper


def run_training(args, home: Path) -> dict:
    import flows.round
    import flows.training
    import tasks.bookkeeping
    from nitro.runtime import ROUND_OBSERVERS
    from nitro.tracking import RunTracker

    body_s: list[float] = []
    record_s: list[float] = []
    mlflow_log_s: list[float] = []
    checkpoint_s: list[float] = []
    reports: list[dict] = []

    # body of the round flow, timed from inside the flow (the Flow object keeps its options)
    flows.round.training_round.fn = _timed(body_s, flows.round.training_round.fn)
    # the record-round task call as run_training makes it (module global looked up at call time)
    flows.training.record_round = _timed(record_s, flows.training.record_round)
    RunTracker.log_round = _timed(mlflow_log_s, RunTracker.log_round)
    tasks.bookkeeping.save_checkpoint = _timed(checkpoint_s, tasks.bookkeeping.save_checkpoint)
    ROUND_OBSERVERS.append(lambda _run, report: reports.append(dict(report.metrics)))

    overrides = [
        "env_id=Hopper-v5", "scaler.name=fixed", f"scaler.fixed_actors={args.actors}",
        f"steps_per_actor={args.steps}", f"rounds={args.rounds}", f"backend.workers={args.workers}",
        f"home={home}", f"tracking.mlflow_uri=sqlite:///{home}/mlflow.db",
    ]
    t0 = time.perf_counter()
    result = asyncio.run(flows.training.train(overrides=overrides, run_id="bench-orchestration"))
    total_s = time.perf_counter() - t0
    n = len(reports)
    assert n == args.rounds and len(body_s) == n and len(record_s) == n, (n, len(body_s), len(record_s))

    rows = []
    for k, m in enumerate(reports):
        work = m["learner_s"] + m["detection_s"] + m["actor_s"]
        iteration = m["round_s"] + record_s[k]
        rows.append({
            "round": k,
            "learner_s": m["learner_s"], "detection_s": m["detection_s"], "actor_s": m["actor_s"], "work_s": work,
            "round_s": m["round_s"], "orchestration_s": m["orchestration_s"],
            "body_s": body_s[k], "subflow_call_s": m["round_s"] - body_s[k], "in_body_orch_s": body_s[k] - work,
            "record_s": record_s[k], "mlflow_log_s": mlflow_log_s[k] if k < len(mlflow_log_s) else None,
            "checkpoint_s": checkpoint_s[k], "iteration_s": iteration, "bookkeeping_s": iteration - work,
            "env_steps": m["env_steps"], "actors_launched": m["actors_launched"],
        })
    return {"result": result, "total_s": total_s, "rows": rows}


def summarize(rows: list[dict]) -> dict:
    def s(key):
        return sum(r[key] for r in rows)

    it = s("iteration_s")
    return {
        "rounds": len(rows),
        "iteration_s": it,
        "work_s": s("work_s"),
        "metric_share_orchestration_over_round": s("orchestration_s") / s("round_s"),
        "share_bookkeeping_of_iteration": s("bookkeeping_s") / it,
        "share_subflow_call": s("subflow_call_s") / it,
        "share_in_body_orchestration": s("in_body_orch_s") / it,
        "share_record_round": s("record_s") / it,
        "share_mlflow_log": sum(r["mlflow_log_s"] or 0.0 for r in rows) / it,
        "share_checkpoint": s("checkpoint_s") / it,
        "share_learner": s("learner_s") / it,
        "share_detection": s("detection_s") / it,
        "share_actor": s("actor_s") / it,
        "mean_subflow_call_s": s("subflow_call_s") / len(rows),
        "mean_record_s": s("record_s") / len(rows),
        "mean_in_body_orch_s": s("in_body_orch_s") / len(rows),
    }


def probe_subflows(calls: int) -> dict:
    """Trivial async vs sync subflow calls from one async parent flow (same API server)."""
    from prefect import flow

    @flow(name="probe-async-child", persist_result=False)
    async def async_child(i: int) -> int:
        return i

    @flow(name="probe-sync-child", persist_result=False)
    def sync_child(i: int) -> int:
        return i

    @flow(name="probe-parent", persist_result=False)
    async def parent(n: int) -> dict:
        out = {"async": [], "sync": []}
        for i in range(n):
            t0 = time.perf_counter()
            await async_child(i)
            out["async"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sync_child(i)
            out["sync"].append(time.perf_counter() - t0)
        return out

    times = asyncio.run(parent(calls))
    return {kind: {"calls_s": v, "median_s": statistics.median(v), "mean_s": statistics.fmean(v)}
            for kind, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--actors", type=int, default=16)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--probe-calls", type=int, default=5)
    parser.add_argument("--recorder-batch-size", type=int, default=None,
                        help="run one configuration here with this task-run recorder batch size")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "orchestration_overhead.json")
    args = parser.parse_args()
    if args.recorder_batch_size is None:
        return compare(args)
    for name in RECORDER_ENV:
        os.environ[name] = str(args.recorder_batch_size)

    import mlflow
    import prefect
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    load_before = os.getloadavg()
    run = run_training(args, Path(_TMP) / "home")
    probe = probe_subflows(args.probe_calls)
    rows = run["rows"]
    all_rounds = summarize(rows)
    steady = summarize(rows[1:]) if len(rows) > 1 else None

    print(f"{'k':>2} {'learn':>6} {'detect':>6} {'actors':>6} {'round':>6} {'body':>6} {'subflow':>7} "
          f"{'in-body':>7} {'record':>6} {'mlflow':>6} {'ckpt':>5}  bookkeeping")
    for r in rows:
        print(f"{r['round']:>2} {r['learner_s']:6.2f} {r['detection_s']:6.2f} {r['actor_s']:6.2f} {r['round_s']:6.2f} "
              f"{r['body_s']:6.2f} {r['subflow_call_s']:7.3f} {r['in_body_orch_s']:7.3f} {r['record_s']:6.3f} "
              f"{(r['mlflow_log_s'] or 0):6.3f} {r['checkpoint_s']:5.3f}  {r['bookkeeping_s']:.3f} s "
              f"({100 * r['bookkeeping_s'] / r['iteration_s']:.1f}%)")
    for label, s in (("all rounds", all_rounds), ("rounds >= 1", steady)):
        if s is None:
            continue
        print(f"\n{label}: Prefect+MLflow bookkeeping = {100 * s['share_bookkeeping_of_iteration']:.2f}% of loop wall time "
              f"(target <= 5%); engine metric sum(orchestration_s)/sum(round_s) = "
              f"{100 * s['metric_share_orchestration_over_round']:.2f}%")
        print(f"  subflow call {100 * s['share_subflow_call']:.2f}% (mean {s['mean_subflow_call_s'] * 1000:.0f} ms), "
              f"tasks inside the round {100 * s['share_in_body_orchestration']:.2f}%, "
              f"record-round {100 * s['share_record_round']:.2f}% (MLflow log {100 * s['share_mlflow_log']:.2f}%, "
              f"checkpoint {100 * s['share_checkpoint']:.2f}%)")
        print(f"  work: learner {100 * s['share_learner']:.1f}%, detection {100 * s['share_detection']:.1f}%, "
              f"actors {100 * s['share_actor']:.1f}%")
    print(f"\ntrivial subflow call from an async parent (median of {args.probe_calls}): "
          f"async {probe['async']['median_s'] * 1000:.0f} ms, sync {probe['sync']['median_s'] * 1000:.0f} ms")

    out = {
        "bench": "orchestration_overhead",
        "task_run_recorder_batch_size": args.recorder_batch_size,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "shared": True},
        "versions": {"prefect": prefect.__version__, "mlflow": mlflow.__version__, "torch": torch.__version__},
        "config": {"env_id": "Hopper-v5", "scaler": "fixed", "actors_per_round": args.actors,
                   "steps_per_actor": args.steps, "rounds": args.rounds, "backend_workers": args.workers,
                   "prefect_api": "ephemeral", "mlflow_store": "sqlite (temporary)"},
        "target_share": 0.05,
        "summary_all_rounds": all_rounds,
        "summary_steady_rounds": steady,
        "rounds": rows,
        "subflow_probe": probe,
        "run_total_s": run["total_s"],
        "note": ("ratios from one run on a shared 2-core machine; bookkeeping = Prefect + MLflow + checkpoint "
                 "time per loop turn = (round_s + record_s) - (learner_s + detection_s + actor_s)"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


def compare(args) -> int:
    """Both recorder configurations, each in a child process with its own ephemeral API server."""
    import subprocess

    results = {}
    for size in (1, 100):
        child_out = Path(_TMP) / f"recorder-{size}.json"
        cmd = [sys.executable, __file__, "--rounds", str(args.rounds), "--actors", str(args.actors),
               "--steps", str(args.steps), "--workers", str(args.workers), "--probe-calls", str(args.probe_calls),
               "--recorder-batch-size", str(size), "--out", str(child_out)]
        print(f"\n=== task_run_recorder batch size {size}" + (" (Prefect default)" if size == 1 else "") + " ===",
              flush=True)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_HOME"}  # a fresh API server each
        subprocess.run(cmd, check=True, env=env)
        results[f"recorder_batch_{size}"] = json.loads(child_out.read_text())

    print("\n=== summary (ratios from one run each, same machine, back to back) ===")
    for name, r in results.items():
        s_all, s_st = r["summary_all_rounds"], r["summary_steady_rounds"]
        print(f"{name:>20}: bookkeeping {100 * s_all['share_bookkeeping_of_iteration']:.2f}% of loop wall time "
              f"(rounds>=1: {100 * s_st['share_bookkeeping_of_iteration']:.2f}%), subflow call mean "
              f"{1000 * s_all['mean_subflow_call_s']:.0f} ms; engine metric orchestration_s/round_s "
              f"{100 * s_all['metric_share_orchestration_over_round']:.2f}%; trivial subflow async "
              f"{1000 * r['subflow_probe']['async']['median_s']:.0f} ms vs sync {1000 * r['subflow_probe']['sync']['median_s']:.0f} ms")
    out = {"bench": "orchestration_overhead", "target_share": 0.05, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "recommended_server_env": {name: "100" for name in RECORDER_ENV}, "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
