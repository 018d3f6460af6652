"""The learner function: ``run_gradient(job, state) -> ActorSummary``, the sibling of ``run_actor``,
and ``run_lane(lane, state)``: a lane's consecutive jobs in one invocation.

It reads the job's snapshot, the behaviour policy, the live versions and the batch from the cache,
computes the slice's gradient (``nitro.stellaris.gradient``) and writes it under the job's
gradient key (SET NX with the cache's TTL: a second delivery never overwrites the first answer).
Its summary is the actors' summary (``steps``: the slice's samples; ``batch_key``: the gradient's
key), so every backend runs it, bills it and reports its failure the same way. It never raises.
Snapshots stay decoded in the warm state, as many as twice the versions one job reads: the next
job at the same versions loads nothing. The summary's ``profile`` says where the job's time went
(fetch, decode, forward-backward, write).

A lane's invocation runs its jobs in order, each once its batch has landed and its snapshot is
published, and pushes each job's summary to the round's answers list as it ends, so the parameter
server applies it (and publishes the versions the lane's later jobs wait for) while the lane goes
on. A measured lane's invocation then takes each next job in line from the round's gate, bound to
the version published as it takes it, and frees its place in the gate with each answer. It returns
at the first job not ready within ``linger_s``, or once ``budget_s`` has passed; the caller starts
the rest in a new invocation. The lane's own summary is the one billed: its
jobs' summaries carry ``billed_ms`` 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from nitro.actors.events import ActorSummary
from nitro.actors.worker import ActorState, error_line, memory_mb_of
from nitro.config import validation_message


class Profile:
    """Seconds one job spends fetching from the cache, decoding, in forward-backward and writing
    its gradient: what the function reports beside its answer."""

    def __init__(self) -> None:
        self.seconds = {"fetch_s": 0.0, "decode_s": 0.0, "compute_s": 0.0, "write_s": 0.0}

    def timed(self, part: str, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return work()
        finally:
            self.seconds[part] += time.perf_counter() - start


def _decoded(state: ActorState, key: str, decode: Callable[[], Any], kept: int) -> Any:
    """``decode()``'s result for ``key``, kept in the warm state (the ``kept`` most recently
    used): the next job at the same version decodes nothing."""
    if key in state.snapshots:
        state.snapshots[key] = state.snapshots.pop(key)  # most recently used last
    else:
        while len(state.snapshots) >= max(kept, 1):
            state.snapshots.pop(next(iter(state.snapshots)))  # the least recently used
        state.snapshots[key] = decode()
    return state.snapshots[key]


def cached_snapshot(state: ActorState, cache: Any, key: str, spec: Any, kept: int, profile: Profile) -> Any:
    """The snapshot under ``key``, decoded once per warm instance while among the ``kept`` most
    recently used; ``profile`` gets the fetch and decode seconds of a miss."""
    from nitro.stellaris.wire import load_snapshot

    def decode() -> Any:
        payload = profile.timed("fetch_s", lambda: cache.fetch_weights(key))
        return profile.timed("decode_s", lambda: load_snapshot(payload, spec))

    return _decoded(state, key, decode, kept)


def _behaviour_policy(state: ActorState, cache: Any, key: str, spec: Any, kept: int, profile: Profile) -> Any:
    """The policy the batch was acted with (the round's actor weights)."""
    import torch

    from nitro.actors.worker import WEIGHTS_FORMAT
    from nitro.models import Architecture
    from nitro.models.networks import build_policy, holding
    from nitro.serialization import loads_tensors

    def load(payload: bytes) -> Any:
        arrays, meta = loads_tensors(payload, expect_format=WEIGHTS_FORMAT)
        arch = Architecture.from_meta(meta.get("arch"))
        return holding(lambda: build_policy(spec, arch=arch), {k: torch.as_tensor(v) for k, v in arrays.items()})

    def decode() -> Any:
        payload = profile.timed("fetch_s", lambda: cache.fetch_weights(key))
        return profile.timed("decode_s", lambda: load(payload))

    return _decoded(state, key, decode, kept)


def snapshots_kept(job: Any) -> int:
    """How many decoded networks the warm state keeps: twice what one job reads (its snapshot, the
    behaviour policy and the live versions), so the versions the next job on this instance reads
    (mostly the same, shifted by a few newer ones) find the current set still decoded."""
    return 2 * (2 + len(job.live_keys))


def run_gradient(event: Any, state: ActorState | None = None, *, memory_mb: int | None = None,
                 in_lane: int | None = None) -> ActorSummary:
    """Compute and store one gradient job's gradient; summarise. Never raises. ``in_lane``: the
    job's place in a lane's invocation (None: the job is its own invocation, billed by itself)."""
    from nitro.stellaris.jobs import GradientJob

    start = time.perf_counter()
    state = state if state is not None else ActorState()
    mem = memory_mb_of(state, memory_mb)
    if in_lane is None:
        state.invocations += 1

    def summary(inv: str, ok: bool, error: str | None = None, **fields: Any) -> ActorSummary:
        # in a lane's invocation, the invocation is billed whole (``run_lane``), not its jobs
        return ActorSummary.since(inv, start, mem, billed=in_lane is None, error=None if ok else error or "failed",
                                  shared_invocation=bool(in_lane), **fields)

    try:
        job = event if isinstance(event, GradientJob) else GradientJob.model_validate(event)
    except ValidationError as exc:
        raw = event.get("invocation_id") if isinstance(event, dict) else None
        return summary(raw if isinstance(raw, str) and raw else "unknown", False,
                       validation_message(exc, "gradient job"))

    cache = None
    try:
        import torch

        from nitro.cache import TrajectoryCache
        from nitro.envs import env_spec
        from nitro.serialization import loads_tensors
        from nitro.stellaris.gradient import slice_gradient, slice_rows
        from nitro.stellaris.jobs import gradient_key
        from nitro.stellaris.wire import gradient_payload

        client = state.redis_client(job.cache_url, state.resolve_password(job.cache_credentials))
        cache = TrajectoryCache(client, job.run_id, ttl_s=job.ttl_s)
        spec = env_spec(job.env_id)
        profile, kept = Profile(), snapshots_kept(job)
        snap = cached_snapshot(state, cache, job.snapshot_key, spec, kept, profile)
        if snap.version != job.snapshot_version:
            return _kept(cache, job, summary(job.invocation_id, False,
                                             f"snapshot {job.snapshot_key!r} is version {snap.version}, "
                                             f"the job names {job.snapshot_version}"))
        raw_batch = profile.timed("fetch_s", lambda: cache.fetch(job.batch_key))
        if raw_batch is None:
            return _kept(cache, job, summary(job.invocation_id, False,
                                             f"batch {job.batch_key!r} is missing or expired"))
        batch, _ = profile.timed("decode_s", lambda: loads_tensors(raw_batch))
        behaviour = _behaviour_policy(state, cache, job.behaviour_key, spec, kept, profile)
        live = [cached_snapshot(state, cache, key, spec, kept, profile).policy for key in job.live_keys]
        rows = slice_rows(len(batch["rewards"]), job.slice_samples, job.seed, job.epoch, job.slice)
        torch.manual_seed(job.seed)
        grads, metrics = profile.timed("compute_s", lambda: slice_gradient(
            snap.policy, snap.critic, behaviour, live, batch, rows, snap.settings))

        def write() -> tuple[str, int]:
            payload = gradient_payload(grads, invocation_id=job.invocation_id,
                                       snapshot_version=job.snapshot_version, metrics=metrics)
            key = gradient_key(cache, job.round, job.invocation_id)
            cache.client.set(key, payload, nx=True, ex=job.ttl_s)
            return key, len(payload)

        key, size = profile.timed("write_s", write)
        return _kept(cache, job, summary(job.invocation_id, True, steps=len(rows), batch_key=key, batch_bytes=size,
                                         profile=profile.seconds))
    except Exception as exc:  # the function never raises: the parameter server gets one line
        return _kept(cache, job, summary(job.invocation_id, False, error_line(exc)))


def _kept(cache: Any, job: Any, summary: ActorSummary) -> ActorSummary:
    """``summary``, after leaving a copy in the cache: the parameter server stops waiting for a
    gradient whose job failed, and a resumed run bills the invocation."""
    if cache is not None:
        try:
            cache.put_summary(job.round, job.invocation_id, summary.model_dump_json())
        except Exception:
            pass
    return summary


def run_lane(event: Any, state: ActorState | None = None, *, memory_mb: int | None = None) -> ActorSummary:
    """Run a lane's jobs in order in this invocation (see the module docstring); summarise the
    invocation (``steps``: the samples of the jobs it ran). Never raises."""
    from nitro.stellaris.jobs import GradientLane

    start = time.perf_counter()
    state = state if state is not None else ActorState()
    mem = memory_mb_of(state, memory_mb)
    state.invocations += 1

    try:
        lane = event if isinstance(event, GradientLane) else GradientLane.model_validate(event)
    except ValidationError as exc:
        raw = event.get("invocation_id") if isinstance(event, dict) else None
        return ActorSummary.since(raw if isinstance(raw, str) and raw else "unknown", start, mem,
                                  error=validation_message(exc, "gradient lane"))
    first = lane.jobs[0]
    cache = None
    try:
        from nitro.cache import TrajectoryCache
        from nitro.stellaris.arrivals import Gate

        client = state.redis_client(first.cache_url, state.resolve_password(first.cache_credentials))
        cache = TrajectoryCache(client, first.run_id, ttl_s=first.ttl_s)
        gate = Gate(cache, lane.round, lane.attempt, lane.lanes) if lane.pulls else None
        ran, steps = 0, 0

        def answer(job: Any) -> None:
            nonlocal ran, steps
            summary = run_gradient(job, state, memory_mb=memory_mb, in_lane=ran)
            pipe = client.pipeline()  # answered and freed at once: a job taken next never sees it running
            pipe.rpush(lane.answers_key, summary.model_dump_json())
            pipe.expire(lane.answers_key, job.ttl_s)
            if gate is not None:
                pipe.hdel(gate.running, job.job)
            pipe.execute()
            ran, steps = ran + 1, steps + summary.steps

        def in_budget() -> bool:
            return time.perf_counter() - start <= lane.budget_s

        for job in lane.jobs:
            if not in_budget() or not _ready(client, [job.batch_key, job.snapshot_key], lane.linger_s):
                break
            answer(job)
        pulling = gate is not None and ran == len(lane.jobs)  # the job it was given ran: on to the next in line
        while pulling and gate is not None and in_budget() and (index := gate.next_job()) is not None:
            job = gate.job(index)
            if not _ready(client, [job.batch_key], lane.linger_s):  # a taken job's snapshot is the one published
                break
            taken = gate.take(job, by=lane.invocation_id)
            if taken == "passed":  # another function took it first: look at the next in line
                continue
            if isinstance(taken, str):
                break
            answer(taken)
        done = ActorSummary.since(lane.invocation_id, start, mem, steps=steps)
    except Exception as exc:  # the function never raises: the caller loses the job it was on, and goes on
        done = ActorSummary.since(lane.invocation_id, start, mem, error=error_line(exc))
    if cache is not None:
        try:  # a resumed run bills the invocation from this
            cache.put_summary(lane.round, lane.invocation_id, done.model_dump_json())
        except Exception:
            pass
    return done


def _ready(client: Any, keys: list[str], linger_s: float) -> bool:
    """Whether every one of ``keys`` (a job's batch, its snapshot) is in the cache within ``linger_s``."""
    deadline = time.perf_counter() + linger_s
    while client.exists(*keys) < len(keys):
        if time.perf_counter() >= deadline:
            return False
        time.sleep(0.01)
    return True
