"""A gradient job and a lane of them: the data-only events a learner function receives, and the
keys it reads and writes.

Every key lives under the round's prefix in the trajectory cache, so it carries the cache's TTL
and is deleted with the round: ``...:snapshot:{attempt}:v{version}`` (a parameter-server version: policy and
critic, safetensors), ``...:gradient:{invocation_id}`` (the function's answer, safetensors) and
``...:answers:{attempt}`` (a list: the summary of each job a lane's invocation ran, pushed as it
ends, which the parameter server reads while the lane goes on), all distinct per attempt at the round.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nitro.actors.events import ActorSummary
from nitro.cache import TrajectoryCache

POLL_S = 0.05  # a job's poll for its batch in the cache (a batch lands from another process, unsignalled)

SNAPSHOT_FORMAT = "nitro.snapshot/1"
GRADIENT_FORMAT = "nitro.gradient/1"


def gradient_job_id(run_id: str, round_idx: int, attempt: str, job: int) -> str:
    """Unique per (run, round, attempt at the round, job); distinct from every actor's invocation
    id. The attempt keeps a dead attempt's gradient (and its summary) from being read by the
    attempt that resumes the round: it was computed against that attempt's snapshots."""
    return f"{run_id}-r{round_idx:05d}-{attempt}-g{job:05d}"


def snapshot_key(cache: TrajectoryCache, round_idx: int, attempt: str, version: int) -> str:
    """A version's snapshot in one attempt at the round: a resumed attempt publishes its own,
    and never reads the versions a dead attempt published (they may differ from its own)."""
    return f"{cache.round_prefix(round_idx)}:snapshot:{attempt}:v{version:07d}"


def lane_invocation_id(run_id: str, round_idx: int, attempt: str, lane: int, part: int) -> str:
    """The ``part``-th invocation of learner function ``lane`` in one attempt at the round: a lane
    whose next job is not ready within the linger returns, and the rest of its jobs start another."""
    return f"{run_id}-r{round_idx:05d}-{attempt}-l{lane:03d}-i{part:05d}"


def pulling_invocation_id(run_id: str, round_idx: int, attempt: str, job: int) -> str:
    """The invocation a measured round's lane starts for ``job`` (the first it runs; it may pull more):
    at most one per job, so a resume knows every invocation that may have started."""
    return f"{run_id}-r{round_idx:05d}-{attempt}-m{job:05d}"


def answers_key(cache: TrajectoryCache, round_idx: int, attempt: str) -> str:
    return f"{cache.round_prefix(round_idx)}:answers:{attempt}"


def gradient_key(cache: TrajectoryCache, round_idx: int, invocation_id: str) -> str:
    return f"{cache.round_prefix(round_idx)}:gradient:{invocation_id}"


class GradientJob(BaseModel):
    """One slice of one actor batch, to differentiate at one snapshot. JSON in, like ``ActorEvent``;
    the same function image and the same worker pool run both (``nitro.run.functions``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["gradient"] = "gradient"
    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    round: int = Field(ge=0)
    invocation_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    job: int = Field(ge=0)
    env_id: str
    snapshot_key: str = Field(min_length=1)
    snapshot_version: int = Field(ge=0)
    behaviour_key: str = Field(min_length=1, description="the policy the batch was acted with")
    live_keys: list[str] = Field(default_factory=list, description="the other live versions' snapshots")
    actor_id: str = Field(min_length=1, description="the invocation whose batch this slice is of")
    batch_key: str = Field(min_length=1)
    seed: int = Field(ge=0, lt=2**63)
    epoch: int = Field(ge=0)
    slice: int = Field(ge=0)
    slice_samples: int = Field(ge=1)
    cache_url: str = Field(min_length=1)
    cache_credentials: dict[str, str] = Field(default_factory=dict)
    ttl_s: int = Field(86_400, ge=1)


class GradientLane(BaseModel):
    """Consecutive jobs of one learner function, run in one invocation: each as soon as its batch
    has landed and its snapshot is published, waiting at most ``linger_s`` for it; the function
    returns at the first job not ready by then, or once ``budget_s`` has passed. Seeded: ``jobs``
    are the lane's jobs still to run, in the schedule's order. Measured (``pulls``): ``jobs`` is the
    one job the lane took for it, and the function then takes each next job in line from the
    round's gate (``nitro.stellaris.arrivals.Gate``, of ``attempt`` over ``lanes``) itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["gradient-lane"] = "gradient-lane"
    invocation_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    round: int = Field(ge=0)
    lane: int = Field(ge=0)
    jobs: list[GradientJob] = Field(min_length=1)
    answers_key: str = Field(min_length=1)
    linger_s: float = Field(ge=0)
    budget_s: float = Field(gt=0, description="no job starts after this many seconds of the invocation")
    pulls: bool = False
    attempt: str = ""
    lanes: int = Field(0, ge=0)


def wait_for_batch(cache: TrajectoryCache, job: GradientJob, deadline: float, wait_s: float) -> str | None:
    """Wait (until ``deadline`` on ``time.perf_counter``) for the job's batch to land; None once it
    has, or one line on why it will not: its actor failed, or ``wait_s`` passed."""
    while not cache.client.exists(job.batch_key):
        if (failed := actor_failed(cache, job)) is not None:
            return failed
        if time.perf_counter() > deadline:
            return f"gradient job not started: its batch was not in the cache within {wait_s:g} s"
        time.sleep(POLL_S)
    return None


def actor_failed(cache: TrajectoryCache, job: GradientJob) -> str | None:
    """One line when the job's actor failed (its batch will never land), else None."""
    raw = cache.client.get(cache.summary_key(job.round, job.actor_id))
    if raw is not None and not ActorSummary.model_validate_json(raw).ok:
        return f"gradient job not started: actor {job.actor_id} failed, its batch will not land"
    return None
