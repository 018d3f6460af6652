"""Where a run's actors run: the ``backend`` section of the config (local processes, AWS Lambda or a
Ray cluster), and ``Section``, the base of every config section. ``nitro.config`` re-exports these
classes; they live here so that each module of the config stays one screenful of concerns.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nitro.config.vm import VmConfig


class Section(BaseModel):
    """A config section: unknown keys are errors, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LambdaConfig(Section):
    function_name: str = "nitro-actor"
    qualifier: str | None = None
    region: str = "us-east-1"
    endpoint_url: str | None = None
    concurrency: int = Field(64, ge=1, description="invocations in flight at once")
    architecture: Literal["x86_64", "arm64"] = "x86_64"
    function_timeout_s: int = Field(300, ge=1, le=900)
    provisioned_concurrency: int = Field(0, ge=0)
    max_throttle_retries: int = Field(8, ge=0)
    invoker: Literal["aiohttp", "boto3"] = Field(
        "aiohttp", description="aiohttp: one event loop, SigV4-signed requests (a flat fan-out); "
        "boto3: the SDK's invoke in a thread pool (the fallback)")
    actor_cache_url: str | None = Field(
        None, description="Redis URL the functions use, as the actor ACL user (rediss://nitro-actor@host:6379/0?...); "
        "no password inside. None: the learner's URL")
    redis_secret_arn: str | None = Field(
        None, description="Secrets Manager secret holding the actor user's password; sent to the functions as "
        "cache_credentials={'secret_arn': ...}. None: cache_credentials as for local actors")


# What the engine asks Ray to run: rollouts now; the learner's functions share the entry point later.
JobKind = Literal["actor", "learner"]


class RayConfig(Section):
    """A Ray cluster as the actor backend (nitro/actors/ray_.py, docs/ray.md). Actors are priced as
    if they ran on Lambda, from their measured duration and ``backend.memory_mb``, as local actors are."""

    address: str | None = Field(
        None, description="None: a local Ray started and stopped with the run (backend.workers CPUs); "
        "'auto' or 'host:port': join that cluster (needs an external redis.url the nodes can reach)")
    cpus_per_job: float = Field(1.0, gt=0, description="CPUs Ray reserves for one invocation")
    gpus_per_job: dict[JobKind, float] = Field(
        default_factory=dict, description="GPUs Ray reserves per job kind, e.g. {actor: 0.5}; absent: none")
    object_store_mb: int = Field(
        256, ge=80, description="object store of a local Ray: events and summaries are a few kB and batches "
        "go through Redis, so it stays small (a joined cluster keeps its own setting)")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("an empty address: leave it out for a local Ray, or give 'auto' or host:port")
        return v


class BackendConfig(Section):
    kind: Literal["local", "lambda", "ray"] = "local"
    workers: int | None = Field(None, ge=1, description="local worker processes, or the CPUs of a local Ray "
                                "(default: CPU count)")
    timeout_s: float = Field(120.0, gt=0, description="one invocation's deadline (also bounds its cost)")
    memory_mb: int = Field(1024, ge=128, le=10240, description="actor memory, billed as Lambda")
    pricing: Literal["lambda", "vm"] = Field(
        "lambda", description="how actors are billed, whichever backend runs them: lambda (GB-s and requests) "
        "or vm (EC2 instances from start to stop, `vm`); docs/decisions.md, \"Actors on VMs\"")
    lambda_: LambdaConfig = Field(default_factory=LambdaConfig, alias="lambda")
    ray: RayConfig = Field(default_factory=RayConfig)
    vm: VmConfig = Field(default_factory=VmConfig)

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)
