"""The experiment spec as a pydantic model (the YAML format: see ``nitro.experiments``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nitro.config import ConfigError, ScalerName

SENSITIVITY_KEYS = ("scaler.decay", "scaler.window", "detector.subset_size")


class ExperimentError(ConfigError):
    """An experiment spec is invalid; the message is one line and names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MatrixSpec(_Strict):
    env: list[str] = Field(min_length=1)
    algo: list[Literal["ppo", "impact"]] = Field(default_factory=lambda: ["ppo"], min_length=1)
    scaler: list[ScalerName] = Field(min_length=1)
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
    scaler: ScalerName = "nitro"
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
    sensitivity: SensitivitySpec | None = None
    report_dir: str | None = Field(None, description="default: docs/results/<name>")

    @model_validator(mode="after")
    def _compare(self) -> "ExperimentSpec":
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
        return self

    @property
    def seeds_for_sensitivity(self) -> list[int]:
        return list(self.sensitivity.seeds or self.matrix.seed) if self.sensitivity else []

