"""A measured round's jobs as they start and land (``learner.schedule: measured``): the FIFO gate
over the round's learner functions, the version each job is bound to as it starts, and the order
the answers came in. Plain state: ``nitro.stellaris.round.StellarisLearning`` holds it under its
lock and waits on its condition."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nitro.stellaris.jobs import GradientJob


@dataclass
class InFlight:
    """The round's jobs as they run: the answers in the order they came and, in a measured round,
    the FIFO start gate over ``lanes`` learner functions, the version each running job holds and
    each started job as it was bound. Guarded by ``StellarisLearning._signal``."""

    measured: bool = False
    lanes: int = 0
    attempt: str = ""
    next_job: int = 0  # the first job that has neither started nor given up
    claimed: int = 0  # jobs a lane has taken, in FIFO order
    passed: set[int] = field(default_factory=set)  # jobs that have started or given up
    running: dict[int, int] = field(default_factory=dict)  # job -> the version it computes against
    started: dict[str, GradientJob] = field(default_factory=dict)  # invocation id -> the job as bound
    answers: list[str] = field(default_factory=list)  # invocation ids, in the order their answers came
    closed: bool = False  # the parameter server stopped waiting: no job starts any more

    def claim(self, jobs: int) -> int | None:
        """The next job for a free lane to take (of the round's ``jobs``), or None when all are taken."""
        if self.claimed >= jobs:
            return None
        self.claimed += 1
        return self.claimed - 1

    def may_start(self, job: int) -> bool:
        """The job is next in line and a function is free (or nothing will start any more)."""
        return self.closed or (self.next_job == job and len(self.running) < self.lanes)

    def pass_gate(self, job: int) -> None:
        """The job started or gave up: the jobs behind it no longer wait for it."""
        self.passed.add(job)
        while self.next_job in self.passed:
            self.next_job += 1

    def bind(self, job: GradientJob, version: int, key: Callable[[int], str]) -> GradientJob:
        """``job`` as it starts against ``version`` (``key``: a version's snapshot key), beside the
        versions the running jobs hold: its live ones."""
        live = sorted(set(self.running.values()) - {version})
        self.running[job.job] = version
        started = job.model_copy(update={"snapshot_version": version, "snapshot_key": key(version),
                                          "live_keys": [key(v) for v in live]})
        self.started[job.invocation_id] = started
        return started
