"""The gradient noise scale of a Stellaris round, from the gradients its learner functions hand
the parameter server (``nitro.scaling.noise``): no gradient is computed for it."""

from __future__ import annotations

import time

from nitro.learners.fragments import SECONDS, FragmentSums
from nitro.scaling.noise import diagnostics_of, measurement_from, pool_measurements
from nitro.stellaris.jobs import GradientJob
from nitro.stellaris.wire import Gradient


class NoiseGroups:
    """The round's gradient noise from the functions' own gradients (``nitro.scaling.noise``): the
    first pass's gradients, one per actor batch (its first slice to land) for each snapshot version,
    each version's gradients a group of fragments at one point; the groups pooled. A later pass
    re-reads the same samples, and two slices of one batch share its trajectories: neither is a new
    fragment. Costs a few norms of gradients the parameter server holds anyway."""

    def __init__(self) -> None:
        self.groups: dict[int, FragmentSums] = {}
        self.seen: set[tuple[int, str]] = set()
        self.seconds = 0.0

    def add(self, job: GradientJob, gradient: Gradient) -> None:
        if job.epoch != 0 or (job.snapshot_version, job.actor_id) in self.seen:
            return
        started = time.perf_counter()
        self.seen.add((job.snapshot_version, job.actor_id))
        g = gradient.gradients()
        self.groups.setdefault(job.snapshot_version, FragmentSums()).add(g.tensors, g.samples)
        self.seconds += time.perf_counter() - started

    def diagnostics(self) -> dict[str, float]:
        """The pooled measurement as the sync learner reports one; empty when no version had two."""
        started = time.perf_counter()
        measured = [m for m in (measurement_from(s.norms()) for s in self.groups.values()) if m is not None]
        pooled = pool_measurements(measured)
        if pooled is None:
            return {}
        return diagnostics_of(pooled) | {SECONDS: self.seconds + time.perf_counter() - started}
