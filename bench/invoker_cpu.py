"""Which Lambda client makes a flat fan-out: client CPU per invoke and dispatch spread, per client.

    python bench/invoker_cpu.py [--n 256] [--rounds 4] [--duration 0.5] [--processes 2]
                                [--aiobotocore-path DIR] [--out bench/results/invoker_cpu.json]

The candidates the issue named, each in its own process (so its CPU is its own), against the local
Invoke API server (another process, the real handler in simulate mode, --duration s) and a real
Redis, N invocations at once per round, one cold round then --rounds warm ones:

* ``boto3-threads``: the previous invoker, one shared boto3 client called from N threads
  (``LambdaActorBackend(invoker="boto3")``);
* ``boto3-processes``: the same split over --processes invoker processes, N/P invocations each
  (CPU summed over the processes; process start-up not counted);
* ``aiobotocore``: one aiobotocore client, N coroutines (``asyncio.gather``). aiobotocore 3.10 pins
  ``botocore<1.43.118``, older than the boto3 1.44.5 this project installs, so it is measured from
  a separate directory (``pip install --target DIR aiobotocore==3.10.0 "botocore>=1.43.115,<1.43.118"``,
  then ``--aiobotocore-path DIR``) and skipped without one;
* ``aiohttp-sigv4``: the chosen invoker (``LambdaActorBackend(invoker="aiohttp")``): one event
  loop, aiohttp, SigV4 signed by ``nitro.actors.lambda_http.InvokeSigner``.

Per client: client CPU ms per invoke (median over warm rounds), the dispatch spread (decision ->
last request left the client; not available for aiobotocore, which has no hook for it), and the
round's wall time until all N answers are back.
"""

from __future__ import annotations

import argparse
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

from _common import fake_aws_credentials, machine, start_invoke_server, stop_process  # noqa: E402  # bench/ on sys.path first

FUNCTION = "nitro-actor-cpu"
CLIENTS = ("boto3-threads", "boto3-processes", "aiobotocore", "aiohttp-sigv4")


def _events(n: int, round_idx: int, redis_url: str, tag: str, offset: int = 0) -> list:
    from nitro.actors.events import ActorEvent

    return [ActorEvent(run_id="cpu", round=round_idx, invocation_id=f"cpu-r{round_idx:05d}-{tag}{offset + i:04d}",
                       weights_key="nitro:cpu:w", env_id="Hopper-v5", seed=i, n_steps=8, cache_url=redis_url)
            for i in range(n)]


def _backend_round(invoker: str, url: str, n: int, rounds: int, redis_url: str, tag: str, offset: int = 0,
                   go=None) -> list[dict]:
    """Rounds of ``invoke_many`` through LambdaActorBackend; per round CPU, dispatch, wall."""
    from nitro.actors.lambda_ import LambdaActorBackend
    from nitro.config import LambdaConfig

    cfg = LambdaConfig(function_name=FUNCTION, endpoint_url=url, concurrency=n, function_timeout_s=60, invoker=invoker)
    out = []
    with LambdaActorBackend(cfg, timeout_s=120) as backend:
        for k in range(rounds + 1):
            events = _events(n, k, redis_url, tag, offset)
            t0 = go(k) if go is not None else time.monotonic()
            cpu0 = time.process_time()
            summaries = backend.invoke_many(events)
            cpu = time.process_time() - cpu0
            sent = max(backend.timings[e.invocation_id].sent for e in events)
            out.append({"cpu_s": cpu, "t0": t0, "last_sent": sent, "done": time.monotonic(),
                        "failures": sum(not s.ok for s in summaries)})
    return out


def child_backend(args) -> dict:
    invoker = {"boto3-threads": "boto3", "aiohttp-sigv4": "aiohttp"}[args.child]
    rows = _backend_round(invoker, args.url, args.n, args.rounds, args.redis, args.child[:2])
    return {"rounds": [{"cpu_s": r["cpu_s"], "dispatch_s": r["last_sent"] - r["t0"], "wall_s": r["done"] - r["t0"],
                        "failures": r["failures"]} for r in rows]}


def _process_worker(url, n, rounds, redis_url, offset, conn) -> None:
    def go(k: int) -> float:
        conn.send(("ready", k))
        return conn.recv()  # the parent's t0 for round k

    conn.send(("rows", _backend_round("boto3", url, n, rounds, redis_url, "bp", offset, go)))


def child_processes(args) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    share = [args.n // args.processes + (1 if i < args.n % args.processes else 0) for i in range(args.processes)]
    pipes, procs = [], []
    for i, n in enumerate(share):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_process_worker, args=(args.url, n, args.rounds, args.redis, sum(share[:i]), child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for k in range(args.rounds + 1):
        for conn in pipes:
            assert conn.recv() == ("ready", k)
        t0 = time.monotonic()
        for conn in pipes:
            conn.send(t0)
    per_process = [conn.recv()[1] for conn in pipes]
    for proc in procs:
        proc.join()
    rounds = []
    for k in range(args.rounds + 1):
        rows = [p[k] for p in per_process]
        t0 = rows[0]["t0"]
        rounds.append({"cpu_s": sum(r["cpu_s"] for r in rows), "dispatch_s": max(r["last_sent"] for r in rows) - t0,
                       "wall_s": max(r["done"] for r in rows) - t0, "failures": sum(r["failures"] for r in rows)})
    return {"rounds": rounds, "processes": args.processes}


def child_aiobotocore(args) -> dict:
    import asyncio

    import botocore
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    async def run() -> list[dict]:
        config = AioConfig(max_pool_connections=args.n, read_timeout=90, connect_timeout=5,
                           retries={"mode": "standard", "total_max_attempts": 1}, parameter_validation=False)
        rows = []
        async with get_session().create_client("lambda", endpoint_url=args.url, region_name="us-east-1",
                                               config=config) as client:
            async def one(event) -> bool:
                resp = await client.invoke(FunctionName=FUNCTION, InvocationType="RequestResponse", LogType="Tail",
                                           Payload=event.model_dump_json().encode())
                await resp["Payload"].read()
                return "FunctionError" not in resp

            for k in range(args.rounds + 1):
                events = _events(args.n, k, args.redis, "ab")
                t0, cpu0 = time.monotonic(), time.process_time()
                ok = await asyncio.gather(*(one(e) for e in events), return_exceptions=True)
                rows.append({"cpu_s": time.process_time() - cpu0, "dispatch_s": None, "wall_s": time.monotonic() - t0,
                             "failures": sum(r is not True for r in ok)})
        return rows

    return {"rounds": asyncio.run(run()), "botocore": botocore.__version__}


def run_child(client: str, args, url: str, redis_url: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if client == "aiobotocore":
        if not args.aiobotocore_path:
            return {"skipped": "aiobotocore pins botocore<1.43.118 (this project has boto3/botocore 1.44.5); "
                               "install it in a separate directory and pass --aiobotocore-path"}
        env["PYTHONPATH"] = os.pathsep.join([args.aiobotocore_path, str(ROOT)])
    cmd = [sys.executable, __file__, "--child", client, "--url", url, "--redis", redis_url, "--n", str(args.n),
           "--rounds", str(args.rounds), "--processes", str(args.processes)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    warm = rows["rounds"][1:]
    dispatch = [r["dispatch_s"] for r in warm if r["dispatch_s"] is not None]
    return {**{k: v for k, v in rows.items() if k != "rounds"},
            "client_cpu_ms_per_invoke": 1000 * statistics.median(r["cpu_s"] for r in warm) / args.n,
            "dispatch_s_median": statistics.median(dispatch) if dispatch else None,
            "wall_s_median": statistics.median(r["wall_s"] for r in warm),
            "failures": sum(r["failures"] for r in rows["rounds"]), "rounds": rows["rounds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256, help="invocations at once per round")
    p.add_argument("--rounds", type=int, default=4, help="warm rounds per client (after one cold round)")
    p.add_argument("--duration", type=float, default=0.5, help="simulated function duration (s)")
    p.add_argument("--processes", type=int, default=2, help="invoker processes for boto3-processes")
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--aiobotocore-path", default=None, help="a --target directory holding aiobotocore and its botocore")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "invoker_cpu.json"))
    p.add_argument("--child", choices=CLIENTS, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--redis", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    fake_aws_credentials()
    if args.child:
        run = {"boto3-processes": child_processes, "aiobotocore": child_aiobotocore}.get(args.child, child_backend)
        print(json.dumps(run(args)))
        return 0

    from nitro.cache import LocalRedisServer

    workdir = tempfile.mkdtemp(prefix="nitro-invoker-cpu-")
    results = {}
    load_before = os.getloadavg()
    with LocalRedisServer(os.path.join(workdir, "redis"), appendonly=False) as redis_srv:
        proc, url = start_invoke_server(FUNCTION, concurrency=args.n + 16, duration_s=args.duration,
                                        threads_per_worker=args.n // 2 + 8, workdir=workdir)
        try:
            for client in args.clients.split(","):
                results[client] = r = run_child(client, args, url, redis_srv.url)
                if "client_cpu_ms_per_invoke" in r:
                    dispatch = "n/a" if r["dispatch_s_median"] is None else f"{r['dispatch_s_median']:.3f} s"
                    print(f"{client:>16}: client CPU {r['client_cpu_ms_per_invoke']:.3f} ms/invoke, last request left "
                          f"after {dispatch}, all answered after {r['wall_s_median']:.3f} s, failures {r['failures']}",
                          flush=True)
                else:
                    print(f"{client:>16}: {r}", flush=True)
        finally:
            stop_process(proc)
    report = {"benchmark": "invoker_cpu: client CPU per invoke and dispatch spread, per client",
              "n": args.n, "rounds": args.rounds, "simulated_duration_s": args.duration,
              "machine": machine(loadavg_before=load_before, loadavg_after=os.getloadavg()),
              "results": results, "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
