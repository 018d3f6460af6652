"""Stellaris end to end: short runs with learner functions on the local pool and through the Lambda
Invoke emulator (the measured schedule), a run that repeats exactly (the seeded schedule), a
killed run that resumes and bills its dead round once, and a failed, a slow and a corrupt
gradient each handled with a one-line reason and nothing else lost."""

from __future__ import annotations

import asyncio

import pytest
from mlflow.tracking import MlflowClient

from nitro.run.rundir import RunDir
from tests.support.lambda_invoke_server import FunctionSpec, InvokeServer
from tests.test_cli_lifecycle import _finish, _kill_mid_round_1, _nitro, _wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SMALL = ["env_id=CartPole-v1", "steps_per_actor=64", "scaler.name=fixed", "scaler.fixed_actors=2",
         "model.hidden=[16,16]", "learner.mode=stellaris", "learner.slice_samples=32", "learner.epochs=2",
         "learner.functions_per_actor=1", "detector.subset_size=32", "eval.every_rounds=0"]


def _train(tmp_path, run_id, redis_url, *extra, backend="local", rounds=3):
    from flows.training import train

    uri = f"sqlite:///{tmp_path}/mlflow-{run_id}.db"
    result = asyncio.run(train(backend=backend, rounds=rounds, overrides=[
        *SMALL, f"home={tmp_path}/home-{run_id}", f"tracking.mlflow_uri={uri}", f"redis.url={redis_url}", *extra],
        run_id=run_id))
    client = MlflowClient(tracking_uri=uri)
    history = {
        name: [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, name), key=lambda m: m.step)]
        for name in (
            "train_return_mean",
            "ppo/stellaris_staleness_mean",
            "ppo/stellaris_gradients",
            "ppo/stellaris_gradients_lost",
            "ppo/stellaris_version",
            "ppo/stellaris_versions",
            "ppo/stellaris_job_compute_s",
            "ppo/sgd_steps",
            "spend_requests_usd",
            "actors_launched",
            "round_lambda_s",
        )
    }
    return result, client.get_run(result.mlflow_run_id), history


def test_a_stellaris_run_repeats_exactly_and_bills_its_functions(prefect_api, redis_url, tmp_path):
    linger = "learner.lane_linger_s=0.5"  # a lane waits for its next job: fewer invocations than jobs
    _, run, first = _train(tmp_path, "stellaris-a", redis_url, linger)
    _, _, second = _train(tmp_path, "stellaris-b", redis_url, linger)
    projected = first.pop("round_lambda_s"), second.pop("round_lambda_s")  # measured durations: they differ
    assert all(s > 0 for s in projected[0] + projected[1])
    profiled = first.pop("ppo/stellaris_job_compute_s"), second.pop("ppo/stellaris_job_compute_s")  # measured too
    assert len(profiled[0]) == 3 and all(s > 0 for s in profiled[0] + profiled[1])
    requests = first.pop("spend_requests_usd"), second.pop("spend_requests_usd")  # invocations: by readiness
    assert first == second  # the seeded schedule: same staleness, same gradients, same returns
    assert all(r > 0 for r in first["train_return_mean"])  # whole CartPole episodes
    jobs = 2 * 2 * 2  # actors x slices (64 / 32) x epochs
    assert first["ppo/stellaris_gradients"] == [jobs] * 3
    assert first["ppo/stellaris_gradients_lost"] == [0.0] * 3
    assert first["ppo/stellaris_version"][-1] >= 3  # versions advance inside every round
    # one Adam step and one published version per group the trigger collected (a fresh gradient
    # is a group of its own), not one step per gradient
    assert first["ppo/sgd_steps"] == first["ppo/stellaris_versions"]
    assert all(1 <= v <= jobs for v in first["ppo/stellaris_versions"])
    assert any(s > 0 for s in first["ppo/stellaris_staleness_mean"])  # two lanes: some gradients are stale
    # every actor is one request, and each lane's invocation one: a lane (2 here) runs its jobs in
    # one invocation while each next one is ready within the linger, in at most one per job
    invocations = [round(usd / 0.2e-6) - 2 for usd in requests[0] + requests[1]]
    assert all(2 <= n <= jobs for n in invocations), invocations
    assert min(invocations) < jobs, invocations
    assert run.data.params["learner.mode"] == "stellaris"
    assert float(run.data.tags["cost.learner_per_hour"]) == 0.085  # the parameter server's instance


@pytest.mark.parametrize("schedule", ["measured", "seeded"])
def test_a_stellaris_run_through_the_lambda_invoke_api(prefect_api, redis_url, tmp_path, monkeypatch, schedule):
    """On Lambda the schedule is measured by default: the jobs take the versions they find and the
    parameter server applies the gradients as they land, one step and one version per group.
    Either way a lane's invocation (``GradientLane``) runs each next job that is ready within the
    linger (measured: the next in line, taken from the round's gate) through the same Invoke API."""
    aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for var, value in aws.items():
        monkeypatch.setenv(var, value)
    with InvokeServer([FunctionSpec("nitro-actor", concurrency=4, timeout_s=60)]) as server:
        result, _, history = _train(
            tmp_path,
            f"stellaris-lambda-{schedule}",
            redis_url,
            *(("learner.schedule=seeded",) if schedule == "seeded" else ()),
            f"backend.lambda.endpoint_url={server.url}",
            "backend.lambda.concurrency=4",
            "backend.lambda.function_timeout_s=60",
            "learner.lane_linger_s=0.5",
            backend="lambda",
            rounds=2,
        )
    assert result.rounds_done == 2
    assert history["ppo/stellaris_gradients"] == [8.0, 8.0] and history["ppo/stellaris_gradients_lost"] == [0.0, 0.0]
    invocations = [round(usd / 0.2e-6) - 2 for usd in history["spend_requests_usd"]]  # less the 2 actors
    assert all(1 <= n <= 8 for n in invocations) and min(invocations) < 8, invocations
    assert history["ppo/sgd_steps"] == history["ppo/stellaris_versions"]
    assert all(1 <= v <= 8 for v in history["ppo/stellaris_versions"])
    assert history["ppo/stellaris_version"][-1] == sum(history["ppo/stellaris_versions"])  # one version a group


def test_a_killed_stellaris_run_resumes_and_bills_the_dead_round_once(tmp_path, prefect_api):
    """Killed once round 1's gradient jobs are recorded in flight (as the first may start): the
    resumed run bills round 1's actors and only the jobs that ran, and plans its own attempt at
    round 1, whose jobs and snapshots are keyed apart from the dead attempt's."""
    home, run_id = tmp_path / "home", "stellaris-killed"
    args = [*SMALL, "rounds=3", "backend.workers=2", "round_deadline_s=180", f"home={home}"]

    def jobs_in_flight() -> int:
        record = RunDir(home, run_id).inflight()
        return int(record["round"]) if record is not None and record.get("if_started") else -1

    proc = _nitro(tmp_path, "train", "--run-id", run_id, *args, api=prefect_api)
    _wait_for(lambda: jobs_in_flight() == 1, proc, "round 1's gradient jobs")
    _kill_mid_round_1(proc, home, run_id, grace_s=10)
    dead = RunDir(home, run_id).inflight()
    assert dead is not None and len(dead["if_started"]) == 8
    assert all(f"-{dead['attempt']}-l" in inv for inv in dead["if_started"])  # lanes' invocations, one per job at most
    assert not (RunDir(home, run_id).checkpoints / "round-00001").exists()
    code, _out, err = _finish(_nitro(tmp_path, "resume", run_id, "--home", str(home), api=prefect_api))
    assert code == 0, err[-3000:]
    _, state = RunDir(home, run_id).load()
    assert state["next_round"] == 3 and state["stellaris"]["rounds_trained"] == 3
    interrupted = [r for r in state["ledger"]["rounds"] if r["interrupted"]]
    assert [r["round_idx"] for r in interrupted] == [1] and interrupted[0]["attempt"] == dead["attempt"]
    # its 2 actors and, of its lanes' invocations (at most 8), only those that ran: a kill this early
    # leaves most unstarted (billing every job at its timeout gave 10 requests, 8 at the worst case)
    assert 2 <= interrupted[0]["n_requests"] < 2 + 8


def test_a_seeded_lane_loses_only_the_job_its_invocation_failed_on(prefect_api, redis_url, tmp_path, monkeypatch):
    """Seeded lanes: the invocation that starts at job 1 crashes, the one that starts at job 3 runs
    nothing, and the one that starts at job 4 raises in the backend: each loses that job alone, with
    its reason, and the lane's next invocation takes the jobs after it. (Each invocation here stops
    before the next faulty job, so that each fault meets its job first.)"""
    from nitro.actors.events import ActorSummary
    from nitro.run.updates import StellarisUpdate

    faulty = (1, 3, 4)

    class Faulty:
        def __init__(self, backend):
            self.backend = backend

        def invoke(self, event):
            first = event.jobs[0].job
            if first == 1:
                return ActorSummary.failed(event.invocation_id, "RuntimeError: injected crash")
            if first == 3:
                return ActorSummary(invocation_id=event.invocation_id, ok=True, profile={"jobs": 0.0})
            if first == 4:
                raise ConnectionError("injected: the backend is gone")
            cut = next((i for i, job in enumerate(event.jobs) if i and job.job in faulty), len(event.jobs))
            return self.backend.invoke(event.model_copy(update={"jobs": event.jobs[:cut]}))

    original = StellarisUpdate.run_seeded_lane
    monkeypatch.setattr(StellarisUpdate, "run_seeded_lane",
                        lambda self, plan, lane, backend: original(self, plan, lane, Faulty(backend)))
    result, run, history = _train(tmp_path, "stellaris-lane-faults", redis_url, rounds=2)
    assert result.rounds_done == 2
    assert history["ppo/stellaris_gradients_lost"] == [3.0, 3.0] and history["ppo/stellaris_gradients"] == [5.0, 5.0]
    reasons = {k: v for k, v in run.data.tags.items() if k.startswith("nitro.corrupt.")}
    for said in ("gradient job failed: RuntimeError: injected crash", "its lane's invocation ran none of its jobs",
                 "gradient job failed: ConnectionError: injected: the backend is gone"):
        assert sum(said in v for v in reasons.values()) == 2, (said, reasons)  # once a round


def test_failed_slow_and_corrupt_gradients_each_lose_only_their_slice(prefect_api, redis_url, tmp_path, monkeypatch):
    """Measured lanes: the invocation started for job 1 crashes, the one for job 2 answers a NaN
    gradient, the one for job 3 hangs (as a function past its deadline) until the parameter server
    stops waiting for it at ``gradient_timeout_s``, and the one for job 4 raises in the backend.
    Each loses its job alone, with its reason; every other gradient is applied, in every round.
    (The healthy invocations run one job each here, so that each fault meets its own job.) Round 0
    has no fault: a fresh function's first job (its first snapshot decoded, the networks built,
    PyTorch's first backward) once took past the 8 s under the suite's load, losing healthy jobs
    behind it. The pool preloads the learner function's modules now (``warm_modules``), 0.5 s of
    that first job; the rest is a first job's own and not this test's subject."""
    import time

    import torch

    from nitro.actors.events import ActorSummary
    from nitro.run.updates import StellarisUpdate
    from nitro.stellaris.jobs import gradient_key
    from nitro.stellaris.wire import gradient_payload

    class Faulty:
        def __init__(self, update, backend):
            self.learning, self.backend = update.learning, backend

        def invoke(self, event):
            job = event.jobs[0]  # taken for this invocation, bound to the version it found
            if job.round == 0:
                return self.backend.invoke(event.model_copy(update={"pulls": False}))
            if job.job == 1:
                return ActorSummary.failed(event.invocation_id, "RuntimeError: injected crash")
            if job.job == 2:  # answers on time, with NaNs of the right shapes
                nan = {n: torch.full(s, float("nan")) for n, s in self.learning.server.expected_shapes.items()}
                key = gradient_key(self.learning.cache, job.round, job.invocation_id)
                self.learning.cache.client.set(key, gradient_payload(
                    nan, invocation_id=job.invocation_id, snapshot_version=job.snapshot_version, metrics={}))
                self.learning.answered(job, ActorSummary(invocation_id=job.invocation_id, ok=True, steps=32,
                                                         batch_key=key))
                return ActorSummary(invocation_id=event.invocation_id, ok=True, steps=32)
            if job.job == 3:
                deadline = time.monotonic() + 60
                while not self.learning._flight.closed and time.monotonic() < deadline:
                    time.sleep(0.05)
                return ActorSummary.failed(event.invocation_id, "TimeoutError: past the function's deadline")
            if job.job == 4:
                raise ConnectionError("injected: the backend is gone")
            return self.backend.invoke(event.model_copy(update={"pulls": False}))

    original = StellarisUpdate.run_lane
    monkeypatch.setattr(StellarisUpdate, "run_lane",
                        lambda self, plan, lane, backend: original(self, plan, lane, Faulty(self, backend)))
    # 8 s: the hung job costs each round the whole timeout, and a healthy gradient missed 3 s once
    # under the suite's load on a 2-core host
    result, run, history = _train(tmp_path, "stellaris-faults", redis_url, "learner.gradient_timeout_s=8",
                                  "learner.schedule=measured", rounds=3)
    assert result.rounds_done == 3
    assert history["ppo/stellaris_gradients_lost"][1:] == [4.0, 4.0]
    assert history["ppo/stellaris_gradients"][1:] == [4.0, 4.0]
    reasons = {k: v for k, v in run.data.tags.items() if k.startswith("nitro.corrupt.")}
    crash = "the function failed: gradient job failed: RuntimeError: injected crash"
    assert any(crash in v for v in reasons.values()), reasons
    assert any("dropped at the door" in v and "non-finite" in v for v in reasons.values()), reasons
    assert any("none landed within 8 s" in v for v in reasons.values()), reasons
    gone = "gradient job failed: ConnectionError: injected: the backend is gone"
    assert any(gone in v for v in reasons.values()), reasons
    assert all("\n" not in v for v in reasons.values())


def test_goodput_reads_the_noise_stellaris_functions_measure(prefect_api, redis_url, tmp_path):
    """`scaler.name=goodput` under Stellaris: each round's first-pass gradients measure the noise
    (``ppo/noise_*``), and the next round's decision reads it (round 0's decision has none)."""
    run_id = "stellaris-goodput"
    result, _, history = _train(tmp_path, run_id, redis_url, "scaler.name=goodput", "scaler.i_min=4",
                                "scaler.i_max=6", "learner.slice_samples=64", rounds=3)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow-{run_id}.db")

    def metric(name: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, name)}

    fragments, measured = metric("ppo/noise_fragments"), metric("goodput/measured")
    assert fragments and all(2 <= n <= 6 for n in fragments.values())  # one per batch, at most the actors
    assert all(metric("ppo/noise_policy_frag_sqnorm")[k] > 0 for k in fragments)
    assert measured[0] == 0.0  # nothing measured before the first round's update
    assert [measured[k + 1] for k in sorted(fragments) if k + 1 in measured] == [1.0] * len(
        [k for k in fragments if k + 1 in measured])  # a round's measurement reaches the next decision
    assert all(4 <= n <= 6 for n in history["actors_launched"])


def test_a_budgeted_run_holds_its_learner_functions_to_the_allowance_it_reserved(prefect_api, redis_url, tmp_path,
                                                                                  monkeypatch):
    """With a budget, round 0 reserves every gradient job at its timeout; once a round has been
    billed, each reserves the lanes' timeouts plus twice the billing per job, and no job is lost.
    In round 2 each invocation runs one job and is billed its whole timeout (as a function stuck
    past it would be): with two lanes' timeouts plus less than one timeout of margin, a third
    invocation never fits, so the lanes stop starting them, those jobs are lost with the reason,
    the round and the run go on, and the next round's allowance reads the bills."""
    from nitro.run.updates import StellarisUpdate

    class SlowRound2:
        def __init__(self, backend):
            self.backend = backend

        def invoke(self, event):
            if event.round != 2:
                return self.backend.invoke(event)
            summary = self.backend.invoke(event.model_copy(update={"jobs": event.jobs[:1]}))
            return summary.model_copy(update={"billed_ms": 120_000})

    original = StellarisUpdate.run_seeded_lane
    monkeypatch.setattr(StellarisUpdate, "run_seeded_lane",
                        lambda self, plan, lane, backend: original(self, plan, lane, SlowRound2(backend)))
    run_id = "stellaris-allowance"
    result, run, history = _train(tmp_path, run_id, redis_url, "budget_usd=0.1", "backend.timeout_s=120", rounds=4)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow-{run_id}.db")

    def metric(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, name), key=lambda m: m.step)]

    allowance, refused = metric("ppo/stellaris_functions_allowance_ms"), metric("ppo/stellaris_functions_refused")
    jobs, lanes, timeout_ms = 2 * 2 * 2, 2, 120_000
    assert result.rounds_done == 4 and history["actors_launched"] == [2.0] * 4
    assert allowance[0] == jobs * timeout_ms  # nothing billed yet: every job at its timeout
    assert all(lanes * timeout_ms < a < jobs * timeout_ms for a in allowance[1:3])
    assert refused[:2] == [0.0, 0.0] and history["ppo/stellaris_gradients_lost"][:2] == [0.0, 0.0]
    assert refused[2] > 0 and history["ppo/stellaris_gradients_lost"][2] >= refused[2]
    assert allowance[3] > allowance[2]  # round 2's 5 s bills raise the billing per job
    reasons = [v for k, v in run.data.tags.items() if k.startswith("nitro.corrupt.")]
    assert any("would pass their budgeted allowance" in v for v in reasons), reasons
    assert max(metric("spend_total_usd")) <= 0.1
