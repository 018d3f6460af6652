"""Fan-out latency of the Lambda backend: from "decision made" to "all trajectories in Redis".

    python bench/fanout.py [--sizes 8,64,256,1000] [--duration 1.0] [--rounds 3] [--out bench/results/fanout.json]

Set-up (all real except the function body): a real redis-server; the local Lambda Invoke API
server (``nitro.actors.invoke_server``) in its own process, running the REAL handler
(``actor_lambda.handler``) in simulate mode - each invocation sleeps ``--duration`` seconds, then
writes a small dummy batch to Redis (SET NX + RPUSH in one script, as a real actor does); the
server's reserved concurrency is above the largest size, so nothing is throttled. The client is
``LambdaActorBackend`` - one shared boto3 client, ``concurrency`` = the fan-out size - driving the
real boto3 invoke path.

For each size N, per round: t0 = the decision (N is known); build the N events; ``invoke_many``.
A watcher BLPOPs the round's done list and notes when the N-th invocation id arrived (= all N
trajectories are in Redis); ``returned`` is when ``invoke_many`` returned all N summaries.
The overhead ratio is ``(t_all_in_redis - duration) / duration``: what the fan-out adds on top of
one actor's run. The first round of a fresh backend (threads and connections created on demand)
is reported separately as ``cold_client``; the figure is the median of the warm rounds.

Caveat: client, server and Redis share this machine's cores (2 here), unlike Lambda, where the
server side runs elsewhere; the client-side CPU time per invocation is reported separately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nitro.actors.events import ActorEvent  # noqa: E402
from nitro.actors.lambda_ import LambdaActorBackend  # noqa: E402
from nitro.cache import LocalRedisServer, TrajectoryCache, connect_redis  # noqa: E402
from nitro.config import LambdaConfig  # noqa: E402

FUNCTION = "nitro-actor-bench"


def start_invoke_server(concurrency: int, duration: float, threads_per_worker: int, workdir: str) -> tuple[subprocess.Popen, str]:
    ready = os.path.join(workdir, "invoke-server.port")
    cmd = [sys.executable, "-m", "nitro.actors.invoke_server", "--port", "0", "--function", FUNCTION,
           "--concurrency", str(concurrency), "--threads-per-worker", str(threads_per_worker),
           "--timeout-s", str(max(30.0, duration * 10)), "--simulate-duration-s", str(duration), "--ready-file", ready]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            err = proc.stderr.read().decode() if proc.stderr else ""
            proc.kill()
            raise RuntimeError(f"invoke server did not start: {err[-2000:]}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{open(ready).read().strip()}"


def one_round(backend: LambdaActorBackend, cache: TrajectoryCache, redis_url: str, run_id: str, round_idx: int, n: int) -> dict:
    done_key = cache.done_key(round_idx)
    watcher_client = connect_redis(redis_url, max_connections=2)
    arrived: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        count = 0
        while count < n and not stop.is_set():
            got = watcher_client.blpop([done_key], timeout=1)
            if got is not None:
                count += 1
                arrived.append(time.perf_counter())

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    cpu0 = time.process_time()
    t0 = time.perf_counter()  # the scaling decision is made: N actors
    events = [ActorEvent(run_id=run_id, round=round_idx, invocation_id=f"{run_id}-r{round_idx:05d}-{i:04d}",
                         weights_key=cache.weights_key(round_idx), env_id="Hopper-v5", seed=i, n_steps=512,
                         cache_url=redis_url) for i in range(n)]
    summaries = backend.invoke_many(events)
    t_return = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    w.join(timeout=30)
    stop.set()
    watcher_client.close()
    failures = [s.error for s in summaries if not s.ok]
    stored = sum(1 for i in range(n) if cache.client.exists(cache.batch_key(round_idx, f"{run_id}-r{round_idx:05d}-{i:04d}")))
    t_redis = (arrived[-1] - t0) if len(arrived) == n else float("nan")
    first = (arrived[0] - t0) if arrived else float("nan")
    return {"n": n, "all_in_redis_s": t_redis, "first_in_redis_s": first, "returned_s": t_return,
            "failures": len(failures), "failure_examples": failures[:3], "stored": stored,
            "client_cpu_s": cpu, "billed_ms_median": statistics.median([s.billed_ms for s in summaries]) if summaries else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256,1000")
    p.add_argument("--duration", type=float, default=1.0, help="simulated function duration (s)")
    p.add_argument("--rounds", type=int, default=3, help="warm rounds per size (after one cold round)")
    p.add_argument("--threads-per-worker", type=int, default=0, help="default: half the largest size (2 worker processes)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fanout.json"))
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    workdir = tempfile.mkdtemp(prefix="nitro-fanout-")
    top = max(sizes)
    tpw = args.threads_per_worker or max(1, (top + 1) // 2 + 8)
    results = []
    with LocalRedisServer(os.path.join(workdir, "redis"), appendonly=False) as redis_srv:
        proc, url = start_invoke_server(concurrency=top + 16, duration=args.duration, threads_per_worker=tpw, workdir=workdir)
        try:
            client = connect_redis(redis_srv.url)
            run_id = "fanout"
            cache = TrajectoryCache(client, run_id, ttl_s=3600)
            round_idx = 0
            # Start the server's worker processes (cold starts are not what is measured here).
            with LambdaActorBackend(LambdaConfig(function_name=FUNCTION, endpoint_url=url, concurrency=8, function_timeout_s=60),
                                    memory_mb=1024, timeout_s=120) as be:
                one_round(be, cache, redis_srv.url, run_id, round_idx, 8)
                round_idx += 1
            for n in sizes:
                cfg = LambdaConfig(function_name=FUNCTION, endpoint_url=url, concurrency=n, function_timeout_s=60)
                with LambdaActorBackend(cfg, memory_mb=1024, timeout_s=120) as be:
                    cold = one_round(be, cache, redis_srv.url, run_id, round_idx, n)
                    round_idx += 1
                    warm = []
                    for _ in range(args.rounds):
                        warm.append(one_round(be, cache, redis_srv.url, run_id, round_idx, n))
                        round_idx += 1
                    throttled = be.stats["throttled"]
                med = statistics.median(r["all_in_redis_s"] for r in warm)
                row = {
                    "n": n,
                    "all_in_redis_s_median": med,
                    "all_in_redis_s_rounds": [r["all_in_redis_s"] for r in warm],
                    "returned_s_median": statistics.median(r["returned_s"] for r in warm),
                    "first_in_redis_s_median": statistics.median(r["first_in_redis_s"] for r in warm),
                    "overhead_ratio": (med - args.duration) / args.duration,
                    "client_cpu_ms_per_invocation": 1000 * statistics.median(r["client_cpu_s"] for r in warm) / n,
                    "cold_client": {"all_in_redis_s": cold["all_in_redis_s"], "overhead_ratio": (cold["all_in_redis_s"] - args.duration) / args.duration},
                    "failures": sum(r["failures"] for r in warm) + cold["failures"],
                    "failure_examples": [e for r in warm + [cold] for e in r["failure_examples"]][:3],
                    "stored_every_batch": all(r["stored"] == n for r in warm + [cold]),
                    "throttled": throttled,
                }
                results.append(row)
                print(f"N={n:5d}  all in Redis {med:6.3f}s  overhead x{row['overhead_ratio']:.3f} of {args.duration:g}s  "
                      f"(returned {row['returned_s_median']:.3f}s, cold client x{row['cold_client']['overhead_ratio']:.3f}, "
                      f"client CPU {row['client_cpu_ms_per_invocation']:.2f} ms/inv, failures {row['failures']})", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    report = {
        "benchmark": "fanout: decision made -> all trajectories in Redis",
        "simulated_duration_s": args.duration,
        "rounds_per_size": args.rounds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "loadavg_at_end": os.getloadavg()},
        "server": {"kind": "nitro.actors.invoke_server (aiohttp, real handler in simulate mode)", "processes": 2,
                   "threads_per_worker": tpw, "reserved_concurrency": top + 16},
        "client": "LambdaActorBackend: one boto3 client, max_pool_connections=N, SDK retries off, semaphore N, N threads",
        "results": results,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
