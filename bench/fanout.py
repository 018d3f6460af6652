"""Fan-out latency of the Lambda backend: from "decision made" to "all trajectories in Redis".

    python bench/fanout.py [--sizes 8,64,256,1000] [--duration 1.0] [--rounds 3]
                           [--invokers aiohttp,boto3] [--pin] [--out bench/results/fanout.json]

Set-up (all real except the function body): a real redis-server; the local Lambda Invoke API
server (``tests.support.lambda_invoke_server``) in its own process, running the REAL handler
(``actor_lambda.handler``) in simulate mode - each invocation sleeps ``--duration`` seconds, then
writes a small dummy batch to Redis (SET NX + RPUSH in one script, as a real actor does); the
server's reserved concurrency is above the largest size, so nothing is throttled. The client is
``LambdaActorBackend`` with ``concurrency`` = the fan-out size, once per invoker: ``aiohttp`` (the
default: one event loop, requests signed by botocore's SigV4) and ``boto3`` (the SDK's ``invoke``
in N threads: the previous invoker, as the reference).

For each invoker and size N, per round: t0 = the decision (N is known); build the N events;
``invoke_many``. A watcher in ANOTHER process BLPOPs the round's done list and notes when the
N-th invocation id arrived (= all N trajectories are in Redis). Per round it records:

* ``all_in_redis_s``: t0 -> last trajectory in Redis (the figure; median of the warm rounds);
* ``dispatch_s``: t0 -> the last request left the client (the client's own share of the fan-out);
* ``returned_s``: t0 -> ``invoke_many`` returned all N summaries;
* CPU seconds used during the round by the client process, by the Invoke server process with its
  worker processes, and by redis-server (psutil), so that the client's CPU per invoke is its own.

The first round of a fresh backend (connections opened on demand) is reported as ``cold_client``.

What is the emulator's cost, not the client's: on AWS the service side runs elsewhere, here the
Invoke server (HTTP parsing, the handler's event validation, its Redis write, the response) and
Redis share the machine's cores with the client. Their CPU per round is recorded separately
(``server_cpu_s``, ``redis_cpu_s``), and ``dispatch_s`` is the part of the fan-out the client
controls. ``--pin`` puts the client on CPU 0 and the server and Redis on the other CPUs, so the
two sides no longer compete for a core (the server side then has one core fewer); without it they
share all cores, as in the figures of record.

``--pools local,ray`` measures the process backends the same way, in the same run: the local
worker pool (``LocalActorPool``) and a local Ray (``RayActorBackend``, started by the backend),
each with ``--slots`` actors at once (worker processes; the local Ray's CPUs), every actor the same
simulated one (``bench/_common.py: simulated_actor``: the handler's simulate mode). A round of N
needs ceil(N / slots) waves, so each row also gives ``ideal_s`` = waves x duration and
``overhead_s`` = all in Redis - ideal_s. The load average is recorded before and after each size.
For the Ray against the local pool at 8, 64 and 256 invocations::

    python bench/fanout.py --invokers= --pools local,ray --sizes 8,64,256 --out bench/results/fanout_ray.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import fake_aws_credentials, machine, start_invoke_server, stop_process, tree_cpu_s  # noqa: E402  # bench/ on sys.path first

FUNCTION = "nitro-actor-bench"


def _watcher(redis_url: str, conn) -> None:
    """Another process: on ("watch", key, n, timeout_s), BLPOP ``key`` until n ids arrived and send
    back their arrival times (``time.monotonic()``, comparable across processes on one machine)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, key, n, timeout_s = msg
        arrived: list[float] = []
        conn.send(("watching",))
        deadline = time.monotonic() + timeout_s
        while len(arrived) < n and time.monotonic() < deadline:
            if client.blpop([key], timeout=1) is not None:
                arrived.append(time.monotonic())
        conn.send(("arrived", arrived))


class Watcher:
    def __init__(self, redis_url: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_watcher, args=(redis_url, child), daemon=True)
        self.proc.start()

    def start(self, key: str, n: int, timeout_s: float) -> None:
        self.conn.send(("watch", key, n, timeout_s))
        assert self.conn.recv() == ("watching",)

    def result(self) -> list[float]:
        return self.conn.recv()[1]

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(timeout=10)


def round_events(cache, redis_url: str, run_id: str, round_idx: int, n: int) -> list:
    """A round's ``n`` invocations of the simulated actor, as the engine plans them."""
    from nitro.actors.events import ActorEvent

    return [ActorEvent(run_id=run_id, round=round_idx, invocation_id=f"{run_id}-r{round_idx:05d}-{i:04d}",
                       weights_key=cache.weights_key(round_idx), env_id="Hopper-v5", seed=i, n_steps=512,
                       cache_url=redis_url) for i in range(n)]


def one_round(backend, cache, watcher: Watcher, redis_url: str, run_id: str, round_idx: int, n: int,
              pids: dict[str, int]) -> dict:
    watcher.start(cache.done_key(round_idx), n, timeout_s=120)
    cpu_before = {name: tree_cpu_s(pid) for name, pid in pids.items()}
    cpu0 = time.process_time()
    t0 = time.monotonic()  # the scaling decision is made: N actors
    events = round_events(cache, redis_url, run_id, round_idx, n)
    summaries = backend.invoke_many(events)
    t_return = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    arrived = watcher.result()
    cpu_after = {name: tree_cpu_s(pid) for name, pid in pids.items()}
    sent = [backend.timings[e.invocation_id].sent for e in events if e.invocation_id in backend.timings]
    failures = [s.error for s in summaries if not s.ok]
    stored = sum(1 for e in events if cache.client.exists(cache.batch_key(round_idx, e.invocation_id)))
    nan = float("nan")
    return {"n": n, "all_in_redis_s": (arrived[-1] - t0) if len(arrived) == n else nan,
            "first_in_redis_s": (arrived[0] - t0) if arrived else nan,
            "dispatch_s": (max(sent) - t0) if len(sent) == n and all(x is not None for x in sent) else nan,
            "returned_s": t_return, "failures": len(failures), "failure_examples": failures[:3], "stored": stored,
            "client_cpu_s": cpu, **{f"{name}_cpu_s": cpu_after[name] - cpu_before[name] for name in pids},
            "billed_ms_median": statistics.median([s.billed_ms for s in summaries]) if summaries else 0}


def run_size(invoker: str, n: int, rounds: int, url: str, cache, watcher, redis_url: str, run_id: str,
             next_round: list[int], pids: dict[str, int], duration: float) -> dict:
    from nitro.actors.lambda_ import LambdaActorBackend
    from nitro.config import LambdaConfig

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    cfg = LambdaConfig(function_name=FUNCTION, endpoint_url=url, concurrency=n, function_timeout_s=60, invoker=invoker)
    with LambdaActorBackend(cfg, memory_mb=1024, timeout_s=120) as backend:
        rows = []
        for _ in range(rounds + 1):
            rows.append(one_round(backend, cache, watcher, redis_url, run_id, next_round[0], n, pids))
            next_round[0] += 1
        throttled = backend.stats["throttled"]
    cold, warm = rows[0], rows[1:] or rows[:1]
    all_in = med(warm, "all_in_redis_s")
    return {
        "invoker": invoker, "n": n,
        "all_in_redis_s_median": all_in,
        "all_in_redis_s_rounds": [r["all_in_redis_s"] for r in warm],
        "dispatch_s_median": med(warm, "dispatch_s"),
        "returned_s_median": med(warm, "returned_s"),
        "first_in_redis_s_median": med(warm, "first_in_redis_s"),
        "overhead_ratio": (all_in - duration) / duration,
        "client_cpu_ms_per_invocation": 1000 * med(warm, "client_cpu_s") / n,
        "server_cpu_s_per_round": med(warm, "server_cpu_s"),
        "redis_cpu_s_per_round": med(warm, "redis_cpu_s"),
        "server_cpu_ms_per_invocation": 1000 * med(warm, "server_cpu_s") / n,
        "cold_client": {"all_in_redis_s": cold["all_in_redis_s"], "dispatch_s": cold["dispatch_s"],
                        "client_cpu_ms_per_invocation": 1000 * cold["client_cpu_s"] / n},
        "failures": sum(r["failures"] for r in rows),
        "failure_examples": [e for r in rows for e in r["failure_examples"]][:3],
        "stored_every_batch": all(r["stored"] == n for r in rows),
        "throttled": throttled,
    }


def pooled_round(backend, cache, watcher: Watcher, redis_url: str, run_id: str, round_idx: int, n: int) -> dict:
    """One round on a process backend: t0 = the decision; ``invoke_many``; the watcher notes the
    N-th batch in Redis."""
    watcher.start(cache.done_key(round_idx), n, timeout_s=600)
    cpu0 = time.process_time()
    t0 = time.monotonic()
    events = round_events(cache, redis_url, run_id, round_idx, n)
    summaries = backend.invoke_many(events)
    t_return = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    arrived = watcher.result()
    failures = [s.error for s in summaries if not s.ok]
    nan = float("nan")
    return {"n": n, "all_in_redis_s": (arrived[-1] - t0) if len(arrived) == n else nan,
            "first_in_redis_s": (arrived[0] - t0) if arrived else nan, "returned_s": t_return,
            "client_cpu_s": cpu, "failures": len(failures), "failure_examples": failures[:3],
            "stored": sum(1 for e in events if cache.client.exists(cache.batch_key(round_idx, e.invocation_id)))}


def open_pool(kind: str, slots: int, duration: float):
    """A process backend running the simulated actor, ``slots`` actors at once."""
    from nitro.actors.local import LocalActorPool
    from nitro.actors.ray_ import RayActorBackend
    from nitro.config import RayConfig

    os.environ["NITRO_SIMULATE_DURATION_S"] = str(duration)  # read by simulated_actor in the workers
    actor_fn = "_common:simulated_actor"
    timeout_s = max(30.0, duration * 10)
    if kind == "local":
        return LocalActorPool(workers=slots, timeout_s=timeout_s, memory_mb=1024, actor_fn=actor_fn,
                              preload=["actor_lambda.handler"])
    if kind == "ray":
        return RayActorBackend(RayConfig(), cpus=slots, timeout_s=timeout_s, memory_mb=1024, actor_fn=actor_fn,
                               preload=["actor_lambda.handler"])
    raise SystemExit(f"unknown pool {kind!r}: local or ray")


def run_pool(kind: str, sizes: list[int], rounds: int, slots: int, duration: float, cache, watcher: Watcher,
             redis_url: str, run_id: str, next_round: list[int]) -> list[dict]:
    """Every size on one backend (started once): one cold round, then ``rounds`` warm ones each."""
    import math

    rows = []
    with open_pool(kind, slots, duration) as backend:
        for n in sizes:
            load_before = os.getloadavg()
            measured = []
            for _ in range(rounds + 1):
                measured.append(pooled_round(backend, cache, watcher, redis_url, run_id, next_round[0], n))
                next_round[0] += 1
            cold, warm = measured[0], measured[1:] or measured[:1]
            all_in = statistics.median(r["all_in_redis_s"] for r in warm)
            ideal = math.ceil(n / slots) * duration
            rows.append({
                "backend": kind, "n": n, "slots": slots, "waves": math.ceil(n / slots),
                "all_in_redis_s_median": all_in, "all_in_redis_s_rounds": [r["all_in_redis_s"] for r in warm],
                "ideal_s": ideal, "overhead_s": all_in - ideal,
                "returned_s_median": statistics.median(r["returned_s"] for r in warm),
                "first_in_redis_s_median": statistics.median(r["first_in_redis_s"] for r in warm),
                "client_cpu_ms_per_invocation": 1000 * statistics.median(r["client_cpu_s"] for r in warm) / n,
                "cold_all_in_redis_s": cold["all_in_redis_s"],
                "failures": sum(r["failures"] for r in measured),
                "failure_examples": [e for r in measured for e in r["failure_examples"]][:3],
                "stored_every_batch": all(r["stored"] == n for r in measured),
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            })
            r = rows[-1]
            print(f"{kind:>7} N={n:5d}  all in Redis {all_in:6.3f}s (ideal {ideal:.1f}s in {r['waves']} waves of "
                  f"{slots}, overhead {r['overhead_s']:.3f}s)  returned {r['returned_s_median']:.3f}s  client CPU "
                  f"{r['client_cpu_ms_per_invocation']:.2f} ms/inv  failures {r['failures']}  "
                  f"load {load_before[0]:.2f} -> {r['loadavg_after'][0]:.2f}", flush=True)
    return rows


def pool_markdown(rows: list[dict], duration: float) -> str:
    lines = [f"| backend | N | slots | all in Redis | ideal (waves x {duration:g}s) | overhead | client CPU per invoke "
             "| load before -> after |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['n']} | {r['slots']} | {r['all_in_redis_s_median']:.2f} s "
                     f"| {r['ideal_s']:.1f} s | {r['overhead_s']:.3f} s | {r['client_cpu_ms_per_invocation']:.2f} ms | "
                     f"{r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f} |")
    return "\n".join(lines)


def pin(pids: dict[str, int]) -> dict[str, list[int]]:
    """Client on CPU 0; the server (and the workers it forks later) and Redis on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 CPUs")
    os.sched_setaffinity(0, {cpus[0]})
    for pid in pids.values():
        os.sched_setaffinity(pid, set(cpus[1:]))
    return {"client": cpus[:1], "server_and_redis": cpus[1:]}


def markdown(results: list[dict], duration: float) -> str:
    lines = [f"| invoker | N | all in Redis | last request left | overhead / {duration:g}s | client CPU per invoke "
             "| server + Redis CPU per round |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['invoker']} | {r['n']} | {r['all_in_redis_s_median']:.2f} s "
                     f"| {r['dispatch_s_median']:.3f} s | {r['overhead_ratio']:.2f} "
                     f"| {r['client_cpu_ms_per_invocation']:.2f} ms "
                     f"| {r['server_cpu_s_per_round'] + r['redis_cpu_s_per_round']:.2f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256,1000")
    p.add_argument("--duration", type=float, default=1.0, help="simulated function duration (s)")
    p.add_argument("--rounds", type=int, default=3, help="warm rounds per size (after one cold round)")
    p.add_argument("--invokers", default="aiohttp,boto3",
                   help="aiohttp (the default invoker), boto3 (the SDK, reference)")
    p.add_argument("--threads-per-worker", type=int, default=0,
                   help="default: half the largest size (2 worker processes)")
    p.add_argument("--pin", action="store_true", help="client on CPU 0, Invoke server and Redis on the other CPUs")
    p.add_argument("--pools", default="",
                   help="process backends to measure too: local (the worker pool), ray (a local Ray)")
    p.add_argument("--slots", type=int, default=8,
                   help="--pools: actors at once (worker processes; the local Ray's CPUs)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fanout.json"))
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    invokers = [x for x in args.invokers.split(",") if x]
    pools = [x for x in args.pools.split(",") if x]
    if not invokers and not pools:
        raise SystemExit("nothing to measure: give --invokers and/or --pools")
    fake_aws_credentials()

    from nitro.cache import LocalRedisServer, TrajectoryCache, connect_redis

    workdir = tempfile.mkdtemp(prefix="nitro-fanout-")
    top = max(sizes)
    tpw = args.threads_per_worker or max(1, (top + 1) // 2 + 8)
    results: list[dict] = []
    pinning = None
    load_before = os.getloadavg()
    started = time.monotonic()
    pool_rows: list[dict] = []
    with LocalRedisServer(os.path.join(workdir, "redis"), appendonly=False) as redis_srv:
        proc, url = (start_invoke_server(FUNCTION, concurrency=top + 16, duration_s=args.duration,
                                         threads_per_worker=tpw, workdir=workdir) if invokers else (None, ""))
        watcher = Watcher(redis_srv.url)
        try:
            pids = {"server": proc.pid, "redis": redis_srv.process.pid} if proc is not None else {}
            if args.pin:
                pinning = pin(pids)
            run_id = "fanout"
            cache = TrajectoryCache(connect_redis(redis_srv.url), run_id, ttl_s=3600)
            next_round = [0]
            for kind in pools:
                pool_rows += run_pool(kind, sizes, args.rounds, args.slots, args.duration, cache, watcher,
                                      redis_srv.url, run_id, next_round)
            # Start the server's worker processes first: cold starts are not what is measured here.
            if invokers:
                run_size(invokers[0], min(8, top), 0, url, cache, watcher, redis_srv.url, run_id, next_round, pids,
                         args.duration)
            for invoker in invokers:
                for n in sizes:
                    row = run_size(invoker, n, args.rounds, url, cache, watcher, redis_srv.url, run_id, next_round,
                                   pids, args.duration)
                    results.append(row)
                    print(f"{invoker:>7} N={n:5d}  all in Redis {row['all_in_redis_s_median']:6.3f}s "
                          f"(overhead x{row['overhead_ratio']:.3f} of {args.duration:g}s)  last request left "
                          f"{row['dispatch_s_median']:.3f}s  returned {row['returned_s_median']:.3f}s  client CPU "
                          f"{row['client_cpu_ms_per_invocation']:.2f} ms/inv  server+redis CPU "
                          f"{row['server_cpu_s_per_round'] + row['redis_cpu_s_per_round']:.2f}s/round  "
                          f"failures {row['failures']}", flush=True)
        finally:
            watcher.stop()
            if proc is not None:
                stop_process(proc)
    ratios = {}
    for invoker in invokers:
        rows = {r["n"]: r for r in results if r["invoker"] == invoker}
        lo, hi = rows[min(rows)], rows[max(rows)]
        ratios[invoker] = {"sizes": [lo["n"], hi["n"]],
                           "all_in_redis_ratio": hi["all_in_redis_s_median"] / lo["all_in_redis_s_median"],
                           "target": 1.2}
    report = {
        "benchmark": "fanout: decision made -> all trajectories in Redis",
        "simulated_duration_s": args.duration,
        "rounds_per_size": args.rounds,
        "ratio_largest_over_smallest": ratios,
        "machine": machine(loadavg_before=load_before, loadavg_at_end=os.getloadavg(), pinning=pinning),
        "server": {"kind": "tests.support.lambda_invoke_server (aiohttp, real handler in simulate mode)",
                   "processes": 2, "threads_per_worker": tpw, "reserved_concurrency": top + 16,
                   "note": "server_cpu_s and redis_cpu_s are the emulated service's cost; on AWS it runs elsewhere"},
        "clients": {"aiohttp": "LambdaActorBackend(invoker=aiohttp): one event loop, one aiohttp session "
                               "(N connections), requests signed by botocore SigV4Auth, semaphore N",
                    "boto3": "LambdaActorBackend(invoker=boto3): one boto3 client (max_pool_connections=N, SDK "
                             "retries off) called from N threads"},
        "results": results,
        "pools": {"slots": args.slots, "results": pool_rows,
                  "actor": "bench/_common.py simulated_actor (the Lambda handler's simulate mode) in LocalActorPool "
                           "worker processes, or as Ray tasks on a local Ray started by RayActorBackend"},
        "wall_s": time.monotonic() - started,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if results:
        print("\n" + markdown(results, args.duration))
    if pool_rows:
        print("\n" + pool_markdown(pool_rows, args.duration))
    for invoker, r in ratios.items():
        print(f"{invoker}: all in Redis at N={r['sizes'][1]} / N={r['sizes'][0]} = {r['all_in_redis_ratio']:.3f} "
              "(target <= 1.2)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
