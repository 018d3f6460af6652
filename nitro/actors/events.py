"""The one wire format shared by every actor backend (local processes and AWS Lambda).

An ``ActorEvent`` is what an invocation carries in; an ``ActorSummary`` is the small JSON that
comes back. The trajectory batch itself never travels in the response: the actor writes it to the
trajectory cache under its invocation id.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nitro.envs import EnvId

_MODE_TAGS = {"train": "", "eval_deterministic": "-evd", "eval_stochastic": "-evs"}


def invocation_id(run_id: str, round_idx: int, i: int, mode: str = "train") -> str:
    """Unique per (run, round, mode, slot); the mode is part of it, so a summary (even a failed
    one, which a backend builds from the id alone) always says what its invocation was for."""
    return f"{run_id}-r{round_idx:05d}{_MODE_TAGS[mode]}-{i:04d}"


def invocation_mode(inv_id: str) -> str:
    """The mode ``invocation_id`` encoded in ``inv_id``."""
    for mode, tag in _MODE_TAGS.items():
        if tag and inv_id.rsplit("-", 1)[0].endswith(tag):
            return mode
    return "train"


# What an invocation does: "train" rolls out n_steps and writes a trajectory batch (continuing the
# episode of ``episode_key`` when set); "eval_*" play ``n_episodes`` whole episodes, with the mean
# action or sampled actions, within n_steps, and write nothing.
ActorMode = Literal["train", "eval_deterministic", "eval_stochastic"]


class ActorEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    round: int = Field(ge=0)
    invocation_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    weights_key: str = Field(min_length=1)
    env_id: EnvId
    seed: int = Field(ge=0, lt=2**63)
    n_steps: int = Field(ge=1, le=1_000_000)
    cache_url: str = Field(min_length=1, description="redis:// or rediss:// URL without a password")
    cache_credentials: dict[str, str] = Field(
        default_factory=dict,
        description="where to find the password: {'env': VAR} or {'secret_arn': ARN}; never the secret",
    )
    batch_ttl_s: int = Field(86_400, ge=1)
    mode: ActorMode = "train"
    episode_key: str | None = Field(None, description="train: the snapshots of the unfinished episodes to continue")
    n_envs: int = Field(1, ge=1, le=256, description="train on Atari: games stepped side by side, n_steps split "
                        "among them (nitro/actors/rollout.py); other envs step one")
    n_episodes: int = Field(1, ge=1, le=1000, description="eval: whole episodes to play")

    @field_validator("cache_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("cache_url must start with redis://, rediss:// or unix://")
        return v


class ActorSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    invocation_id: str
    ok: bool
    error: str | None = None
    steps: int = 0
    episode_returns: list[float] = Field(default_factory=list)
    episode_lengths: list[int] = Field(default_factory=list)
    duration_s: float = 0.0
    billed_ms: int = 0
    batch_key: str | None = None
    batch_bytes: int = 0
    memory_mb: int = 0
    continued: bool = False  # it continued the event's episode (False: the snapshot had expired)
    episode_key: str | None = None  # the snapshot of the episode it left unfinished
    profile: dict[str, float] = Field(default_factory=dict)  # a learner function's seconds by part of its job
    # a learner function's job that ran after another in the same invocation: it paid no invoke latency
    shared_invocation: bool = False

    @classmethod
    def failed(cls, invocation_id: str, error: str, duration_s: float = 0.0, billed_ms: int = 0,
               memory_mb: int = 0) -> ActorSummary:
        line = " ".join(str(error).split())[:500]
        return cls(invocation_id=invocation_id, ok=False, error=line, duration_s=duration_s, billed_ms=billed_ms,
                   memory_mb=memory_mb)

    @classmethod
    def since(cls, invocation_id: str, start: float, memory_mb: int, *, error: str | None = None,
              billed: bool = True, **fields: Any) -> ActorSummary:
        """An invocation's summary for its time since ``start`` (``time.perf_counter()``), failed
        with ``error`` when one is given. ``billed``: the duration is the invocation's bill (False:
        a job inside a learner lane's invocation, which is billed whole)."""
        duration = time.perf_counter() - start
        billed_ms = math.ceil(duration * 1000) if billed else 0
        if error is not None:
            failed = cls.failed(invocation_id, error, duration_s=duration, billed_ms=billed_ms, memory_mb=memory_mb)
            return failed.model_copy(update=fields)
        return cls(invocation_id=invocation_id, ok=True, duration_s=duration, billed_ms=billed_ms,
                   memory_mb=memory_mb, **fields)


UNKNOWN_INVOCATION = "unknown"  # the id of an event that names none


def event_payload(event: ActorEvent | dict[str, Any], memory_mb: int) -> tuple[str, bytes | ActorSummary]:
    """(invocation id, the event as JSON bytes), or the failed summary of an event that is not JSON:
    what a backend sends to its function, whatever the caller handed it."""
    if isinstance(event, BaseModel):  # an ActorEvent or a learner function's GradientJob
        return str(event.invocation_id), event.model_dump_json().encode()
    raw = event.get("invocation_id") if isinstance(event, dict) else None
    inv = raw if isinstance(raw, str) and raw else UNKNOWN_INVOCATION
    try:
        return inv, json.dumps(event).encode()
    except (TypeError, ValueError) as exc:
        return inv, ActorSummary.failed(inv, f"event is not JSON-serialisable: {exc}", memory_mb=memory_mb)
