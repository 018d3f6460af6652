"""A round's gradient jobs as a discrete-event schedule: which snapshot each job computes against,
when its gradient lands, and which landings the parameter server applies together.

Jobs leave a FIFO queue for ``lanes`` learner functions; a job starts when its batch has landed
and a lane is free, against the version the parameter server holds at that moment. Landings are
handled in time order: each joins the pending list with its staleness, and ``should_apply``
decides whether the list is applied now (one version bump). What lands after the last job is
applied at the end: nothing computed is dropped. Drawn from seeded latencies, the schedule makes a
run repeat exactly; replayed with measured durations, it is the round's projected learner time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from nitro.stellaris.aggregation import should_apply


@dataclass(frozen=True)
class LatencyModel:
    cold_s: float = 0.25
    warm_s: float = 0.02
    per_sample_s: float = 2e-5
    jitter: float = 0.2

    def draw(self, samples: Sequence[int], rng: np.random.Generator, cold: Sequence[bool]) -> list[float]:
        """(cold or warm start + per-sample compute) x a lognormal factor of mean 1, per job."""
        factors = np.exp(self.jitter * rng.standard_normal(len(samples)) - self.jitter ** 2 / 2)
        return [float(((self.cold_s if c else self.warm_s) + self.per_sample_s * n) * f)
                for n, c, f in zip(samples, cold, factors)]


@dataclass(frozen=True)
class ScheduledJob:
    job: int
    lane: int
    start_s: float
    end_s: float
    snapshot_version: int


@dataclass(frozen=True)
class Application:
    version: int  # the parameter server's version before this bump
    jobs: tuple[int, ...]  # applied in this order
    staleness: tuple[int, ...]


@dataclass(frozen=True)
class GradientSchedule:
    jobs: tuple[ScheduledJob, ...]
    applications: tuple[Application, ...]
    start_version: int
    final_version: int
    makespan_s: float

    @property
    def mean_staleness(self) -> float:
        values = [s for a in self.applications for s in a.staleness]
        return float(np.mean(values)) if values else 0.0

    def staleness_of(self, job: int) -> int:
        for a in self.applications:
            if job in a.jobs:
                return a.staleness[a.jobs.index(job)]
        raise KeyError(job)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GradientSchedule":
        return cls(jobs=tuple(ScheduledJob(**j) for j in d["jobs"]),
                   applications=tuple(Application(a["version"], tuple(a["jobs"]), tuple(a["staleness"]))
                                      for a in d["applications"]),
                   start_version=int(d["start_version"]), final_version=int(d["final_version"]),
                   makespan_s=float(d["makespan_s"]))


def simulate(ready_s: Sequence[float], latency_s: Sequence[float], *, lanes: int, start_version: int,
             bound: int | None, trigger_k: int, apply_s: float = 0.0) -> GradientSchedule:
    """The schedule of jobs 0..n-1 (FIFO) on ``lanes`` functions (see the module docstring)."""
    n = len(ready_s)
    if len(latency_s) != n:
        raise ValueError(f"latency_s: {len(latency_s)} latencies for {n} jobs")
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    if trigger_k < 1:
        raise ValueError(f"trigger_k must be >= 1, got {trigger_k}")
    if any(x < 0 or not math.isfinite(x) for x in latency_s):
        raise ValueError("latency_s: every latency must be finite and >= 0")

    version, bumps = start_version, []  # bumps: (time, new version), in time order
    free = [(0.0, lane) for lane in range(lanes)]  # (free from, lane)
    heapq.heapify(free)
    landings: list[tuple[float, int]] = []  # (end time, job)
    scheduled: list[ScheduledJob | None] = [None] * n
    pending: list[tuple[int, int]] = []  # (job, staleness)
    applications: list[Application] = []
    last_start, clock = 0.0, 0.0

    def version_at(t: float) -> int:
        v = start_version
        for when, new in bumps:
            if when <= t:
                v = new
        return v

    def apply(t: float) -> None:
        nonlocal version
        applications.append(Application(version, tuple(j for j, _ in pending), tuple(s for _, s in pending)))
        pending.clear()
        version += 1
        bumps.append((t + apply_s, version))

    next_job = 0
    while next_job < n or landings:
        # The next job may start at max(ready, a free lane, the previous start); it starts now
        # unless a landing comes first (that landing may bump the version it would see).
        start = math.inf
        if next_job < n:
            start = max(ready_s[next_job], free[0][0], last_start)
        if landings and landings[0][0] <= start:
            t, j = heapq.heappop(landings)
            clock = max(clock, t)
            pending.append((j, version - scheduled[j].snapshot_version))  # type: ignore[union-attr]
            if should_apply([s for _, s in pending], bound, trigger_k):
                apply(t)
            continue
        _, lane = heapq.heappop(free)
        latency = float(latency_s[next_job])
        job = ScheduledJob(next_job, lane, start, start + latency, version_at(start))
        scheduled[next_job] = job
        heapq.heappush(free, (job.end_s, lane))
        heapq.heappush(landings, (job.end_s, next_job))
        last_start = start
        next_job += 1
    if pending:
        apply(clock)
    makespan = (bumps[-1][0] if bumps else clock)
    return GradientSchedule(tuple(scheduled), tuple(applications), start_version, version, makespan)  # type: ignore[arg-type]
