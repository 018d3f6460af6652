"""The configuration of actors on EC2 virtual machines (``backend.pricing: vm``): which instance
type hosts them, what it costs, how long one takes to start, and the known instance types.

One actor runs per vCPU (the paper's serverful set-up: a c5.4xlarge, "each CPU core hosts an actor
process"). Prices are AWS's on-demand Linux prices; each figure's source and date is in
``INSTANCE_TYPES`` and docs/decisions.md ("Actors on VMs").
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class InstanceType(NamedTuple):
    """One EC2 instance type as the fleet prices it."""

    vcpus: int
    per_hour: float  # USD, on-demand Linux
    source: str  # where the price comes from, and when


# On-demand Linux prices in us-east-1 / us-east-2 (equal there for these types). The c5.4xlarge
# price is the paper's (§8.1, footnote 2; US East 2; VLDB 2025, priced in 2024). The others are
# AWS's EC2 on-demand price list as last read for this table (2024; c5 is $0.0425 per vCPU-hour
# across its sizes since its launch); they could not be re-checked here, so check them before
# quoting an invoice. Override ``per_hour`` for another region or a newer price.
INSTANCE_TYPES: dict[str, InstanceType] = {
    "c5.large": InstanceType(2, 0.085, "AWS EC2 on-demand price list, us-east-1, 2024"),
    "c5.xlarge": InstanceType(4, 0.17, "AWS EC2 on-demand price list, us-east-1, 2024"),
    "c5.2xlarge": InstanceType(8, 0.34, "AWS EC2 on-demand price list, us-east-1, 2024"),
    "c5.4xlarge": InstanceType(16, 0.68, "the paper, §8.1 footnote 2 (US East 2, 2024)"),
    "c5.9xlarge": InstanceType(36, 1.53, "AWS EC2 on-demand price list, us-east-1, 2024"),
    "c5.18xlarge": InstanceType(72, 3.06, "AWS EC2 on-demand price list, us-east-1, 2024"),
    "m5.4xlarge": InstanceType(16, 0.768, "AWS EC2 on-demand price list, us-east-1, 2024"),
    "r5.4xlarge": InstanceType(16, 1.008, "AWS EC2 on-demand price list, us-east-1, 2024"),
}


class VmConfig(BaseModel):
    """Actors on EC2 instances: billed per second from start to stop, idle time included, with
    AWS's one-minute minimum per start (docs/decisions.md, "Actors on VMs")."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    instance_type: str = Field(
        "c5.4xlarge", description="an EC2 type of INSTANCE_TYPES (nitro/config/vm.py); the paper's serverful "
        "actors ran on one c5.4xlarge (16 vCPUs, $0.68/h in US East 2, the paper's §8.1, 2024)")
    vcpus: int | None = Field(None, ge=1, description="actors one instance hosts (one per vCPU); default: the type's")
    per_hour: float | None = Field(
        None, ge=0, description="USD per instance-hour; default: the type's on-demand Linux price (us-east, 2024; "
        "c5.4xlarge 0.68, c5.18xlarge 3.06)")
    startup_s: float = Field(
        60.0, ge=0, le=3600, description="from the start request until the instance's actors can run: an "
        "assumption (AWS publishes no figure; the paper's Fig. 5(a) plots it without numbers); simulated on "
        "the clock, never slept")
    min_billed_s: int = Field(60, ge=0, description="AWS's minimum billed seconds per instance start (per-second "
                              "billing after it; EC2 on-demand Linux pricing page, 2024)")
    min_instances: int = Field(
        0, ge=0, description="instances kept running from the first round to the last whatever the actors need: "
        "1 x c5.18xlarge is the paper's 'Nitro without serverless' (§8.5), a VM sized for I_max")
    replay_max_updates: int = Field(
        8, ge=1, description="vm-replay: at most this many updates on replayed batches while new instances start")

    @field_validator("instance_type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v not in INSTANCE_TYPES:
            raise ValueError(f"unknown instance type {v!r}; known: {', '.join(INSTANCE_TYPES)}")
        return v

    @model_validator(mode="after")
    def _fill_from_type(self) -> VmConfig:
        known = INSTANCE_TYPES[self.instance_type]
        if self.vcpus is None:
            object.__setattr__(self, "vcpus", known.vcpus)
        if self.per_hour is None:
            object.__setattr__(self, "per_hour", known.per_hour)
        return self

    @property
    def price_source(self) -> str:
        """Where ``per_hour`` comes from."""
        known = INSTANCE_TYPES[self.instance_type]
        return known.source if self.per_hour == known.per_hour else "configured"
