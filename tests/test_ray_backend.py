"""RayActorBackend against a real local Ray (one per module, 2 CPUs), real Redis and the real actor.

Faults are injected into the real worker as in tests/test_local_pool.py: the event's seed tells
``tests.support.actor_helpers:scripted`` to raise, segfault, ``os._exit``, hang or SIGKILL itself.
The module's Ray is a ``ray.cluster_utils.Cluster`` head, so that the placement test can add a
second node to it; a test that needs a Ray the backend owns runs it in a subprocess.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from nitro.actors.events import ActorEvent, invocation_id
from nitro.actors.ray_ import RayActorBackend, failure_reason
from nitro.config.backend import RayConfig
from tests.support.servers import becomes_true

ray = pytest.importorskip("ray")

HELPER = "tests.support.actor_helpers:scripted"
WHERE = "tests.support.actor_helpers:where"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# The deadline of an invocation of the real actor or learner function: each may need a fresh Ray
# worker that imports torch and MuJoCo, and under `pytest -n 4` on 2 cores CI saw one take over 120 s.
REAL_FUNCTION_DEADLINE_S = 300.0


def _event(i: int, seed: int = 0, n_steps: int = 10, round_idx: int = 0, run_id: str = "ray") -> ActorEvent:
    return ActorEvent(
        run_id=run_id,
        round=round_idx,
        invocation_id=invocation_id(run_id, round_idx, i),
        weights_key="k",
        env_id="Hopper-v5",
        seed=seed,
        n_steps=n_steps,
        cache_url="redis://127.0.0.1:1/0",
    )


def _pid_and_count(summary) -> tuple[int, int]:
    _, pid, count = summary.batch_key.split(":")
    return int(pid), int(count)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=True,
                head_node_args={"num_cpus": 2, "object_store_memory": 100 * 2**20, "include_dashboard": False})
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def backend(cluster):
    # A generous deadline: a worker that replaces a dead one starts and imports within it.
    with RayActorBackend(RayConfig(), timeout_s=60.0, memory_mb=512, actor_fn=HELPER) as b:
        yield b


def _cpus_free() -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_joins_the_connected_ray_and_caps_work_to_its_cpus(backend):
    assert not backend.session.owned and not backend.session.local  # the module's Ray stays up at close
    assert backend.capacity == 2


def test_warm_workers_are_reused(backend):
    summaries = [backend.invoke(_event(i, run_id="warm")) for i in range(8)]
    assert all(s.ok for s in summaries), [s.error for s in summaries]
    served: dict[int, list[int]] = {}
    for s in summaries:
        pid, count = _pid_and_count(s)
        served.setdefault(pid, []).append(count)
    assert len(served) <= 2  # no process per invocation
    assert max(len(c) for c in served.values()) >= 2  # a process served several, with its state kept
    assert all(counts == sorted(counts) and len(set(counts)) == len(counts) for counts in served.values())


@pytest.mark.parametrize("seed,reason", [
    (4, "RuntimeError: boom in the actor"),  # raises
    (1, "worker process died"),  # segfaults
    (2, "worker process died"),  # os._exit(3)
    (5, "worker process died"),  # SIGKILL, as the kernel's OOM killer sends
])
def test_a_failing_actor_is_a_failed_summary_and_the_next_invocation_succeeds(backend, seed, reason):
    s = backend.invoke(_event(seed, seed=seed, run_id=f"fault{seed}"))
    assert not s.ok and reason in s.error and s.invocation_id == invocation_id(f"fault{seed}", 0, seed)
    assert s.memory_mb == 512
    after = backend.invoke(_event(99, run_id=f"fault{seed}"))
    assert after.ok, after.error


def test_a_hung_actor_is_cut_at_its_timeout_and_its_cpu_is_free_again(backend):
    with RayActorBackend(RayConfig(), timeout_s=2.0, memory_mb=512, actor_fn=HELPER) as short:
        s = short.invoke(_event(3, seed=3, run_id="hung"))
        assert short.stats["timeouts"] == 1
    assert not s.ok and "timed out after 2s" in s.error and "cancelled with force" in s.error
    assert s.duration_s >= 2.0 and s.billed_ms >= 2000
    assert becomes_true(lambda: _cpus_free() == 2.0), ray.available_resources()
    both = backend.invoke_many([_event(i, n_steps=20_000, run_id="hung-after") for i in range(2)])  # 0.2 s each
    assert all(x.ok for x in both), [x.error for x in both]


def test_64_concurrent_invocations_all_return(backend):
    events = [_event(i, n_steps=1000, round_idx=7, run_id="many") for i in range(64)]  # ~10 ms each
    results: dict[str, object] = {}

    def call(e):
        results[e.invocation_id] = backend.invoke(e)

    threads = [threading.Thread(target=call, args=(e,)) for e in events]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(results) == {e.invocation_id for e in events}
    assert all(s.ok and s.invocation_id == k for k, s in results.items())
    assert backend.stats["peak_in_flight"] <= backend.capacity == 2


def test_a_duplicate_id_is_answered_once(backend):
    e = _event(0, n_steps=10_000, run_id="dup")  # 0.1 s: the second call arrives while it runs
    duplicates = backend.stats["duplicates"]
    out = []
    threads = [threading.Thread(target=lambda: out.append(backend.invoke(e))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    again = backend.invoke(e)
    assert len(out) == 3 and all(s.ok for s in [*out, again])
    assert len({s.batch_key for s in [*out, again]}) == 1  # one process, one invocation: one answer
    assert backend.stats["duplicates"] == duplicates + 3
    many = backend.invoke_many([_event(1, run_id="dup"), _event(1, run_id="dup"), _event(2, run_id="dup")])
    assert [s.invocation_id for s in many] == [invocation_id("dup", 0, 1), invocation_id("dup", 0, 2)]


def test_launched_invocations_are_claimed_by_invoke(backend):
    events = [_event(i, n_steps=5000, run_id="launch") for i in range(4)]
    assert backend.launch(events + events[:1]) == 4
    assert backend.launch(events) == 0  # in flight or answered: not started again
    summaries = [backend.invoke(e) for e in events]
    assert all(s.ok for s in summaries) and [s.invocation_id for s in summaries] == [e.invocation_id for e in events]


def test_close_while_busy_answers_with_a_failed_summary_and_frees_the_cpu(cluster):
    b = RayActorBackend(RayConfig(), timeout_s=60.0, memory_mb=256, actor_fn=HELPER)
    out = []
    t = threading.Thread(target=lambda: out.append(b.invoke(_event(0, seed=3, run_id="busy"))))
    t.start()
    assert becomes_true(lambda: b.stats["peak_in_flight"] == 1 and _cpus_free() < 2.0)
    b.close()
    # the invocation ends when Ray reports the forced cancel, at the latest at its own 60 s wait:
    # a loaded host (the suite side by side) has taken over 30 s to report it
    t.join(90)
    assert not t.is_alive() and not out[0].ok and "closed" in out[0].error
    late = b.invoke(_event(1, run_id="busy"))
    assert not late.ok and "closed" in late.error
    b.close()  # idempotent
    assert ray.is_initialized()  # a Ray the backend joined is left running
    # Ray frees the CPU once the killed worker is reaped, which a loaded host has taken over 30 s to
    # do; a cancel Ray lost ends the task at the worker's own deadline (60 s + WORKER_GRACE_S)
    assert becomes_true(lambda: _cpus_free() == 2.0, timeout_s=120), ray.available_resources()


def _run_in_worker_process(seed: int, deadline_s: float, after_s: float) -> subprocess.CompletedProcess:
    """``run_in_ray_worker`` in a plain process on a scripted event; the process then lives
    ``after_s`` more seconds and prints the summary."""
    spec = json.dumps({"actor_fn": HELPER, "memory_mb": 256, "preload": [], "deadline_s": deadline_s})
    code = textwrap.dedent(f"""
        import sys, time
        from nitro.actors.ray_worker import run_in_ray_worker
        out = run_in_ray_worker({spec!r}.encode(), {_event(0, seed=seed).model_dump_json()!r}.encode())
        time.sleep({after_s!r})
        print(out.decode())
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_task_past_its_deadline_ends_its_worker_process_and_one_that_answers_in_time_does_not():
    """The backstop for a force cancel Ray loses: the hanging task's process exits by itself."""
    from nitro.actors.ray_worker import EXIT_PAST_DEADLINE

    hung = _run_in_worker_process(seed=3, deadline_s=1.0, after_s=0.0)
    assert hung.returncode == EXIT_PAST_DEADLINE, hung.stderr[-2000:]
    assert "still running 1 s after it started" in hung.stderr
    answered = _run_in_worker_process(seed=0, deadline_s=1.0, after_s=2.0)  # lives past the deadline
    assert answered.returncode == 0, answered.stderr[-2000:]
    assert json.loads(answered.stdout)["ok"] is True


def test_failure_reasons_of_ray_errors_are_one_line():
    assert "out of memory" in failure_reason(
        ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")
    )
    assert "cancelled" in failure_reason(ray.exceptions.TaskCancelledError())
    assert "worker process died" in failure_reason(ray.exceptions.WorkerCrashedError())
    raised = failure_reason(ray.exceptions.RayTaskError("f", "Traceback\n  line", ValueError("bad\nvalue")))
    assert raised == "ray task raised ValueError: bad value"
    assert "\n" not in failure_reason(ray.exceptions.GetTimeoutError("slow\nanswer"))


@pytest.mark.timeout(2 * REAL_FUNCTION_DEADLINE_S)
def test_the_real_actor_writes_a_batch_the_learner_accepts_and_nothing_is_unpickled(cluster, redis_url, redis_client,
                                                                                     monkeypatch):
    from nitro.cache import TrajectoryCache, connect_redis
    from nitro.envs import env_spec
    from nitro.models.networks import build_policy
    from nitro.serialization import dumps_tensors
    from nitro.validation import decode_batch

    spec = env_spec("Hopper-v5")
    cache = TrajectoryCache(connect_redis(redis_url), "rayreal", ttl_s=600)
    key = cache.publish_weights(1, dumps_tensors(build_policy(spec, seed=0).state_dict(),
                                                 {"env_id": "Hopper-v5", "version": 1, "format": "nitro.policy/1"}))
    events = [ActorEvent(run_id="rayreal", round=1, invocation_id=invocation_id("rayreal", 1, i), weights_key=key,
                         env_id="Hopper-v5", seed=10 + i, n_steps=200, cache_url=redis_url, batch_ttl_s=600)
              for i in range(2)]
    unpickled: list[bytes] = []

    def recording(loads):
        def trapped(data, *a, **k):
            unpickled.append(bytes(data))
            return loads(data, *a, **k)
        return trapped

    with RayActorBackend(RayConfig(), timeout_s=REAL_FUNCTION_DEADLINE_S, memory_mb=1024) as b:
        # Every pickle loader Ray's deserialiser can reach in this process records what it is given.
        monkeypatch.setattr(pickle, "loads", recording(pickle.loads))
        monkeypatch.setattr(ray.cloudpickle, "loads", recording(ray.cloudpickle.loads))
        summaries = b.invoke_many(events)
        monkeypatch.undo()
    assert all(s.ok for s in summaries), [s.error for s in summaries]
    assert unpickled == []  # the summaries came back as raw bytes
    collected = cache.collect(1, {e.invocation_id for e in events}, deadline_s=5.0)
    assert collected.complete
    for e, s in zip(events, summaries):
        batch = decode_batch(cache.get_batch(1, e.invocation_id), spec, max_steps=200, invocation_id=e.invocation_id)
        assert s.steps == 200 and batch["obs"].shape == (200, 11) and batch["actions"].shape == (200, 3)


def test_a_two_node_cluster_gets_invocations_on_both_nodes(cluster):
    node = cluster.add_node(num_cpus=2, include_dashboard=False)
    try:
        cluster.wait_for_nodes()
        assert becomes_true(lambda: ray.cluster_resources().get("CPU") == 4.0)
        with RayActorBackend(RayConfig(), timeout_s=60.0, memory_mb=256, actor_fn=WHERE) as b:
            assert b.capacity == 4
            summaries = b.invoke_many([_event(i, n_steps=1500, run_id="nodes") for i in range(8)])  # 1.5 s each
        assert all(s.ok for s in summaries), [s.error for s in summaries]
        nodes = {s.batch_key.split(":")[1] for s in summaries}
        assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]} and len(nodes) == 2
    finally:
        cluster.remove_node(node)


OWNED_RAY = textwrap.dedent("""
    import json, signal, psutil
    from nitro.actors.events import ActorEvent
    from nitro.actors.ray_ import RayActorBackend
    from nitro.config.backend import RayConfig

    # The deadline covers the first Ray worker's start, which takes tens of seconds on a loaded 2-core host.
    b = RayActorBackend(
        RayConfig(object_store_mb=80), cpus=1, timeout_s=150, actor_fn="tests.support.actor_helpers:scripted"
    )
    ev = ActorEvent(run_id="own", round=0, invocation_id="own-r00000-0000", weights_key="k", env_id="Hopper-v5",
                    seed=0, n_steps=10, cache_url="redis://127.0.0.1:1/0")
    summary = b.invoke(ev)
    family = [p.pid for p in psutil.Process().children(recursive=True)]
    print(json.dumps({"ok": summary.ok, "error": summary.error, "owned": b.session.owned, "local": b.session.local,
                      "pids": family,
                      "names": [p.name() for p in psutil.Process().children(recursive=True)],
                      "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}), flush=True)
    b.close()
    print("closed", flush=True)
""")


def test_a_ray_the_backend_started_ends_at_close_with_every_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", OWNED_RAY], capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    report = json.loads(lines[0])
    assert lines[1] == "closed"
    assert report["ok"] and report["owned"] and report["local"] and report["sigterm_default"], report
    assert {"raylet", "gcs_server"} <= set(report["names"]), report["names"]
    alive = [p for p in report["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, [psutil.Process(p).cmdline() for p in alive]


def test_a_tiny_probe_runs_its_arms_on_ray(cluster, prefect_api, tmp_path, redis_url):
    """`nitro probe` with `backend.kind=ray`: the trunk and both arms of a branch round run their
    actors on the module's Ray (each run's backend joins the Ray already connected), and the probe
    measures the branch as on the local pool."""
    import asyncio
    import math

    import yaml

    from flows.probe import probe

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = {
        "name": "tiny-ray-probe",
        "base": {"env_id": "Hopper-v5", "steps_per_actor": 64, "backend": {"kind": "ray", "workers": 2},
                 "detector": {"subset_size": 64}, "eval": {"max_steps": 100}, "home": str(tmp_path / "home"),
                 "tracking": {"mlflow_uri": uri}, "redis": {"url": redis_url}},
        "branch_rounds": [2], "horizon": 1, "plain_actors": 2, "boost_actors": 3, "eval_episodes": 2,
    }
    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(spec))
    result = asyncio.run(probe(spec_path=str(tmp_path / "probe.yaml"), report_dir=str(tmp_path / "report")))
    (row,) = result["rows"]
    assert row["round"] == 2 and (row["actors_plain"], row["actors_boost"]) == (2, 3)
    assert math.isfinite(row["gain"]) and math.isfinite(row["hessian_R"])
    assert ray.is_initialized()  # the runs left the module's Ray running


@pytest.mark.timeout(2 * REAL_FUNCTION_DEADLINE_S)
def test_a_learner_function_on_ray_computes_the_in_process_gradient(cluster, redis_url, redis_client):
    """A Stellaris gradient job through the default handler on a Ray worker: the same gradient
    as in process, to 1e-6."""
    from tests.test_stellaris_parts import assert_function_gradient, gradient_job_and_expected

    job, want = gradient_job_and_expected(redis_url, redis_client, "raygrad")
    with RayActorBackend(RayConfig(), timeout_s=REAL_FUNCTION_DEADLINE_S, memory_mb=1024) as b:
        summary = b.invoke(job)
    assert_function_gradient(summary, redis_client, job, want)


@pytest.mark.timeout(2 * REAL_FUNCTION_DEADLINE_S)
def test_a_ray_worker_lost_mid_gradient_writes_nothing_and_the_job_runs_again(cluster, redis_url, redis_client):
    """A learner function's Ray worker SIGKILLed in the middle of its job: the job answers as failed
    (the round loses its slice, tests/test_stellaris_run.py), no gradient is stored under its key,
    and the same job on a fresh worker stores the in-process gradient."""
    from nitro.cache import TrajectoryCache
    from nitro.stellaris.jobs import gradient_key
    from tests.test_stellaris_parts import assert_function_gradient, gradient_job_and_expected

    job, want = gradient_job_and_expected(redis_url, redis_client, "raylost")
    with RayActorBackend(RayConfig(), timeout_s=120.0, memory_mb=1024,
                         actor_fn="tests.support.actor_helpers:gradient_killed_mid_compute") as b:
        lost = b.invoke(job)
    assert not lost.ok and "worker process died" in lost.error, lost.error
    assert redis_client.get(gradient_key(TrajectoryCache(redis_client, job.run_id), 1, job.invocation_id)) is None
    with RayActorBackend(RayConfig(), timeout_s=REAL_FUNCTION_DEADLINE_S, memory_mb=1024) as b:
        summary = b.invoke(job)
    assert_function_gradient(summary, redis_client, job, want)
