"""One Stellaris round on the learner's side: plan the gradient jobs, then serve them.

``plan``: the round's batches are cut into slices, ``epochs`` passes of jobs in FIFO order (pass,
actor, slice). Which snapshot version each job computes against, and which gradients the
parameter server applies together, come from one of two schedules (``learner.schedule``):

* seeded: a discrete-event schedule drawn from the run's seed (``nitro.stellaris.schedule``) names
  each job's lane, version and the versions live beside it; each lane's jobs run in as few
  invocations as their readiness allows (``nitro.stellaris.lanes``), and ``serve`` takes each
  gradient in the schedule's order (never past ``gradient_timeout_s``), checks it at the door,
  applies the schedule's groups and publishes each new version. A run repeats exactly.
* measured: the jobs start in FIFO order on ``lanes`` at once, each against the version published
  when it starts (the versions other running jobs hold are its live ones), taken from the round's
  gate in Redis (``nitro.stellaris.arrivals.Gate``) by a lane's task, which starts an invocation for
  it, and by that invocation, which goes on to the next job in line; ``serve`` takes the gradients
  as they land, reads each one's staleness at its landing and applies the pending ones whenever
  the trigger (``nitro.stellaris.aggregation.should_apply``) says so. The staleness is what the
  functions' real timing made it; a run does not repeat.

Either way the schedule replayed with the measured durations is the round's projected learner time
(``nitro.run.updates.StellarisUpdate.serve``).

Stated rules: a job whose batch never lands, whose function fails, or whose gradient is late or
fails the door is lost: its slice is not trained on in this round, the schedule's version still
advances (so no job waits for a gradient that will not come), and the loss is counted with its
one-line reason.
Each application is one group (what the trigger collected): the learner's ``apply_gradients``
takes one step on its gradients' mean, weighted by samples and staleness, and one version is
published. At the end of the round the learner's ``close_update`` adapts the KL coefficient and
merges the round's observation and reward statistics (the functions computed against frozen
statistics), as a sync update does. A round's snapshots and gradient jobs are keyed by the attempt
at the round, so a resumed attempt never reads what a dead one wrote.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.cache import TrajectoryCache
from nitro.config import NitroConfig
from nitro.learners import Progress
from nitro.learners.behaviour import BehaviourPolicies
from nitro.learners.ppo import PPOLearner
from nitro.stellaris.aggregation import BoundState, should_apply
from nitro.stellaris.arrivals import Gate, InFlight
from nitro.stellaris.jobs import POLL_S, GradientJob, gradient_job_id, gradient_key, snapshot_key, wait_for_batch
from nitro.stellaris.lanes import LaneInvocations
from nitro.stellaris.noise import NoiseGroups
from nitro.stellaris.schedule import GradientSchedule, LatencyModel, simulate
from nitro.stellaris.server import Landed, ParameterServer, Served
from nitro.stellaris.wire import Gradient, GradientError, check_gradient
from nitro.validation import BatchError, Bounds, batch_version, decode_batch_meta

log = logging.getLogger("nitro")


@dataclass(frozen=True)
class GradientPlan:
    """A round's gradient jobs and the schedule they run to (empty when the round trains no actor)."""

    jobs: list[GradientJob] = field(default_factory=list)
    schedule: dict | None = None  # seeded: GradientSchedule.to_dict(), plain data as Prefect passes it
    lanes: int = 0
    bound: int | None = None  # the staleness bound of the round's trigger
    attempt: str = ""  # this attempt at the round: its snapshots and gradients are its own
    measured: bool = False  # the jobs take the version they find and land as they land (no schedule)


class StellarisLearning:
    """The learner side of Stellaris across rounds: the parameter server, the staleness bound, and
    the signals between the jobs' tasks and the parameter server within a round."""

    def __init__(self, config: NitroConfig, learner: PPOLearner, cache: TrajectoryCache, run_id: str,
                 behaviour: BehaviourPolicies, bounds: Bounds):
        self.config, self.learner, self.cache, self.run_id = config, learner, cache, run_id
        self.behaviour, self.bounds = behaviour, bounds
        self.server = ParameterServer(learner, config.learner, cache)
        self.bound = BoundState()
        self.rounds_trained = 0
        self.warm_lanes = 0
        # The jobs' tasks run in this process beside the parameter server: a published version and
        # a job's answer are signalled here, not polled for in Redis.
        self._signal = threading.Condition()
        self._relaying = threading.Lock()
        self._published = -1
        self._answers: dict[str, ActorSummary] = {}
        self.lanes = LaneInvocations(cache, run_id, config.learner, config.backend.timeout_s)
        self._flight = InFlight()

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def epochs(self) -> int:
        return self.config.learner.epochs or self.config.ppo.epochs

    @property
    def slices(self) -> int:
        """Slices of one actor's batch."""
        return math.ceil(self.config.steps_per_actor / self.config.learner.slice_samples)

    def jobs_per_actor(self) -> int:
        return self.epochs * self.slices

    # -- planning ---------------------------------------------------------------------------------

    def plan(self, k: int, events: list[ActorEvent], weights_key: str, actor_cache_url: str,
             actor_credentials: dict[str, str], attempt: str) -> GradientPlan:
        """The round's jobs and their schedule, for ``attempt`` at the round (its job ids and
        snapshot keys name it)."""
        train = [e for e in events if e.mode == "train"]
        if not train:
            return GradientPlan()
        cfg = self.config.learner
        order = [(epoch, a, s) for epoch in range(self.epochs) for a in range(len(train)) for s in range(self.slices)]
        lanes = cfg.functions_for(len(train))
        measured = cfg.schedule_on(self.config.backend.kind) == "measured"
        with self._signal:
            self._answers.clear()
            self._flight = InFlight(gate=Gate(self.cache, k, attempt, lanes) if measured else None)
        self._publish(k, attempt)  # the round's first version, under the round's own prefix
        bound = self.bound_now()

        def job(index: int, version: int, live: list[int]) -> GradientJob:
            epoch, a, s = order[index]
            actor = train[a]
            return GradientJob(
                run_id=self.run_id, round=k, invocation_id=gradient_job_id(self.run_id, k, attempt, index), job=index,
                env_id=self.config.env_id, snapshot_key=snapshot_key(self.cache, k, attempt, version),
                snapshot_version=version, behaviour_key=weights_key,
                live_keys=[snapshot_key(self.cache, k, attempt, v) for v in live],
                actor_id=actor.invocation_id, batch_key=self.cache.batch_key(k, actor.invocation_id),
                seed=actor.seed, epoch=epoch, slice=s, slice_samples=cfg.slice_samples,
                cache_url=actor_cache_url, cache_credentials=actor_credentials, ttl_s=self.cache.ttl_s)

        if self._flight.gate is not None:
            # the version each job names is the round's first: the one it takes is bound as it starts
            jobs = [job(j, self.server.version, []) for j in range(len(order))]
            self._flight.gate.open(jobs, self.server.version)
            with self._signal:
                self.lanes.begin(k, attempt, jobs, lanes)
            return GradientPlan(jobs, None, lanes, bound, attempt, measured=True)
        rng = np.random.default_rng([self.config.seed, k, 0x57E11A])
        model = LatencyModel(cold_s=cfg.latency.cold_s, warm_s=cfg.latency.warm_s,
                             per_sample_s=cfg.latency.per_sample_s, jitter=cfg.latency.jitter)
        landing = LatencyModel(cold_s=cfg.latency.actor_s, warm_s=cfg.latency.actor_s, per_sample_s=0.0,
                               jitter=cfg.latency.jitter).draw([0] * len(train), rng, [True] * len(train))
        cold = [j < lanes and j >= self.warm_lanes for j in range(len(order))]
        latency = model.draw([min(cfg.slice_samples, self.config.steps_per_actor)] * len(order), rng, cold)
        schedule = simulate([landing[a] for _, a, _ in order], latency, lanes=lanes,
                            start_version=self.server.version, bound=bound,
                            trigger_k=cfg.trigger_k or lanes, apply_s=cfg.latency.apply_s)
        self.warm_lanes = max(self.warm_lanes, lanes)
        jobs = [job(sj.job, sj.snapshot_version,
                    sorted({o.snapshot_version for o in schedule.jobs
                            if o.start_s <= sj.start_s < o.end_s and o.snapshot_version != sj.snapshot_version}))
                for sj in schedule.jobs]
        with self._signal:
            self.lanes.begin(k, attempt, jobs, lanes)
        return GradientPlan(jobs, schedule.to_dict(), lanes, bound, attempt)

    def _publish(self, k: int, attempt: str) -> None:
        self.server.publish(k, attempt)
        if self._flight.gate is not None:
            self._flight.gate.publish(self.server.version)
        with self._signal:
            self._published = self.server.version
            self._signal.notify_all()

    def bound_now(self) -> int | None:
        return self.bound.bound(self.rounds_trained + 1, self.config.learner.decay)

    # -- a lane's jobs and a job's start ----------------------------------------------------------

    def invocation_ids(self, plan: GradientPlan) -> list[str]:
        """The ids of the round's learner-function invocations, each of which starts only once its
        inputs are ready (``LaneInvocations.invocation_ids``)."""
        if plan.measured:
            return self.lanes.invocation_ids(None)
        assert plan.schedule is not None  # a seeded plan with jobs carries its schedule
        return self.lanes.invocation_ids([sj["lane"] for sj in plan.schedule["jobs"]])

    def relay(self, block_s: float = 0.0) -> None:
        """Hand the answers the lanes' invocations pushed so far to the parameter server (waiting up
        to ``block_s`` for the first): when it returns, every answer pushed before has been handed."""
        with self._relaying:  # one reader at a time: an answer is never popped and not yet handed
            for job, summary in self.lanes.pop(block_s):
                self.answered(job, summary)

    def has_answer(self, job: GradientJob) -> bool:
        with self._signal:
            return job.invocation_id in self._answers

    def lane_jobs(self, plan: GradientPlan, lane: int) -> list[GradientJob]:
        """The jobs the seeded schedule put on learner function ``lane``, in order."""
        assert plan.schedule is not None  # a seeded plan with jobs carries its schedule
        return [job for job, sj in zip(plan.jobs, plan.schedule["jobs"]) if sj["lane"] == lane]

    def start(self, job: GradientJob) -> GradientJob | str:
        """Block until the seeded job may start (its batch is in the cache and its snapshot is
        published: a snapshot always comes, the parameter server waits for no gradient past its own
        deadline) and return it, or say in one line why it never will: its actor failed, or the
        round's deadline for its actors passed."""
        wait_s = self.config.round_deadline_s
        deadline = time.perf_counter() + wait_s
        if (reason := wait_for_batch(self.cache, job, deadline, wait_s)) is not None:
            return reason
        with self._signal:
            if self._signal.wait_for(lambda: self._published >= job.snapshot_version,
                                     timeout=max(0.0, deadline - time.perf_counter())):
                return job
        return f"gradient job not started: its snapshot was not published within {wait_s:g} s"

    def take_next(self, plan: GradientPlan) -> GradientJob | None:
        """The measured round's next job in line, taken for an invocation once it may start and
        bound (``Gate.take_next``); None once none is left. A job that gives up is answered failed."""
        assert self._flight.gate is not None, "take_next belongs to a measured round"

        def nap() -> None:
            with self._signal:  # an answer or a give-up in this process wakes it; a function's, the poll
                self._signal.wait(POLL_S)

        return self._flight.gate.take_next(plan.jobs, self.config.round_deadline_s, nap, lambda job, reason: (
            self.answered(job, ActorSummary.failed(job.invocation_id, reason))))

    def answer_lost(self, plan: GradientPlan, invocation: ActorSummary) -> None:
        """Answer as failed each job a measured invocation took and did not answer (it failed, or
        returned with a job it had not finished): the parameter server does not wait for them."""
        assert self._flight.gate is not None, "answer_lost belongs to a measured round"
        self.relay()  # what it pushed reaches the server first
        reason = invocation.error if not invocation.ok else "its invocation ended without answering it"
        for job in (plan.jobs[index] for index in self._flight.gate.took(invocation.invocation_id)):
            if not self.has_answer(job):
                self.answered(job, ActorSummary.failed(job.invocation_id, f"gradient job failed: {reason}"))

    def answered(self, job: GradientJob, summary: ActorSummary) -> None:
        """A job's answer, for the parameter server; a failed one is also left in the cache, where a
        resumed run bills it (the function leaves its own when it can). Frees its learner function."""
        gate = self._flight.gate
        version = gate.answered(job.job) if gate is not None else None  # None: it never held a function
        with self._signal:
            if job.invocation_id in self._answers:  # the first answer counts (a lane's, or the task's)
                return
            if not summary.ok:  # before the round can see it answered, so a resume finds it
                self.cache.put_summary(job.round, job.invocation_id, summary.model_dump_json())
            self._answers[job.invocation_id] = summary
            if gate is not None and version is not None:  # as it was bound: its staleness is read from this
                self._flight.started[job.invocation_id] = job.model_copy(update={
                    "snapshot_version": version, "snapshot_key": gate.snapshot_key(version)})
            self._flight.answers.append(job.invocation_id)
            self._signal.notify_all()

    # -- serving ----------------------------------------------------------------------------------

    def serve(self, k: int, plan: GradientPlan) -> Served:
        """Apply the round's gradients one group in one step and one published version at a time,
        in the schedule's order or as they land (see the module docstring), then close the
        learner's update: the KL coefficient adapts and the statistics merge."""
        served = Served(batches={}, missing=[], corrupt={}, lost={}, staleness=[], adam_steps=0, metrics={})
        if not plan.jobs:
            return served
        behaviour_policy = copy.deepcopy(self.learner.policy)  # what the actors act with this round
        progress = Progress(k + 1, self.config.rounds)  # round k's batches: what sync's round k+1 trains on
        sums: dict[str, float] = {}
        noise = NoiseGroups() if self.config.scaler.measures_noise else None

        def land(job: GradientJob, staleness: int) -> Landed | None:
            gradient = self._receive(job, served)
            if gradient is None:
                return None
            started = time.perf_counter()
            served.staleness.append(staleness)
            if noise is not None:
                noise.add(job, gradient)
            for name, value in gradient.metrics.items():
                sums[name] = sums.get(name, 0.0) + value
            served.count("landing", started)
            return Landed(gradient, staleness)

        def step(group: list[Landed]) -> None:
            started = time.perf_counter()
            served.adam_steps += self.server.apply(group, progress)
            served.count("stepping", started)
            started = time.perf_counter()
            self._publish(k, plan.attempt)
            served.versions += 1
            served.count("publishing", started)

        if plan.measured:
            self._serve_arrivals(plan, served, land, step)
        else:
            assert plan.schedule is not None  # a seeded plan with jobs carries its schedule
            for application in GradientSchedule.from_dict(plan.schedule).applications:
                step([x for x in (land(plan.jobs[j], s) for j, s in zip(application.jobs, application.staleness))
                      if x is not None])
        started = time.perf_counter()
        closed = self.learner.close_update(list(served.batches.values()), behaviour_policy) if served.batches else {}
        served.count("closing", started)
        mean_staleness = float(np.mean(served.staleness)) if served.staleness else 0.0
        self.bound.observe_round(mean_staleness)
        self.rounds_trained += 1
        applied = len(served.staleness)
        served.metrics = {f"stellaris_{name}": value / max(applied, 1) for name, value in sums.items()} | {
            "stellaris_gradients": float(applied), "stellaris_gradients_lost": float(len(served.lost)),
            "stellaris_staleness_mean": mean_staleness,
            "stellaris_staleness_max": float(max(served.staleness, default=0)),
            "stellaris_bound": float(self.bound_now() or -1), "stellaris_versions": float(served.versions),
            "stellaris_lanes": float(plan.lanes), "stellaris_version": float(self.server.version),
            "sgd_steps": float(served.adam_steps), "kl_coef": self.learner.kl_coef,
        } | {f"stellaris_server_{part}_s": seconds for part, seconds in served.busy_parts.items()} | closed | (
            noise.diagnostics() if noise is not None else {})
        return served

    def _serve_arrivals(self, plan: GradientPlan, served: Served, land: Callable[[GradientJob, int], Landed | None],
                        step: Callable[[list[Landed]], None]) -> None:
        """The measured round: the answers as they come, each one's staleness read when the server
        takes it, and the pending gradients applied whenever the trigger fires. The server takes
        every answer that came while it was busy at once and checks the trigger once for them
        (``nitro.stellaris.schedule``'s rule), so it never falls behind the landings. When no
        answer comes within ``gradient_timeout_s`` the jobs still out are lost and no job starts
        any more; the gradients still pending at the end are applied together (nothing computed
        is dropped)."""
        waiting = {job.invocation_id: job for job in plan.jobs}
        trigger_k = self.config.learner.trigger_k or plan.lanes
        timeout_s = self.config.learner.gradient_timeout_s
        flight, read, pending = self._flight, 0, []
        while waiting:
            deadline = time.perf_counter() + timeout_s
            while len(flight.answers) == read and (left := deadline - time.perf_counter()) > 0:
                self.relay(block_s=min(left, 0.2))  # the functions' answers; a lane task's wake it within 0.2 s
            with self._signal:
                if len(flight.answers) == read:  # none within the timeout: the jobs still out are lost
                    flight.closed = True
                    if flight.gate is not None:
                        flight.gate.close()
                    self._signal.notify_all()
                arrived = [flight.started.get(inv, waiting[inv]) for inv in flight.answers[read:] if inv in waiting]
                read = len(flight.answers)
            if flight.closed:
                for job in waiting.values():
                    self._lose(job, f"gradient lost: none landed within {timeout_s:g} s", served)
                break
            for job in arrived:  # all that landed while the server was busy, read at the same version
                del waiting[job.invocation_id]
                landed = land(job, self.server.version - job.snapshot_version)
                if landed is not None:
                    pending.append(landed)
            if should_apply([x.staleness for x in pending], plan.bound, trigger_k):
                step(pending)
                pending = []
        if pending:
            step(pending)

    def _lose(self, job: GradientJob, reason: str, served: Served) -> None:
        log.warning("round %d: %s: %s", job.round, job.invocation_id, reason)
        served.lost[job.invocation_id] = reason

    def _receive(self, job: GradientJob, served: Served) -> Gradient | None:
        """The job's gradient once it is in the cache and passes the door (its batch too); None, with
        the reason recorded, when it is lost. Waiting for the answer is not the server's work; reading
        and checking the gradient is (its busy time, part ``receiving``)."""
        answer = self._wait_answer(job)
        started = time.perf_counter()
        try:
            payload = self._read_gradient(job, answer)
            if isinstance(payload, str):
                reason = payload
            elif not self._admit_batch(job, served):
                reason = f"gradient dropped: the batch of {job.actor_id} did not pass the door"
            else:
                try:
                    return check_gradient(payload, expected=self.server.expected_shapes,
                                          invocation_id=job.invocation_id, snapshot_version=job.snapshot_version)
                except GradientError as exc:
                    reason = f"gradient dropped at the door: {exc}"
            self._lose(job, reason, served)
            return None
        finally:
            served.count("receiving", started)

    def _wait_answer(self, job: GradientJob) -> ActorSummary | None:
        """The job's answer, or None when none came within ``gradient_timeout_s``: as the lanes'
        invocations push it to the cache (or their tasks hand it over, for a job lost before or
        around its invocation)."""
        deadline = time.perf_counter() + self.config.learner.gradient_timeout_s
        while True:
            with self._signal:
                if job.invocation_id in self._answers:
                    return self._answers[job.invocation_id]
            if (left := deadline - time.perf_counter()) <= 0:
                return None
            self.relay(block_s=min(left, 0.2))

    def _read_gradient(self, job: GradientJob, answer: ActorSummary | None) -> bytes | str:
        """The gradient's bytes, or one line on why none will come (the job failed or is late)."""
        if answer is not None and not answer.ok:
            return f"gradient lost: the function failed: {answer.error}"
        payload = self.cache.fetch(gradient_key(self.cache, job.round, job.invocation_id))
        if payload is None:
            timeout_s = self.config.learner.gradient_timeout_s
            return (f"gradient lost: not in the cache within {timeout_s:g} s" if answer is None else
                    "gradient lost: the function answered but its gradient is not in the cache (expired?)")
        return payload

    def _admit_batch(self, job: GradientJob, served: Served) -> bool:
        """Check the job's batch at the learner's door once (``nitro.validation``, ``nitro.learners.behaviour``)."""
        if job.actor_id in served.batches:
            return True
        if job.actor_id in served.corrupt or job.actor_id in served.missing:
            return False
        payload = self.cache.fetch(job.batch_key)
        if payload is None:
            served.missing.append(job.actor_id)
            return False
        try:
            arrays, meta = decode_batch_meta(payload, self.learner.spec, self.config.steps_per_actor, job.actor_id,
                                             self.bounds)
            self.behaviour.check(arrays, batch_version(meta))
        except BatchError as exc:
            log.warning("round %d: dropped corrupt batch %s: %s", job.round, job.actor_id, exc)
            served.corrupt[job.actor_id] = str(exc)
            return False
        served.batches[job.actor_id] = arrays
        return True

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": self.server.version, "bound": self.bound.to_dict(), "rounds_trained": self.rounds_trained,
                "warm_lanes": self.warm_lanes}

    def load_state_dict(self, state: dict) -> None:
        self.server.version = int(state["version"])
        self.bound = BoundState.from_dict(state["bound"])
        self.rounds_trained = int(state["rounds_trained"])
        self.warm_lanes = int(state["warm_lanes"])
