"""The one wire format shared by every actor backend (local processes and AWS Lambda).

An ``ActorEvent`` is what an invocation carries in; an ``ActorSummary`` is the small JSON that
comes back. The trajectory batch itself never travels in the response: the actor writes it to the
trajectory cache under its invocation id.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nitro.envs import SUPPORTED_ENVS


def invocation_id(run_id: str, round_idx: int, i: int) -> str:
    return f"{run_id}-r{round_idx:05d}-{i:04d}"


class ActorEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    round: int = Field(ge=0)
    invocation_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    weights_key: str = Field(min_length=1)
    env_id: str
    seed: int = Field(ge=0, lt=2**63)
    n_steps: int = Field(ge=1, le=1_000_000)
    cache_url: str = Field(min_length=1, description="redis:// or rediss:// URL without a password")
    cache_credentials: dict[str, str] = Field(
        default_factory=dict,
        description="where to find the password: {'env': VAR} or {'secret_arn': ARN}; never the secret",
    )
    batch_ttl_s: int = Field(86_400, ge=1)

    @field_validator("env_id")
    @classmethod
    def _known_env(cls, v: str) -> str:
        if v not in SUPPORTED_ENVS:
            raise ValueError(f"unknown env id {v!r}; supported: {', '.join(SUPPORTED_ENVS)}")
        return v

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

    @classmethod
    def failed(cls, invocation_id: str, error: str, duration_s: float = 0.0, billed_ms: int = 0, memory_mb: int = 0) -> "ActorSummary":
        line = " ".join(str(error).split())[:500]
        return cls(invocation_id=invocation_id, ok=False, error=line, duration_s=duration_s, billed_ms=billed_ms, memory_mb=memory_mb)
