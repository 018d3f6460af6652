"""What a round costs in Prefect + MLflow bookkeeping, and a round of 1000 actors through a real Prefect server.

    python bench/orchestration_overhead.py [--actors 8,16,64] [--apis ephemeral,server] [--rounds 6]
        [--steps 512] [--big-round 1000] [--big-dbs sqlite,postgres] [--big-rounds 3]
        [--out bench/results/orchestration_overhead.json]

Part 1, the share (target: at most 3% of a steady round). The REAL ``nitro-train`` flow
(flows/training.py) on Hopper-v5 with PPO, ``scaler.name=fixed``, N local actors of --steps steps
(one run per N and per API, each in a fresh child process with a fresh MLflow SQLite store), against

* ``ephemeral``: no ``PREFECT_API_URL``, so Prefect starts its temporary API server on SQLite, as
  ``nitro train`` does (the quick start's path);
* ``server``: a ``prefect server start`` on SQLite started here (the README's "Run it from Prefect").

Both get the settings every Nitro entry point applies (flows/settings.py). Per round k it records,
from the engine: ``learner_s``, ``detection_s``, ``actor_s`` (the work); and by wrapping functions
at run time (no source edits): the round flow's body, the ``record-round`` task (MLflow log,
checkpoint, artifacts) and every HTTP call the Prefect client makes (endpoint, duration, status).
One loop turn is ``iteration_s`` (from one ``record-round`` end to the next: the subflow call, the
body, the record); ``bookkeeping_s = iteration_s - work_s`` and the figure is
``sum(bookkeeping_s) / sum(iteration_s)`` over the steady rounds (k >= 1; round 0 has no update).
Also reported: where the bookkeeping went (subflow call, the tasks inside the round, record-round
and within it MLflow and the checkpoint), the Prefect API time by endpoint, and the flow process's
CPU per round. ``actor_s`` is the wall time of the mapped actor tasks, so Prefect's per-task cost
that overlaps the actors is inside it; it is not hidden in CPU terms: ``client_cpu_s`` is all of
the flow process's CPU (learner included).

Part 2, ``--big-round N``: the same flow with ``backend.kind=lambda`` against the local Invoke API
server (tests/support/lambda_invoke_server.py, the real handler in simulate mode: --big-duration s,
then a small env-shaped batch to Redis), N actors per round, --big-rounds rounds, against a real
``prefect server`` on SQLite and on PostgreSQL (deployments/prefect/postgres.sh starts a private
one). Per round: wall time, the bookkeeping share, the launch (decision -> last request left the
client), the Prefect API time; then the server's side: the task runs it recorded (``invoke-actor``
runs COMPLETED, expected N per round) and how long after the last round they were all in, the
latency of ``GET /api/health`` sampled every 0.5 s during the run, the 5xx answers the client got
and the "database is locked" lines in the server's log.

Caveat: on a 2-core machine the learner, the actors (or the Invoke server), Redis, the API server
and the database share the cores. Run it on an otherwise idle machine; read shares as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import fake_aws_credentials, machine, mlflow_uri, start_invoke_server, stop_process  # noqa: E402  # bench/ on sys.path first

PREFECT = str(Path(sys.executable).with_name("prefect"))
POSTGRES_SH = ROOT / "deployments" / "prefect" / "postgres.sh"
TARGET_SHARE = 0.03


# -- the child: one training run, instrumented ---------------------------------------------------


class ApiTrace:
    """Every HTTP call of Prefect's clients in this process: (start, seconds, method, endpoint, status)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, str, str, int]] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        import prefect.client.base as base

        for cls, is_async in ((base.PrefectHttpxAsyncClient, True), (base.PrefectHttpxSyncClient, False)):
            cls.send = self._wrap(cls.send, is_async)

    def _record(self, start: float, request, status: int) -> None:
        path = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "{id}", request.url.path)
        with self._lock:
            self.calls.append((start, time.monotonic() - start, request.method, path, status))

    def _wrap(self, send, is_async: bool):
        trace = self
        if is_async:
            async def asend(self, request, *args, **kwargs):
                start, status = time.monotonic(), 0
                try:
                    response = await send(self, request, *args, **kwargs)
                    status = response.status_code
                    return response
                finally:
                    trace._record(start, request, status)
            return asend

        def ssend(self, request, *args, **kwargs):
            start, status = time.monotonic(), 0
            try:
                response = send(self, request, *args, **kwargs)
                status = response.status_code
                return response
            finally:
                trace._record(start, request, status)
        return ssend

    def window(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        """Calls that started in [t0, t1): count and milliseconds per endpoint."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "ms": 0.0})
        for start, seconds, method, path, _ in self.calls:
            if t0 <= start < t1:
                out[f"{method} {path}"]["calls"] += 1
                out[f"{method} {path}"]["ms"] += 1000 * seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))

    def errors(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for *_, method, path, status in self.calls:
            if status >= 500 or status == 0:
                counts[f"{status} {method} {path}"] += 1
        return dict(counts)


def _timed(store: list, fn):
    """Wrap sync or async ``fn``; append its (start, seconds) to ``store``."""
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awrapper(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                store.append((t0, time.monotonic() - t0))
        return awrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            store.append((t0, time.monotonic() - t0))
    return wrapper


class HealthProbe:
    """GET /api/health every ``every_s`` in a thread: latency, or the error."""

    def __init__(self, api_url: str, every_s: float = 0.5):
        self.api_url, self.every_s = api_url, every_s
        self.samples: list[tuple[float, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=30) as client:
            while not self._stop.wait(self.every_s):
                t0 = time.monotonic()
                try:
                    ok = client.get(f"{self.api_url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.samples.append((t0, (time.monotonic() - t0) if ok else None))

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=35)

    def summary(self) -> dict:
        ok = sorted(s for _, s in self.samples if s is not None)
        return {"samples": len(self.samples), "failed": sum(s is None for _, s in self.samples),
                "median_ms": 1000 * statistics.median(ok) if ok else None,
                "p95_ms": 1000 * ok[int(0.95 * (len(ok) - 1))] if ok else None,
                "max_ms": 1000 * ok[-1] if ok else None}


def count_task_runs(api_url: str, name_prefix: str, state: str = "COMPLETED") -> int:
    import httpx

    body = {"task_runs": {"name": {"like_": name_prefix}, "state": {"type": {"any_": [state]}}}}
    return int(httpx.post(f"{api_url}/task_runs/count", json=body, timeout=60).json())


def child_main(args) -> int:
    """One instrumented training run; writes its measurements as JSON to --child-out."""
    import flows.round
    import flows.training
    import tasks.bookkeeping
    from nitro.run.runtime import ROUND_OBSERVERS, get_run
    from nitro.tracking.tracker import RunTracker

    trace = ApiTrace()
    trace.install()
    body, record, mlflow_log, checkpoint = [], [], [], []
    reports: list[dict] = []
    cpu_at_record_end: list[float] = []
    spans: list[float | None] = []
    launched: list[float | None] = []
    run_id = f"bench-orch-{args.actors}"

    flows.round.training_round.fn = _timed(body, flows.round.training_round.fn)
    flows.training.record_round = _timed(record, flows.training.record_round)
    RunTracker.log_round = _timed(mlflow_log, RunTracker.log_round)
    tasks.bookkeeping.save_checkpoint = _timed(checkpoint, tasks.bookkeeping.save_checkpoint)

    def observe(run, report) -> None:
        reports.append(dict(report.metrics))
        cpu_at_record_end.append(time.process_time())
        timings = getattr(get_run(run).backend, "timings", None)  # Lambda: when each invocation ran
        ids = [t for t in (timings or {}) if f"-r{report.round:05d}-" in t]
        first = min(timings[i].started for i in ids) if ids else 0.0
        spans.append(max(timings[i].answered or 0 for i in ids) - first if ids else None)
        launched.append(max((timings[i].sent or 0) for i in ids) - first if ids else None)

    ROUND_OBSERVERS.append(observe)
    home = Path(tempfile.mkdtemp(prefix="nitro-bench-orch-home-"))
    overrides = [
        "env_id=Hopper-v5", "scaler.name=fixed", f"scaler.fixed_actors={args.actors}",
        f"scaler.i_max={max(64, args.actors)}", f"steps_per_actor={args.steps}", f"rounds={args.rounds}",
        f"home={home}", f"tracking.mlflow_uri={mlflow_uri(home)}", "eval.every_rounds=0",
    ]
    if args.lambda_url:
        overrides += ["backend.kind=lambda", f"backend.lambda.endpoint_url={args.lambda_url}",
                      "backend.lambda.function_name=nitro-actor-bench", f"backend.lambda.concurrency={args.actors}",
                      "backend.lambda.function_timeout_s=120", "detector.subset_size=64"]
    else:
        overrides.append(f"backend.workers={args.workers}")
    api_url = os.environ.get("PREFECT_API_URL")
    t_start = time.monotonic()
    cpu0 = time.process_time()
    probe = HealthProbe(api_url) if api_url else None
    if probe:
        probe.__enter__()
    try:
        asyncio.run(flows.training.train(overrides=overrides, run_id=run_id))
    finally:
        if probe:
            probe.__exit__()
    run_end = time.monotonic()
    n = len(reports)
    assert n == args.rounds == len(body) == len(record), (n, len(body), len(record))

    rows = []
    prev_end, prev_cpu = None, cpu0
    for k, m in enumerate(reports):
        rec_start, rec_s = record[k]
        rec_end = rec_start + rec_s
        work = m["learner_s"] + m["detection_s"] + m["actor_s"]
        iteration = (rec_end - prev_end) if prev_end is not None else m["round_s"] + rec_s
        window_start = prev_end if prev_end is not None else rec_start - m["round_s"]
        rows.append({
            "round": k, "learner_s": m["learner_s"], "detection_s": m["detection_s"], "actor_s": m["actor_s"],
            "work_s": work, "round_s": m["round_s"], "orchestration_s_metric": m["orchestration_s"],
            "body_s": body[k][1], "subflow_call_s": m["round_s"] - body[k][1], "in_body_orch_s": body[k][1] - work,
            "record_s": rec_s, "mlflow_log_s": mlflow_log[k][1] if k < len(mlflow_log) else None,
            "checkpoint_s": checkpoint[k][1] if k < len(checkpoint) else None,
            "iteration_s": iteration, "bookkeeping_s": iteration - work,
            "client_cpu_s": cpu_at_record_end[k] - prev_cpu,
            "actors": m["actors_launched"], "actors_failed": m["actors_failed"],
            "backend_span_s": spans[k], "launch_s": launched[k],
            "api": trace.window(window_start, rec_end),
        })
        prev_end, prev_cpu = rec_end, cpu_at_record_end[k]

    out = {"rows": rows, "run_s": run_end - t_start, "api_errors": trace.errors(),
           "health": probe.summary() if probe else None}
    if args.lambda_url and api_url:  # what the server recorded, and how long after the run
        expected, waited, seen = args.actors * args.rounds, 0.0, 0
        while waited < args.record_wait_s:
            seen = count_task_runs(api_url, "actor-")
            if seen >= expected:
                break
            time.sleep(1.0)
            waited = time.monotonic() - run_end
        out["task_runs"] = {"expected_completed": expected, "completed": seen,
                            "all_recorded_after_run_s": waited if seen >= expected else None,
                            "state_events_per_task_run": 3}
    Path(args.child_out).write_text(json.dumps(out, default=str))
    return 0


# -- the parent: servers, the matrix, the summary ------------------------------------------------


def summarize(rows: list[dict]) -> dict:
    def total(key: str) -> float:
        return sum(r[key] or 0.0 for r in rows)

    it = total("iteration_s")
    api: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "ms": 0.0})
    for r in rows:
        for endpoint, v in r["api"].items():
            api[endpoint]["calls"] += v["calls"] / len(rows)
            api[endpoint]["ms"] += v["ms"] / len(rows)
    return {
        "rounds": len(rows),
        "iteration_s": it,
        "work_s": total("work_s"),
        "share_bookkeeping": total("bookkeeping_s") / it,
        "metric_share_orchestration_over_round": total("orchestration_s_metric") / total("round_s"),
        "share_subflow_call": total("subflow_call_s") / it,
        "share_in_body_orchestration": total("in_body_orch_s") / it,
        "share_record_round": total("record_s") / it,
        "share_mlflow_log": total("mlflow_log_s") / it,
        "share_checkpoint": total("checkpoint_s") / it,
        "share_learner": total("learner_s") / it,
        "share_detection": total("detection_s") / it,
        "share_actor": total("actor_s") / it,
        "mean_iteration_s": it / len(rows),
        "mean_bookkeeping_ms": 1000 * total("bookkeeping_s") / len(rows),
        "mean_subflow_call_ms": 1000 * total("subflow_call_s") / len(rows),
        "mean_in_body_orch_ms": 1000 * total("in_body_orch_s") / len(rows),
        "mean_record_ms": 1000 * total("record_s") / len(rows),
        "mean_client_cpu_s": total("client_cpu_s") / len(rows),
        "api_per_round": dict(sorted(api.items(), key=lambda kv: -kv[1]["ms"])),
        "api_ms_per_round": sum(v["ms"] for v in api.values()),
    }


class PrefectServer:
    """``prefect server start`` in its own PREFECT_HOME on a free port; SQLite unless ``db_url``."""

    def __init__(self, workdir: Path, db_url: str | None = None):
        from nitro.cache import free_port

        workdir.mkdir(parents=True, exist_ok=True)
        self.home = workdir / "prefect-server-home"
        self.log = workdir / "prefect-server.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
        env.update(PREFECT_HOME=str(self.home), PREFECT_UI_ENABLED="false", PREFECT_SERVER_LOGGING_LEVEL="WARNING")
        if db_url:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = db_url
        with open(self.log, "wb") as log_file:  # the child holds its own copy of the descriptor
            self.proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                                         env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server not healthy in 120 s: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def locked_lines(self) -> int:
        return self.log.read_text(errors="replace").lower().count("database is locked")

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        except ProcessLookupError:
            pass


def run_child(args, actors: int, api_url: str | None, lambda_url: str | None, rounds: int, workdir: Path) -> dict:
    out = workdir / f"child-{actors}-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PREFECT_HOME"] = str(workdir / f"client-home-{actors}-{time.monotonic_ns()}")  # a fresh ephemeral server
    if api_url:
        env["PREFECT_API_URL"] = api_url
    cmd = [sys.executable, __file__, "--child-out", str(out), "--child-actors", str(actors), "--rounds", str(rounds),
           "--steps", str(args.steps if not lambda_url else 4), "--workers", str(args.workers),
           "--record-wait-s", str(args.record_wait_s)]
    if lambda_url:
        cmd += ["--child-lambda-url", lambda_url]
    subprocess.run(cmd, check=True, env=env, cwd=str(ROOT))
    result = json.loads(out.read_text())
    result["summary_all_rounds"] = summarize(result["rows"])
    result["summary_steady_rounds"] = summarize(result["rows"][1:]) if len(result["rows"]) > 1 else None
    return result


def describe(label: str, r: dict) -> str:
    s = r["summary_steady_rounds"] or r["summary_all_rounds"]
    api = ", ".join(f"{k} {v['ms']:.0f} ms" for k, v in list(s["api_per_round"].items())[:4])
    return (f"{label}: bookkeeping {100 * s['share_bookkeeping']:.2f}% of a steady round (target <= "
            f"{100 * TARGET_SHARE:.0f}%; {s['mean_bookkeeping_ms']:.0f} ms of {s['mean_iteration_s']:.2f} s): "
            f"subflow call {s['mean_subflow_call_ms']:.0f} ms, tasks in the round {s['mean_in_body_orch_ms']:.0f} ms, "
            f"record-round {s['mean_record_ms']:.0f} ms; client CPU {s['mean_client_cpu_s']:.2f} s/round; "
            f"API per round {s['api_ms_per_round']:.0f} ms ({api})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", default="8,16,64", help="actor counts for part 1")
    p.add_argument("--apis", default="ephemeral,server", help="ephemeral (nitro train's own) and/or server")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--big-round", type=int, default=0,
                   help="part 2: actors in each round through a real server (0: skip)")
    p.add_argument("--big-dbs", default="sqlite,postgres")
    p.add_argument("--big-rounds", type=int, default=3)
    p.add_argument("--big-duration", type=float, default=1.0, help="simulated actor duration (s) in part 2")
    p.add_argument("--record-wait-s", type=float, default=300.0,
                   help="part 2: how long to wait for the server to record every task run")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "orchestration_overhead.json")
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-actors", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-lambda-url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    from flows.settings import apply_prefect_defaults

    apply_prefect_defaults()  # what `nitro train` and the README's server command use
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    if args.child_out:
        args.actors, args.lambda_url = args.child_actors, args.child_lambda_url
        return child_main(args)

    import mlflow
    import prefect
    import torch

    workdir = Path(tempfile.mkdtemp(prefix="nitro-bench-orch-"))
    load_before = os.getloadavg()
    started = time.monotonic()
    share: dict[str, dict] = {}
    for api in [a for a in args.apis.split(",") if a]:
        server = PrefectServer(workdir / f"{api}-server") if api == "server" else None
        try:
            for n in [int(x) for x in args.actors.split(",") if x]:
                label = f"{api}/{n} actors"
                print(f"\n=== {label} ===", flush=True)
                share[label] = run_child(args, n, server.url if server else None, None, args.rounds, workdir)
                print(describe(label, share[label]), flush=True)
        finally:
            if server:
                server.stop()

    big: dict[str, dict] = {}
    if args.big_round:
        fake_aws_credentials()
        n = args.big_round
        inv_proc, inv_url = start_invoke_server("nitro-actor-bench", concurrency=n + 16, duration_s=args.big_duration,
                                                threads_per_worker=n // 2 + 8, workdir=str(workdir), timeout_s=120)
        try:
            for db in [d for d in args.big_dbs.split(",") if d]:
                print(f"\n=== {n} actors per round, prefect server on {db} ===", flush=True)
                pg_dir = Path(tempfile.mkdtemp(prefix="nitro-bench-pg-"))  # reachable by the postgres user
                db_url = None
                if db == "postgres":
                    if not shutil.which("bash"):
                        raise SystemExit("bash is needed for deployments/prefect/postgres.sh")
                    db_url = subprocess.run(["bash", str(POSTGRES_SH), "start", str(pg_dir)], check=True,
                                            capture_output=True, text=True).stdout.strip()
                server = PrefectServer(workdir / f"big-{db}", db_url)
                try:
                    r = run_child(args, n, server.url, inv_url, args.big_rounds, workdir)
                    r["database_locked_lines_in_server_log"] = server.locked_lines()
                    r["database"] = db
                finally:
                    server.stop()
                    if db == "postgres":
                        subprocess.run(["bash", str(POSTGRES_SH), "stop", str(pg_dir)], check=False)
                big[db] = r
                rows = r["rows"]
                print(describe(f"{db}/{n} actors", r), flush=True)
                print(f"  round wall {[round(x['iteration_s'], 2) for x in rows]} s, launch (last request left) "
                      f"{[None if x['launch_s'] is None else round(x['launch_s'], 3) for x in rows]} s; task runs "
                      f"{r.get('task_runs')}; health {r['health']}; 5xx {r['api_errors']}; 'database is locked' "
                      f"lines {r['database_locked_lines_in_server_log']}", flush=True)
        finally:
            stop_process(inv_proc)

    out = {
        "bench": "orchestration_overhead",
        "target_share": TARGET_SHARE,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(loadavg_before=load_before, loadavg_after=os.getloadavg()),
        "versions": {"prefect": prefect.__version__, "mlflow": mlflow.__version__, "torch": torch.__version__},
        "prefect_env": {k: v for k, v in os.environ.items() if k.startswith("PREFECT_SERVER_SERVICES")},
        "config": {"env_id": "Hopper-v5", "algo": "ppo", "scaler": "fixed", "steps_per_actor": args.steps,
                   "rounds": args.rounds, "backend_workers": args.workers, "eval": "off",
                   "big_round": {"actors": args.big_round, "rounds": args.big_rounds,
                                 "simulated_duration_s": args.big_duration} if args.big_round else None},
        "share": share,
        "big_round": big,
        "wall_s": time.monotonic() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print("\n| path | actors | steady round | bookkeeping | share | subflow call | tasks in round | record-round "
          "| API / round |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    big_rows = [(f"server on {db}/{r['rows'][0]['actors']:.0f} actors", r) for db, r in big.items()]
    for label, r in list(share.items()) + big_rows:
        s = r["summary_steady_rounds"] or r["summary_all_rounds"]
        api, n = label.split("/")
        print(f"| {api} | {n.split()[0]} | {s['mean_iteration_s']:.2f} s | {s['mean_bookkeeping_ms']:.0f} ms | "
              f"{100 * s['share_bookkeeping']:.2f}% | {s['mean_subflow_call_ms']:.0f} ms | "
              f"{s['mean_in_body_orch_ms']:.0f} ms | {s['mean_record_ms']:.0f} ms | {s['api_ms_per_round']:.0f} ms |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
