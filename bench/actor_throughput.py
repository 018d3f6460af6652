"""Env steps per second through the local actor backend vs a bare gymnasium + policy loop.

Both sides run on this machine, in this run, with the same number of processes (default: the CPU
count), the same env (Hopper-v5), the same policy (2x256 tanh, ``Policy.sample`` per step) and
the same total number of steps per measurement. Measurements alternate (bare, local, bare, ...)
so load from other users hits both alike; the medians and their ratio are reported.

* local: ``LocalActorPool.invoke_many`` of I events (I actors x S steps), weights published to a
  real ``LocalRedisServer``; each actor fetches weights (cached while warm), rolls out, serialises
  and writes its batch to Redis, and returns its summary. Timed from the call to the last summary.
* bare: N warm processes, each steps env + ``policy.sample`` for I*S/N steps in a plain loop,
  nothing stored. Timed from the go signal to the last process done.

    python bench/actor_throughput.py [--workers N] [--actors 32] [--steps 512] [--repeats 5]

Writes bench/results/actor_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _common import machine  # noqa: E402  # bench/ on sys.path first

ENV_ID = "Hopper-v5"


# -- the bare loop, in its own processes -----------------------------------------------------------


def _bare_worker(fd: int, seed: int) -> None:
    """Warm bare-loop process: build env + policy once, then run plain loops on command."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    from multiprocessing.connection import Connection

    import numpy as np
    import torch

    from nitro.envs import env_spec, make_env
    from nitro.models.networks import build_policy

    torch.set_num_threads(1)
    conn = Connection(fd)
    spec = env_spec(ENV_ID)
    policy = build_policy(spec, seed=0).eval()
    env = make_env(ENV_ID, seed=seed)
    low, high = env.action_space.low, env.action_space.high
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    conn.send_bytes(b'{"ready": true}')
    while True:
        data = conn.recv_bytes()
        if not data:
            break
        n = json.loads(data)["steps"]
        t0 = time.perf_counter()
        for _ in range(n):
            action, _logp = policy.sample(obs, rng)
            obs, _r, term, trunc, _ = env.step(np.clip(action, low, high))
            if term or trunc:
                obs, _ = env.reset()
        conn.send_bytes(json.dumps({"elapsed": time.perf_counter() - t0}).encode())
    os._exit(0)


class BareLoops:
    def __init__(self, n: int):
        from multiprocessing.connection import Connection

        self.procs, self.conns = [], []
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MUJOCO_GL="disable")
        for i in range(n):
            a, b = socket.socketpair()
            p = subprocess.Popen([sys.executable, __file__, "--bare-worker", str(b.fileno()), str(1000 + i)],
                                 pass_fds=(b.fileno(),), env=env)
            b.close()
            self.procs.append(p)
            self.conns.append(Connection(a.detach()))
        for c in self.conns:
            if not c.poll(300):
                raise RuntimeError("bare-loop worker did not start")
            c.recv_bytes()

    def run(self, total_steps: int) -> float:
        each = total_steps // len(self.conns)
        t0 = time.perf_counter()
        for c in self.conns:
            c.send_bytes(json.dumps({"steps": each}).encode())
        for c in self.conns:
            c.recv_bytes()
        return (each * len(self.conns)) / (time.perf_counter() - t0)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(b"")
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- the benchmark ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--actors", type=int, default=32, help="invocations per measurement")
    ap.add_argument("--steps", type=int, default=512, help="env steps per actor (paper: 256-512)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "actor_throughput.json")
    args = ap.parse_args()

    from nitro.actors.events import ActorEvent, invocation_id
    from nitro.actors.local import LocalActorPool
    from nitro.cache import LocalRedisServer, TrajectoryCache, connect_redis
    from nitro.envs import env_spec
    from nitro.models.networks import build_policy
    from nitro.serialization import dumps_tensors

    total = args.actors * args.steps
    run_id = "bench"
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="nitro-bench-") as tmp, LocalRedisServer(tmp) as server:
        client = connect_redis(server.url)
        cache = TrajectoryCache(client, run_id, ttl_s=3600)
        policy = build_policy(env_spec(ENV_ID), seed=0)
        meta = {"env_id": ENV_ID, "version": 0, "format": "nitro.policy/1"}
        wkey = cache.publish_weights(0, dumps_tensors(policy.state_dict(), meta))

        def events(round_idx: int, n: int, steps: int) -> list[ActorEvent]:
            return [
                ActorEvent(run_id=run_id, round=round_idx, invocation_id=invocation_id(run_id, round_idx, i),
                           weights_key=wkey, env_id=ENV_ID, seed=round_idx * 10_000 + i, n_steps=steps,
                           cache_url=server.url, batch_ttl_s=3600)
                for i in range(n)
            ]

        t0 = time.perf_counter()
        pool = LocalActorPool(workers=args.workers, timeout_s=300, memory_mb=1024)
        startup_s = time.perf_counter() - t0
        bare = BareLoops(args.workers)
        try:
            warm = pool.invoke_many(events(1, 2 * args.workers, 64))  # env, policy, weights, Redis client per worker
            assert all(s.ok for s in warm), [s.error for s in warm if not s.ok]
            bare.run(64 * args.workers)
            local_sps, bare_sps, batch_bytes = [], [], 0
            failed: list[str] = []
            for r in range(args.repeats):
                bare_sps.append(bare.run(total))
                evs = events(2 + r, args.actors, args.steps)
                t0 = time.perf_counter()
                summaries = pool.invoke_many(evs)
                wall = time.perf_counter() - t0
                bad = [s.error for s in summaries if not s.ok]
                if bad:  # counted conservatively: their time is in the wall clock, their steps are not
                    failed.extend(bad)
                    print(f"  {len(bad)} invocation(s) failed: {bad[0]}", flush=True)
                steps = sum(s.steps for s in summaries if s.ok)
                local_sps.append(steps / wall)
                batch_bytes = summaries[0].batch_bytes
                cache.delete_round(2 + r)
                print(f"repeat {r + 1}/{args.repeats}: bare {bare_sps[-1]:8.0f} steps/s   "
                      f"local {local_sps[-1]:8.0f} steps/s   ratio {local_sps[-1] / bare_sps[-1]:.3f}", flush=True)
        finally:
            pool.close()
            bare.close()
            client.close()

    local_med, bare_med = statistics.median(local_sps), statistics.median(bare_sps)
    ratio = local_med / bare_med
    result = {
        "benchmark": "actor_throughput",
        "env_id": ENV_ID,
        "policy": "2x256 tanh Gaussian, Policy.sample per step (torch, 1 thread per process)",
        "processes": args.workers,
        "actors_per_measurement": args.actors,
        "steps_per_actor": args.steps,
        "steps_per_measurement": total,
        "repeats": args.repeats,
        "local_steps_per_s": [round(x, 1) for x in local_sps],
        "bare_steps_per_s": [round(x, 1) for x in bare_sps],
        "local_steps_per_s_median": round(local_med, 1),
        "bare_steps_per_s_median": round(bare_med, 1),
        "ratio_local_over_bare": round(ratio, 4),
        "ratio_per_repeat": [round(a / b, 4) for a, b in zip(local_sps, bare_sps)],
        "target_ratio": 0.8,
        "meets_target": ratio >= 0.8,
        "pool_startup_s": round(startup_s, 2),
        "failed_invocations": len(failed),
        "failure_reasons": sorted(set(failed)),
        "batch_bytes_per_actor": batch_bytes,
        "local_path": "LocalActorPool.invoke_many -> run_actor (weights from Redis, rollout, safetensors, "
                      "SET NX + RPUSH) -> summary",
        "bare_path": "env.step + Policy.sample in a plain loop, nothing stored",
        "machine": machine(load_avg_before=[round(x, 2) for x in load_before],
                           load_avg_after=[round(x, 2) for x in os.getloadavg()]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"local backend: {local_med:.0f} env steps/s   bare loop: {bare_med:.0f} env steps/s   "
          f"ratio {ratio:.3f} (target >= 0.8)   -> {args.out}")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--bare-worker":
        _bare_worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
