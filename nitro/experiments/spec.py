"""The experiment spec as a pydantic model (the YAML format: see ``nitro.experiments``)."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nitro.config import ConfigError, ScalerName

SENSITIVITY_KEYS = ("scaler.decay", "scaler.window", "detector.subset_size")
# What a cell's place in the matrix and the spec's `compare` set; a baseline cannot change them.
CELL_KEYS = ("env_id", "algo", "seed", "scaler.name", "budget_usd", "rounds", "tracking.experiment")
BASELINE_NAME = r"^[a-z0-9][a-z0-9_.-]{0,31}$"
SCALER_NAMES: tuple[str, ...] = get_args(ScalerName)


class ExperimentError(ConfigError):
    """An experiment spec is invalid; the message is one line and names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BaselineSpec(_Strict):
    """A named matrix entry: a scaler with the config overrides that make it the baseline (its
    pricing, its instance type, its scheduler file), applied to its cells only."""

    scaler: ScalerName
    overrides: list[str] = Field(default_factory=list, description="dotted key=value, after the spec's overrides")
    description: str = ""
    replays: str | None = Field(None, description="scaler replay: the matrix entry whose actor counts (per round, "
                                "as launched) each cell replays shuffled, from the cell of the same env, algo and seed")

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, v: list[str]) -> list[str]:
        for item in v:
            key = item.partition("=")[0].strip()
            if "=" not in item or not key:
                raise ValueError(f"{item!r} is not key=value")
            if key in CELL_KEYS:
                raise ValueError(f"{key} is set by the matrix or by `compare`, not by a baseline")
        return v


_VM = "backend.pricing=vm"
# The paper's baselines (docs/decisions.md, "Actors on VMs" and "MinionsRL"), by name; a spec's
# own `baselines` entry of the same name replaces one.
BUILTIN_BASELINES: dict[str, BaselineSpec] = {
    "serverful": BaselineSpec(scaler="fixed", overrides=[_VM], description=(
        "serverful PPO / IMPACT (paper §8.2): scaler.fixed_actors every round on EC2 instances billed from "
        "start to stop, idle included")),
    "vm-pause": BaselineSpec(scaler="vm-pause", overrides=[_VM], description=(
        "boosting on VMs (paper §2.3): Nitro's signal, the learner waits while the boost's instances start")),
    "vm-replay": BaselineSpec(scaler="vm-replay", overrides=[_VM], description=(
        "boosting on VMs (paper §2.3): Nitro's signal, the learner replays old batches while instances start")),
    "nitro-vm": BaselineSpec(scaler="nitro", overrides=[_VM, "backend.vm.instance_type=c5.18xlarge",
                                                         "backend.vm.min_instances=1"], description=(
        "Nitro without serverless (paper §8.5): Nitro's scaler on one always-on 72-vCPU VM sized for I_max")),
    "minionsrl": BaselineSpec(scaler="minionsrl", description=(
        "MinionsRL's pre-trained scheduler (paper §8.3) from scaler.minionsrl.path, Lambda-priced actors; "
        "its pre-training cost is reported beside the run's")),
}


class MatrixSpec(_Strict):
    env: list[str] = Field(min_length=1)
    algo: list[Literal["ppo", "impact"]] = Field(["ppo"], min_length=1)  # pydantic copies it per instance
    scaler: list[str] = Field(min_length=1, description="scaler names and baseline names")
    seed: list[int] = Field(min_length=1)

    @field_validator("env", "algo", "scaler", "seed")
    @classmethod
    def _unique(cls, v: list) -> list:
        dup = sorted({str(x) for x in v if v.count(x) > 1})
        if dup:
            raise ValueError(f"duplicate value(s): {', '.join(dup)}")
        return v

    @field_validator("seed")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if any(s < 0 for s in v):
            raise ValueError("seeds must be >= 0")
        return v


class SensitivitySpec(_Strict):
    scaler: str = Field("nitro", description="a scaler or baseline name")
    seeds: list[int] | None = Field(None, min_length=1, description="default: the matrix's seeds")
    sweep: dict[str, list[Any]] = Field(min_length=1)

    @field_validator("sweep")
    @classmethod
    def _keys(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in v.items():
            if key not in SENSITIVITY_KEYS:
                raise ValueError(f"cannot sweep {key!r}; sweepable: {', '.join(SENSITIVITY_KEYS)}")
            if not values:
                raise ValueError(f"{key}: give at least one value")
        return v


class ExperimentSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    description: str = ""
    base: dict[str, Any] = Field(default_factory=dict, description="a NitroConfig mapping")
    overrides: list[str] = Field(default_factory=list, description="dotted key=value, applied after base")
    matrix: MatrixSpec
    compare: Literal["budget", "rounds"]
    budget_usd: float | None = Field(None, gt=0, description="compare=budget: every cell's budget")
    max_rounds: int = Field(1000, ge=1, description="compare=budget: round cap (a safety net)")
    rounds: int | None = Field(None, ge=1, description="compare=rounds: every cell's rounds")
    baselines: dict[str, BaselineSpec] = Field(
        default_factory=dict, description="named scalers with their own overrides (default: BUILTIN_BASELINES)")
    sensitivity: SensitivitySpec | None = None
    reference: str = Field("fixed", description="the matrix entry the report divides every other entry's "
                           "return and spend by (no ratio table when the matrix lacks it)")
    best_of: list[str] = Field(default_factory=list, description="the grid whose best entry per task is the bar: "
                               "the report divides every other entry's scores by that entry's, seed by seed")
    thresholds: dict[str, float] = Field(default_factory=dict, description="per env: the return (whole episodes, "
                                         "mean action) whose first evaluation at or above it times each run on its "
                                         "billed clock; fixed before any cell runs")
    report_dir: str | None = Field(None, description="default: docs/results/<name>")

    @model_validator(mode="after")
    def _compare(self) -> ExperimentSpec:
        if self.compare == "budget":
            if self.budget_usd is None:
                raise ValueError("compare: budget needs budget_usd (the same budget for every cell)")
            if self.rounds is not None:
                raise ValueError("compare: budget takes max_rounds, not rounds")
        else:
            if self.rounds is None:
                raise ValueError("compare: rounds needs rounds (the same number for every cell)")
            if self.budget_usd is not None:
                raise ValueError("compare: rounds takes no budget_usd (cells would stop at different rounds)")
        for key in ("budget_usd", "rounds"):
            if self.base.get(key) is not None:
                raise ValueError(f"base.{key} is set by `compare`; remove it from base")
        if stray := [name for name in self.best_of if name not in self.matrix.scaler]:
            raise ValueError(f"best_of: {', '.join(stray)} not in matrix.scaler")
        if len(set(self.best_of)) != len(self.best_of) or len(self.best_of) == 1:
            raise ValueError("best_of: give two or more distinct matrix entries (the grid), or none")
        if stray := sorted(set(self.thresholds) - set(self.matrix.env)):
            raise ValueError(f"thresholds: {', '.join(stray)} not in matrix.env")
        for name in self.baselines:
            if not re.match(BASELINE_NAME, name):
                raise ValueError(f"baselines: name {name!r} must match {BASELINE_NAME}")
        known = sorted(set(SCALER_NAMES) | set(BUILTIN_BASELINES) | set(self.baselines))
        for where, names in (("matrix.scaler", self.matrix.scaler),
                             ("sensitivity.scaler", [self.sensitivity.scaler] if self.sensitivity else [])):
            for name in names:
                if name not in known:
                    raise ValueError(f"{where}: unknown scaler or baseline {name!r}; known: {', '.join(known)}")
        for name in self.matrix.scaler:
            replays = self.baseline(name).replays
            if (self.baseline(name).scaler == "replay") != (replays is not None):
                raise ValueError(f"baselines.{name}: scaler replay and `replays` go together (replays names the "
                                 "matrix entry whose actor counts it replays)")
            if replays is not None and (replays not in self.matrix.scaler or self.baseline(replays).replays):
                raise ValueError(f"baselines.{name}.replays: {replays!r} must be a matrix entry that replays nothing")
        return self

    def baseline(self, name: str) -> BaselineSpec:
        """What a matrix entry runs: the spec's baseline of that name, else the built-in one, else
        the plain scaler."""
        found = self.baselines.get(name) or BUILTIN_BASELINES.get(name)
        return found if found is not None else BaselineSpec(scaler=name)

    @property
    def seeds_for_sensitivity(self) -> list[int]:
        return list(self.sensitivity.seeds or self.matrix.seed) if self.sensitivity else []

