"""A round's learner functions as invocations: each lane's jobs run in as few invocations as their
readiness allows (``nitro.stellaris.function.run_lane``), and every job's answer comes back through
one Redis list per attempt at the round, which the parameter server reads while the lanes go on
(an invocation answers only when it ends). Seeded (``learner.schedule: seeded``): an invocation
gets the lane's jobs still to run, in the schedule's order. Measured: it gets the job its lane took
for it and takes each next one in line from the round's gate itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from nitro.actors.events import ActorSummary
from nitro.cache import TrajectoryCache
from nitro.config import LearnerConfig
from nitro.stellaris.jobs import GradientJob, GradientLane, answers_key, lane_invocation_id, pulling_invocation_id


class LaneInvocations:
    """The lanes of one attempt at a round: their invocations' events and ids, and the answers
    their jobs pushed. ``key`` is None until a round with jobs begins."""

    def __init__(self, cache: TrajectoryCache, run_id: str, learner: LearnerConfig, invocation_timeout_s: float):
        self.cache, self.run_id, self.learner = cache, run_id, learner
        self.invocation_timeout_s = invocation_timeout_s
        self.key: str | None = None
        self.round, self.attempt = 0, ""
        self.jobs: dict[str, GradientJob] = {}  # the round's jobs by invocation id
        self.lanes = 0

    def begin(self, k: int, attempt: str, jobs: Sequence[GradientJob], lanes: int) -> None:
        self.key, self.round, self.attempt = answers_key(self.cache, k, attempt), k, attempt
        self.jobs, self.lanes = {job.invocation_id: job for job in jobs}, lanes

    def invocation_ids(self, lane_of_job: Sequence[int] | None) -> list[str]:
        """Every invocation the lanes may start: seeded (``lane_of_job``: each job's lane), at most
        one per job on a lane (each of its jobs may start one, when the one before it was not ready
        within the linger); measured (None), at most one per job (the one its lane took it for)."""
        if lane_of_job is None:
            return [pulling_invocation_id(self.run_id, self.round, self.attempt, job.job) for job in self.jobs.values()]
        jobs_per_lane = Counter(lane_of_job)
        return [lane_invocation_id(self.run_id, self.round, self.attempt, lane, part)
                for lane in sorted(jobs_per_lane) for part in range(jobs_per_lane[lane])]

    def event(self, lane: int, part: int, jobs: list[GradientJob]) -> GradientLane:
        """The ``part``-th invocation of ``lane``, for its ``jobs`` still to run, in order. No job
        starts after half the invocation's deadline, so the invocation ends inside it."""
        assert self.key is not None, "a lane's invocation belongs to a round"
        return GradientLane(invocation_id=lane_invocation_id(self.run_id, self.round, self.attempt, lane, part),
                            round=self.round, lane=lane, jobs=jobs, answers_key=self.key,
                            linger_s=self.learner.lane_linger_s, budget_s=self.invocation_timeout_s / 2)

    def pulling_event(self, lane: int, job: GradientJob) -> GradientLane:
        """A measured lane's invocation for the ``job`` it took (bound), which then takes each next
        job in line from the round's gate."""
        assert self.key is not None, "a lane's invocation belongs to a round"
        return GradientLane(invocation_id=pulling_invocation_id(self.run_id, self.round, self.attempt, job.job),
                            round=self.round, lane=lane, jobs=[job], answers_key=self.key,
                            linger_s=self.learner.lane_linger_s, budget_s=self.invocation_timeout_s / 2,
                            pulls=True, attempt=self.attempt, lanes=self.lanes)

    def pop(self, block_s: float = 0.0) -> list[tuple[GradientJob, ActorSummary]]:
        """The answers pushed since the last call, with their jobs (waiting up to ``block_s`` for the
        first, when none is there)."""
        if self.key is None:
            return []
        client = self.cache.client
        first = client.blpop([self.key], timeout=block_s) if block_s > 0 else None
        raw = [first[1]] if first else []
        while more := client.lpop(self.key, 64):
            raw.extend(more if isinstance(more, list) else [more])
        answers = [ActorSummary.model_validate_json(item) for item in raw]
        return [(self.jobs[a.invocation_id], a) for a in answers if a.invocation_id in self.jobs]
