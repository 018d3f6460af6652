"""One round's gradient jobs as a deterministic discrete-event schedule.

Learner functions run on ``lanes`` concurrent slots and take jobs from a FIFO queue. A job reads
the policy version the parameter server (PS) has when it starts and lands its gradient when it
ends; the PS then applies pending gradients by the rule in ``nitro.stellaris.aggregation``. The
same inputs give the same schedule, so a run repeats exactly and a test can assert every job's
staleness.

Timing conventions:

* a job starts at max(its ready time, the earliest free lane, the start of the job ahead of it);
  it takes the lowest-numbered free lane;
* the PS handles landings in time order (ties by job index) and has bumped its version for every
  earlier trigger before it reads the next landing's staleness;
* an application keeps the PS busy for ``apply_s``; its new weights are visible when it ends, and a
  job starting at exactly that time reads them;
* a landing while the PS is busy waits for it; when the PS is free it takes every landing that
  waited, reads their stalenesses at that version and checks the trigger once for them all. A group
  so grows with the rate of landings and the PS never falls behind them (with ``apply_s`` = 0 it is
  never busy, and every landing is handled on its own);
* gradients still pending when the last job has landed are applied together: nothing computed in
  a round is dropped.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nitro.stellaris.aggregation import should_apply


@dataclass(frozen=True)
class LatencyModel:
    """Seconds a learner function takes: a start-up cost (a cold instance loads more), a cost per
    sample, and a mean-1 lognormal factor for the spread seen on real functions."""

    cold_s: float = 0.25
    warm_s: float = 0.02
    per_sample_s: float = 2e-5
    jitter: float = 0.2

    def draw(self, samples: Sequence[int], rng: np.random.Generator, cold: Sequence[bool]) -> list[float]:
        if len(cold) != len(samples):
            raise ValueError("cold must have one entry per job in samples")
        noise = np.exp(self.jitter * rng.standard_normal(len(samples)) - self.jitter ** 2 / 2)
        return [((self.cold_s if c else self.warm_s) + self.per_sample_s * n) * float(f)
                for n, c, f in zip(samples, cold, noise)]


@dataclass(frozen=True)
class ScheduledJob:
    job: int
    lane: int
    start_s: float
    end_s: float
    snapshot_version: int  # the PS version the job's gradient is computed against


@dataclass(frozen=True)
class Application:
    version: int  # v_PS before the bump
    jobs: tuple[int, ...]  # applied in this order
    staleness: tuple[int, ...]  # of each job, at its landing


@dataclass(frozen=True)
class GradientSchedule:
    jobs: tuple[ScheduledJob, ...]  # by job index
    applications: tuple[Application, ...]
    start_version: int
    final_version: int
    makespan_s: float  # the time of the last application

    @property
    def mean_staleness(self) -> float:
        values = [s for a in self.applications for s in a.staleness]
        return sum(values) / len(values) if values else 0.0

    def staleness_of(self, job: int) -> int:
        for a in self.applications:
            if job in a.jobs:
                return a.staleness[a.jobs.index(job)]
        raise KeyError(f"job {job} is not in the schedule")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GradientSchedule:
        return cls(
            jobs=tuple(ScheduledJob(**j) for j in data["jobs"]),
            applications=tuple(Application(version=a["version"], jobs=tuple(a["jobs"]),
                                           staleness=tuple(a["staleness"])) for a in data["applications"]),
            start_version=data["start_version"], final_version=data["final_version"],
            makespan_s=data["makespan_s"])


def simulate(ready_s: Sequence[float], latency_s: Sequence[float], *, lanes: int, start_version: int,
             bound: int | None, trigger_k: int, apply_s: float = 0.0) -> GradientSchedule:
    """Run the round's jobs (in index order) through ``lanes`` learner functions and the PS."""
    if len(latency_s) != len(ready_s):
        raise ValueError("latency_s must have one entry per job in ready_s")
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    if trigger_k < 1:
        raise ValueError(f"trigger_k must be >= 1, got {trigger_k}")
    if any(x < 0 for x in latency_s):
        raise ValueError("latency_s must be >= 0")

    n = len(ready_s)
    lane_free = [0.0] * lanes
    landings: list[tuple[float, int]] = []  # heap of (end_s, job)
    visible_at: list[float] = []  # when each application's weights become visible, in order
    applications: list[Application] = []
    scheduled: list[ScheduledJob] = []
    pending: list[tuple[int, int]] = []  # (job, staleness), in landing order
    last_start = last_landing = ps_free = 0.0

    def apply_pending(at: float) -> None:
        nonlocal ps_free
        applications.append(Application(version=start_version + len(applications),
                                        jobs=tuple(j for j, _ in pending),
                                        staleness=tuple(s for _, s in pending)))
        visible_at.append(at + apply_s)
        ps_free = at + apply_s
        pending.clear()

    while len(scheduled) < n or landings:
        next_start = None
        if len(scheduled) < n:
            next_start = max(ready_s[len(scheduled)], min(lane_free), last_start)
        taken_at = max(landings[0][0], ps_free) if landings else math.inf  # when the PS takes the next landing
        # Landings taken up to the next start first: their applications may be what that job reads.
        if landings and (next_start is None or taken_at <= next_start):
            waited = taken_at > landings[0][0]
            group = [heapq.heappop(landings)[1]]
            while waited and landings and landings[0][0] <= taken_at:  # all that landed while the PS was busy
                group.append(heapq.heappop(landings)[1])
            last_landing = taken_at
            v_ps = start_version + len(applications)
            pending.extend((job, v_ps - scheduled[job].snapshot_version) for job in group)
            if should_apply([s for _, s in pending], bound, trigger_k):
                apply_pending(taken_at)
            continue
        assert next_start is not None  # with every job started, a landing is left, and the branch above took it
        job, last_start = len(scheduled), next_start
        lane = next(i for i, free in enumerate(lane_free) if free <= next_start)
        end = next_start + latency_s[job]
        lane_free[lane] = end
        scheduled.append(ScheduledJob(job=job, lane=lane, start_s=next_start, end_s=end,
                                      snapshot_version=start_version + bisect_right(visible_at, next_start)))
        heapq.heappush(landings, (end, job))

    if pending:
        apply_pending(last_landing)
    return GradientSchedule(jobs=tuple(scheduled), applications=tuple(applications), start_version=start_version,
                            final_version=start_version + len(applications),
                            makespan_s=visible_at[-1] if visible_at else 0.0)


def replay(ready_s: Sequence[float], latency_s: Sequence[float], *, lanes: int, bound: int | None, trigger_k: int,
           busy_s: float, versions: int) -> tuple[float, float]:
    """A round's learning replayed with its measured times: the batches' landing times, the jobs'
    durations, and the parameter server's measured ``busy_s`` over its ``versions`` (each
    application keeps it busy for its share). Receiving the gradients is part of that busy time and
    has no place in the replay, so the learning lasts at least ``busy_s`` from the first landing.
    Returns (when the last gradient is applied, how long after the first batch landed)."""
    if not ready_s:
        return 0.0, 0.0
    schedule = simulate(ready_s, latency_s, lanes=lanes, start_version=0, bound=bound, trigger_k=trigger_k,
                        apply_s=busy_s / max(versions, 1))
    end = max(schedule.makespan_s, min(ready_s) + busy_s)
    return end, end - min(ready_s)
