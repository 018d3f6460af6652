"""The least a round can cost in Prefect: the round's flow of tasks with every task doing nothing.

    python bench/prefect_floor.py [--actors 8,16,64] [--apis ephemeral,server] [--rounds 10]
                                  [--out bench/results/prefect_floor.json]

Why: issue 15 asks for Prefect's and MLflow's share of a steady round to be at most 3% at 8, 16
and 64 actors. bench/orchestration_overhead.py measures the share of the real round; this measures
the floor under it, the same shape with no work: a parent flow calls an ``async`` round subflow
with the options of ``flows/round.py::training_round`` (``persist_result=False``,
``validate_parameters=False``, a ``ThreadPoolTaskRunner`` as ``flows/training.py`` gives it, one
shared API client), whose body runs the round's eight tasks in order (update-policy,
detect-boosting, decide-actors, publish-weights, plan-invocations, launch-actors, the mapped
invoke-actor tasks, end-round; ``NO_CACHE`` like ours) and N mapped ``invoke-actor`` tasks, each
returning at once. A round's wall time here is pure orchestration: the subflow's creation and state
transitions, its parent task run, the task runs and their events. Between rounds the parent
sleeps as long as the real round's work takes (--pause-s; unmeasured), which leaves the server the
time it has in a real run to record the last round's task runs; back to back, every other subflow
start waited ~2 s for those writes.

Against ``ephemeral`` (no PREFECT_API_URL: Prefect's temporary server on SQLite, the quick start's
path) and ``server`` (a ``prefect server start`` on SQLite started here), each in a fresh child
process with the settings every Nitro entry point applies (flows/settings.py). Reported per API and
N: the median and the 90th percentile of a round's wall time over --rounds rounds (the first two,
warm-up, left out), and what that floor is as a share of a steady Hopper-v5 round whose work took
``--work-s`` seconds (default: the work of the real round with N actors, from
bench/results/orchestration_overhead_after_fix.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import machine  # noqa: E402  # bench/ on sys.path first
from orchestration_overhead import PrefectServer  # noqa: E402  # bench/ on sys.path first

WARMUP = 2


def child(actors: int, rounds: int, pause_s: float, out: Path) -> None:
    from flows.settings import apply_prefect_defaults

    apply_prefect_defaults()
    from prefect import flow, task, unmapped
    from prefect.cache_policies import NO_CACHE
    from prefect.context import SyncClientContext
    from prefect.task_runners import ThreadPoolTaskRunner

    def noop_task(name: str):
        @task(name=name, cache_policy=NO_CACHE)
        def step(*_args):
            return 0
        return step

    update, detect, decide, publish, plan, launch, end = (noop_task(n) for n in (
        "update-policy", "detect-boosting", "decide-actors", "publish-weights", "plan-invocations",
        "launch-actors", "end-round"))

    @task(name="invoke-actor", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
    def invoke(_run_id: str, event: int) -> int:
        return event

    @flow(name="floor-round", flow_run_name="floor-round-{k}", persist_result=False, validate_parameters=False)
    async def round_flow(run_id: str, k: int) -> int:
        u = update(run_id, k)
        d = detect(run_id, k, u)
        n = decide(run_id, k, d, u)
        w = publish(run_id, k)
        events = plan(run_id, k, n, w)
        launch(run_id, events)
        summaries = [f.result() for f in invoke.map(unmapped(run_id), list(range(actors)))]
        return end(run_id, k, u, d, n, len(summaries))

    @flow(name="floor-train", persist_result=False)
    async def train() -> list[float]:
        runner = round_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=actors + 4))
        times = []
        with SyncClientContext.get_or_create():
            for k in range(rounds):
                t0 = time.perf_counter()
                await runner("floor", k)
                times.append(time.perf_counter() - t0)
                await asyncio.sleep(pause_s)  # a real round's work: the server catches up meanwhile
        return times

    out.write_text(json.dumps(asyncio.run(train())))


def run_child(actors: int, rounds: int, pause_s: float, api_url: str | None, workdir: Path) -> list[float]:
    out = workdir / f"floor-{actors}-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PREFECT_HOME"] = str(workdir / f"client-home-{actors}-{time.monotonic_ns()}")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    subprocess.run([sys.executable, __file__, "--child-out", str(out), "--child-actors", str(actors),
                    "--rounds", str(rounds), "--pause-s", str(pause_s)], check=True, env=env, cwd=str(ROOT))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", default="8,16,64")
    p.add_argument("--apis", default="ephemeral,server")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pause-s", type=float, default=None,
                   help="idle time between rounds, unmeasured: a real round's work, during which the server "
                        "records the last round's task runs (back to back, the next subflow waited ~2 s for "
                        "it). Default: the work of the real round with as many actors (or 2 s)")
    p.add_argument("--work-s", type=float, default=None,
                   help="work of a steady round to compare with "
                        "(default: per N, from orchestration_overhead_after_fix.json)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefect_floor.json"))
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-actors", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_out:
        child(args.child_actors, args.rounds, args.pause_s, Path(args.child_out))
        return 0

    reference = {}
    ref_file = ROOT / "bench" / "results" / "orchestration_overhead_after_fix.json"
    if ref_file.exists():  # the steady round's work (learner + detection + actors) per API and N
        for label, entry in json.loads(ref_file.read_text()).get("share", {}).items():
            s = entry.get("summary_steady_rounds") or {}
            if s.get("rounds"):
                reference[label] = s["work_s"] / s["rounds"]
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="nitro-prefect-floor-"))
    results = {}
    for api in [a for a in args.apis.split(",") if a]:
        server = PrefectServer(workdir / "server") if api == "server" else None
        try:
            for n in (int(x) for x in args.actors.split(",")):
                work = args.work_s if args.work_s is not None else reference.get(f"{api}/{n} actors")
                pause = args.pause_s if args.pause_s is not None else (work or 2.0)
                times = run_child(n, args.rounds, pause, server.url if server else None, workdir)
                steady = sorted(times[WARMUP:])
                median = statistics.median(steady)
                p90 = steady[min(len(steady) - 1, int(0.9 * len(steady)))]
                row = {"round_s_median": median, "round_s_p90": p90, "rounds": times, "pause_s": pause,
                       "work_s_compared": work, "floor_share": (median / (work + median)) if work else None}
                results[f"{api}/{n} actors"] = row
                share = f"{100 * row['floor_share']:.1f}% of a round whose work takes {work:.2f} s" if work else ""
                print(f"{api:9s} N={n:3d}: an empty round costs {1000 * median:.0f} ms "
                      f"(p90 {1000 * p90:.0f} ms) {share}", flush=True)
        finally:
            if server:
                server.stop()
    import prefect

    report = {"bench": "prefect_floor", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": machine(loadavg_before=load_before, loadavg_after=os.getloadavg()),
              "versions": {"prefect": prefect.__version__}, "rounds": args.rounds, "warmup_rounds_left_out": WARMUP,
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
