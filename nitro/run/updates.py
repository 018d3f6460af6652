"""How a round's policy update meets its actors: one interface, three implementations.

* ``SyncUpdate`` (PPO; IMPACT with ``impact.asynchronous: false``): round k's update trains on
  round k-1's batches before the round decides and acts.
* ``LearnWhileActing`` (IMPACT): the update runs beside round k's actors, on each batch as it
  lands, replaying from the buffer while none has.
* ``StellarisUpdate`` (``learner.mode: stellaris``): learner functions compute gradients on slices
  of round k's batches beside its actors, and the parameter server applies them as they land.

Each round flow (``flows/round.py``) drives one of them; the engine (``nitro.run.engine``) reads
only what every mode has (``UpdateMode``). A mode owns what lives across rounds for it: the batches
the next sync update consumes, Stellaris's parameter server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.cache import TrajectoryCache
from nitro.config import NitroConfig
from nitro.learners import Learner, OffPolicyLearner, PPOLearner, Progress, UpdateResult
from nitro.learners.behaviour import BehaviourPolicies
from nitro.run.crashes import crash_point
from nitro.run.rundir import RunDir
from nitro.stellaris.allowance import FunctionAllowance
from nitro.stellaris.jobs import GradientLane
from nitro.stellaris.round import GradientPlan, StellarisLearning
from nitro.stellaris.schedule import replay
from nitro.validation import BatchError, Bounds, batch_version, decode_batch_meta

log = logging.getLogger("nitro")

MAX_FAILED_UPDATES = 3  # updates in a row that took no step (non-finite losses): the run stops


class TrainingError(RuntimeError):
    """The run cannot go on training (its updates keep failing); the message is one line."""


class Backend(Protocol):
    def invoke(self, event: Any) -> ActorSummary: ...


@dataclass
class UpdateReport:
    """What a round's policy update trained on and what it measured."""

    samples: int = 0  # new samples trained on (a replayed one is not new)
    batches: int = 0
    missing: list[str] = field(default_factory=list)  # invocation ids whose batch never landed
    corrupt: list[str] = field(default_factory=list)  # invocation ids of batches that failed validation
    corrupt_reasons: dict[str, str] = field(default_factory=dict)  # invocation id -> one-line reason
    seconds: float = 0.0
    grad_noise_scale: float | None = None  # None: no update measured it this round
    diagnostics: dict[str, float] = field(default_factory=dict)  # the learner's, by name
    projected_s: float = 0.0  # Stellaris: the learner functions' part of the round on the Lambda clock


@dataclass
class UpdateDeadline:
    """The ``time.perf_counter()`` value by which a budget run's next update stops (None: no
    deadline); the scaling decision sets it, the update and the detection obey it."""

    at: float | None = None

    def wait_s(self, wanted_s: float) -> float:
        """``wanted_s``, or less when the deadline is nearer."""
        if self.at is None:
            return wanted_s
        return max(0.0, min(wanted_s, self.at - time.perf_counter()))

    def passed(self) -> bool:
        return self.at is not None and time.perf_counter() > self.at


class Door:
    """The learner's door: a round's payloads that pass ``nitro.validation`` (env, bounds) and
    ``nitro.learners.behaviour`` (their log-probabilities); each other one is dropped and recorded."""

    def __init__(self, config: NitroConfig, learner: Learner, behaviour: BehaviourPolicies, bounds: Bounds):
        self.spec, self.steps_per_actor = learner.spec, config.steps_per_actor
        self.behaviour, self.bounds = behaviour, bounds

    def admit(self, k: int, payloads: dict[str, bytes], report: UpdateReport) -> list[dict]:
        batches = []
        for inv_id, payload in sorted(payloads.items()):
            try:
                arrays, meta = decode_batch_meta(payload, self.spec, self.steps_per_actor, inv_id, self.bounds)
                self.behaviour.check(arrays, batch_version(meta))
                batches.append(arrays)
            except BatchError as exc:
                log.warning("round %d: dropped corrupt batch %s: %s", k, inv_id, exc)
                report.corrupt.append(inv_id)
                report.corrupt_reasons[inv_id] = str(exc)
        return batches


class UpdateMode(Protocol):
    """What the engine reads of every mode."""

    name: str  # "sync" | "learn-while-acting" | "stellaris": the round flow that drives it
    overlaps_actors: bool  # the update runs while the round's actors act (after the decision)
    functions: FunctionAllowance | None  # Stellaris: its learner functions, and what a budget lets them bill
    pending: list[str]  # invocation ids whose batches the next update consumes

    def round_ended(self, k: int, ok: Sequence[ActorSummary]) -> None:
        """Round k's training actors that answered well: what the next round may consume."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LearnerUpdates:
    """What the sync and the learn-while-acting modes share: the learner, its door, and the guard
    that stops a run whose updates keep failing (every minibatch had a non-finite loss or gradient)
    rather than go on with a learner that cannot learn from what it is given."""

    functions = None

    def __init__(self, config: NitroConfig, learner: Learner, cache: TrajectoryCache, door: Door,
                 deadline: UpdateDeadline, lr_gain: Callable[[int], float] = lambda n_batches: 1.0):
        self.config, self.learner, self.cache, self.door, self.deadline = config, learner, cache, door, deadline
        self.lr_gain = lr_gain  # the factor on an update's learning rate, by its batches (Scaler.step_gain)
        self.pending: list[str] = []
        self.failed_updates = 0

    def train(self, k: int, batches: list[dict]) -> UpdateResult:
        """One learner update under the budget's deadline, at the learning rate's gain for its batches."""
        gain = self.lr_gain(len(batches))
        result = self.learner.update(batches, progress=Progress(k, self.config.rounds, lr_gain=gain),
                                     deadline=self.deadline.at)
        if self.config.scaler.scale_step:
            result = dataclasses.replace(result, diagnostics={**result.diagnostics, "lr_gain": gain})
        if result.took_no_step:
            self.failed_updates += 1
            log.warning("round %d: the update took no step (%d in a row)", k, self.failed_updates)
            if self.failed_updates >= MAX_FAILED_UPDATES:
                raise TrainingError(f"round {k}: {self.failed_updates} policy updates in a row had only non-finite "
                                    "losses or gradients; stopping rather than training on garbage")
        else:
            self.failed_updates = 0
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"pending": list(self.pending), "failed_updates": self.failed_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = list(state.get("pending", []))
        self.failed_updates = int(state.get("failed_updates", 0))


def record(report: UpdateReport, result: UpdateResult) -> None:
    report.diagnostics = dict(result.diagnostics)
    report.grad_noise_scale = result.grad_noise_scale


class SyncUpdate(LearnerUpdates):
    """Round k's update trains on round k-1's batches, before the round decides and acts."""

    name = "sync"
    overlaps_actors = False

    def update(self, k: int) -> UpdateReport:
        """Take the previous round's batches from the cache and update the policy. Every pending
        batch is there already (an actor answers only once its batch is stored), so none is waited
        for: one that is gone was lost (the cache expired or was flushed), and the round trains on
        the rest at once, also when a resume finds them gone."""
        if not self.pending:
            return UpdateReport()
        t0 = time.perf_counter()
        collected = self.cache.collect(k - 1, set(self.pending), deadline_s=0.0)
        report = UpdateReport(missing=sorted(collected.missing))
        batches = self.door.admit(k, collected.batches, report)
        report.batches = len(batches)
        if collected.missing:
            log.warning("round %d: %d of %d batches of round %d are gone from the cache (expired or flushed); "
                        "training on the rest", k, len(collected.missing), len(self.pending), k - 1)
        if batches:
            record(report, self.train(k, batches))
            report.samples = int(sum(len(b["rewards"]) for b in batches))
        report.seconds = time.perf_counter() - t0
        crash_point("after-update", k)
        return report

    def round_ended(self, k: int, ok: Sequence[ActorSummary]) -> None:
        self.pending = [s.invocation_id for s in ok]


class LearnWhileActing(LearnerUpdates):
    """The off-policy update, beside the round's actors (paper §4)."""

    name = "learn-while-acting"
    overlaps_actors = True

    def __init__(self, config: NitroConfig, learner: OffPolicyLearner, cache: TrajectoryCache, door: Door,
                 deadline: UpdateDeadline):
        super().__init__(config, learner, cache, door, deadline)
        self.replaying = learner

    def update(self, k: int, expected_ids: list[str], actors_done: threading.Event) -> UpdateReport:
        """Update on each batch of this round as it lands in the cache; while nothing new has landed,
        replay from the buffer; stop when every batch is in, or ``actors_done`` is set and nothing
        more came, or at the deadline."""
        deadline = time.perf_counter() + self.deadline.wait_s(self.config.round_deadline_s)
        waiting, report, busy = set(expected_ids), UpdateReport(), 0.0
        updates = replays = 0
        wait_s = 0.0
        while waiting and time.perf_counter() < deadline:
            got = self.cache.collect(k, waiting, deadline_s=wait_s)
            waiting -= set(got.batches)
            batches = self.door.admit(k, got.batches, report)
            started = time.perf_counter()
            if batches:
                record(report, self.train(k, batches))
                report.samples += int(sum(len(b["rewards"]) for b in batches))
                report.batches += len(batches)
                updates += 1
            elif self.replaying.replay_update(deadline=self.deadline.at) is not None:
                replays += 1
            elif actors_done.is_set():
                break  # nothing landed, nothing to replay, and no actor will write any more
            else:
                wait_s = 0.2  # nothing to learn from: block on the cache for a moment
                continue
            busy += time.perf_counter() - started
            wait_s = 0.0
        report.missing = sorted(waiting)
        report.seconds = busy
        report.diagnostics = {**report.diagnostics, "updates": float(updates), "replay_updates": float(replays),
                              "learner_busy_s": busy}
        return report

    def round_ended(self, k: int, ok: Sequence[ActorSummary]) -> None:
        self.pending = []  # each round's batches were trained on while they landed


class StellarisUpdate:
    """Learner functions and the parameter server (``nitro.stellaris``), beside the round's actors."""

    name = "stellaris"
    overlaps_actors = True

    def __init__(self, config: NitroConfig, learner: PPOLearner, cache: TrajectoryCache, run_dir: RunDir,
                 behaviour: BehaviourPolicies, bounds: Bounds, deadline: UpdateDeadline, actor_cache_url: str,
                 actor_credentials: dict[str, str], max_billed_ms: int):
        self.config, self.cache, self.run_dir, self.deadline = config, cache, run_dir, deadline
        self.actor_cache_url, self.actor_credentials = actor_cache_url, actor_credentials
        self.learning = StellarisLearning(config, learner, cache, run_dir.run_id, behaviour, bounds)
        # The ledger's cap on one invocation's bill: on Lambda the function's own timeout, which
        # may exceed the client's wait (backend.timeout_s); an invocation in flight may cost that much.
        self.functions = FunctionAllowance(max_billed_ms, self.learning.jobs_per_actor(), config.learner.functions_for)
        self.pending: list[str] = []

    def plan(self, k: int, events: list[ActorEvent], weights_key: str) -> GradientPlan:
        """The round's gradient jobs and their schedule, for the attempt at the round that recorded
        the actors in flight, recorded beside them: a learner that dies now bills, on resume,
        the jobs that ran (answered, or started and lost) and none that never started."""
        record = self.run_dir.inflight()
        attempt = str(record["attempt"]) if record is not None and int(record["round"]) == k else None
        attempt = self.run_dir.save_inflight(k, [e.invocation_id for e in events], attempt=attempt)
        plan = self.learning.plan(k, events, weights_key, self.actor_cache_url, self.actor_credentials, attempt)
        if plan.jobs:
            self.run_dir.save_inflight(k, [e.invocation_id for e in events], attempt=attempt,
                                       if_started=self.learning.invocation_ids(plan))
        return plan

    def run_lane(self, plan: GradientPlan, lane: int, backend: Backend) -> list[ActorSummary]:
        """One learner function's jobs of the round, and the summaries of the invocations that ran
        them (what the round is billed for), in as few invocations as the jobs' readiness allows.
        Seeded: the schedule's jobs on this lane (``run_seeded_lane``). Measured: once the next job
        in line may start, the lane takes it and starts an invocation for it, which goes on to take
        each next job in line that is ready (``nitro.stellaris.function.run_lane``). A job that
        cannot start, or that an invocation took and did not answer, is lost with its reason."""
        if not plan.measured:
            return self.run_seeded_lane(plan, lane, backend)
        invocations = []
        while (job := self.learning.take_next(plan)) is not None:
            invocations.append(self._invoke(self.learning.lanes.pulling_event(lane, job), backend))
            self.learning.answer_lost(plan, invocations[-1])
        return invocations

    def run_seeded_lane(self, plan: GradientPlan, lane: int, backend: Backend) -> list[ActorSummary]:
        """The lane's jobs, in the schedule's order: once the first job still to run may start, one
        invocation takes it and the ones after it for as long as each is ready within the linger
        (``nitro.stellaris.function.run_lane``); the next invocation starts where it stopped. A job
        that cannot start, or that an invocation was on when it failed, is lost with its reason."""
        jobs, invocations = self.learning.lane_jobs(plan, lane), list[ActorSummary]()
        while jobs:
            started = self.learning.start(jobs[0])
            if isinstance(started, str):
                self.learning.answered(jobs[0], ActorSummary.failed(jobs[0].invocation_id, started))
                jobs = jobs[1:]
                continue
            summary = self._invoke(self.learning.lanes.event(lane, len(invocations), jobs), backend)
            invocations.append(summary)
            self.learning.relay()  # what it pushed reaches the server before the lane looks
            rest = [job for job in jobs if not self.learning.has_answer(job)]
            if rest and (not summary.ok or len(rest) == len(jobs)):  # the job it was on (or could not run)
                reason = summary.error if not summary.ok else "its lane's invocation ran none of its jobs"
                self.learning.answered(rest[0], ActorSummary.failed(rest[0].invocation_id,
                                                                    f"gradient job failed: {reason}"))
                rest = rest[1:]
            jobs = rest
        return invocations

    def _invoke(self, event: GradientLane, backend: Backend) -> ActorSummary:
        """One lane invocation, if a budget run's deadline for the round has not passed and its
        allowance has room for it at its timeout (``nitro.stellaris.allowance``), recorded as
        started first (a resume bills it from then on); a failed one's summary is left in the cache
        for a resume too. Never raises."""
        if self.deadline.passed():  # what runs past it ends within its timeout, which the cap reserves
            return ActorSummary.failed(event.invocation_id, "gradient job not started: the budget's deadline for "
                                       "the round's learning passed")
        if not self.functions.take():
            return ActorSummary.failed(event.invocation_id, self.functions.refusal())
        self.cache.mark_started(event.round, event.invocation_id)
        try:
            summary = backend.invoke(event)
        except Exception as exc:  # the backend's own fault
            summary = ActorSummary.failed(event.invocation_id, f"{type(exc).__name__}: {exc}")
        self.functions.settle(summary.billed_ms)
        if not summary.ok:
            self.cache.put_summary(event.round, event.invocation_id, summary.model_dump_json())
        return summary

    def serve(self, k: int, plan: GradientPlan) -> UpdateReport:
        """Apply the round's gradients as the schedule lands them (``StellarisLearning.serve``)."""
        served = self.learning.serve(k, plan)
        self.functions.answered(len(plan.jobs) - len(served.lost))
        batches = list(served.batches.values())
        corrupt = {**served.corrupt, **served.lost}
        answers = {inv: ActorSummary.model_validate_json(raw) for inv, raw in self.cache.get_summaries(
            k, sorted({j.actor_id for j in plan.jobs}) + [j.invocation_id for j in plan.jobs]).items()}
        projected, learning = self.projected_update_s(plan, answers, served.busy_s, served.versions)
        profiles = [answers[j.invocation_id].profile for j in plan.jobs
                    if j.invocation_id in answers and answers[j.invocation_id].profile]
        profile = {f"stellaris_job_{part}": sum(p.get(part, 0.0) for p in profiles) / len(profiles)
                   for part in sorted({part for p in profiles for part in p})}  # a job's mean seconds by part
        diagnostics = served.metrics | profile | self.functions.metrics() | {
            "stellaris_projected_s": projected, "stellaris_learning_s": learning}
        return UpdateReport(samples=int(sum(len(b["rewards"]) for b in batches)), batches=len(batches),
                            missing=sorted(served.missing), corrupt=sorted(served.corrupt), corrupt_reasons=corrupt,
                            seconds=served.busy_s, projected_s=projected, diagnostics=diagnostics)

    def projected_update_s(self, plan: GradientPlan, answers: dict[str, ActorSummary], busy_s: float,
                           versions: int) -> tuple[float, float]:
        """The round replayed with what was measured (``nitro.stellaris.schedule.replay``): each batch
        lands ``clock.invoke_s`` + its actor's duration after the round's start, each job takes
        ``clock.invoke_s`` + its function's duration (a job that ran after another in its lane's
        invocation pays no ``invoke_s``). Returns the round's learning on the Lambda clock and its
        part after the first batch landed."""
        invoke_s = self.config.clock.invoke_s

        def took(inv: str) -> float:
            if inv not in answers:
                return invoke_s
            return (0.0 if answers[inv].shared_invocation else invoke_s) + answers[inv].duration_s

        return replay([took(j.actor_id) for j in plan.jobs], [took(j.invocation_id) for j in plan.jobs],
                      lanes=plan.lanes, bound=plan.bound, trigger_k=self.config.learner.trigger_k or plan.lanes,
                      busy_s=busy_s, versions=versions)

    def round_ended(self, k: int, ok: Sequence[ActorSummary]) -> None:
        """The parameter server trained on the round's batches as they landed; the lanes have all
        returned, so the round's billing per job is complete."""
        self.functions.close()

    def state_dict(self) -> dict[str, Any]:
        return {"pending": [], "stellaris": self.learning.state_dict() | {"functions": self.functions.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("stellaris"):
            self.learning.load_state_dict(state["stellaris"])
            self.functions.load_state_dict(state["stellaris"].get("functions", {}))


def make_update_mode(config: NitroConfig, learner: Learner, cache: TrajectoryCache, run_dir: RunDir,
                     behaviour: BehaviourPolicies, bounds: Bounds, deadline: UpdateDeadline, actor_cache_url: str,
                     actor_credentials: dict[str, str], *, max_billed_ms: int,
                     lr_gain: Callable[[int], float] = lambda n_batches: 1.0,
                     ) -> SyncUpdate | LearnWhileActing | StellarisUpdate:
    """The mode ``config.update_mode`` names, over the run's learner and cache; ``lr_gain``: the
    factor on a sync update's learning rate, by its batches (the scaler's ``step_gain``);
    ``max_billed_ms``: the ledger's cap on one invocation's bill, which Stellaris's allowance counts
    an invocation in flight at."""
    if config.update_mode == "stellaris":
        if not isinstance(learner, PPOLearner):
            raise TypeError(f"learner.mode=stellaris computes PPO gradients, not {type(learner).__name__}'s")
        return StellarisUpdate(config, learner, cache, run_dir, behaviour, bounds, deadline, actor_cache_url,
                               actor_credentials, max_billed_ms)
    door = Door(config, learner, behaviour, bounds)
    if config.update_mode == "learn-while-acting":
        if not isinstance(learner, OffPolicyLearner):
            raise TypeError(f"{type(learner).__name__} cannot learn while acting: it does not replay")
        return LearnWhileActing(config, learner, cache, door, deadline)
    return SyncUpdate(config, learner, cache, door, deadline, lr_gain)
