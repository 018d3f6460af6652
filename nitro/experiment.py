"""Experiments: a matrix of env × algo × scaler × seed, each cell one training run, and a report.

Plain Python, no Prefect: the spec model, the matrix expansion, deterministic cell ids, the
resume test of a cell, and the report. ``flows/experiment.py`` orchestrates.

The spec (YAML)
---------------
::

    name: hopper-study               # MLflow experiment name; cell run ids derive from it
    base: {env_id: Hopper-v5, steps_per_actor: 256, ...}   # any NitroConfig mapping
    overrides: ["ppo.lr=5e-5"]       # optional dotted overrides, applied after ``base``
    matrix: {env: [Hopper-v5], algo: [ppo], scaler: [nitro, fixed, always, random], seed: [0, 1, 2]}
    compare: budget                  # budget: every cell gets budget_usd (rounds: max_rounds cap)
    budget_usd: 0.05                 # rounds: every cell runs `rounds` rounds, no budget
    max_rounds: 200
    sensitivity:                     # optional; run with --sensitivity (paper §8.4)
      scaler: nitro
      seeds: [0, 1, 2]               # default: the matrix's seeds
      sweep: {scaler.decay: [0.9, 0.99], scaler.window: [3, 12], detector.subset_size: [256, 4096]}

Every cell's config is ``base`` + ``overrides`` + the cell's env/algo/scaler/seed (+ its
sensitivity value), with ``tracking.experiment`` forced to ``name`` (so ``nitro compare
--experiment <name>`` lists the cells) and ``budget_usd``/``rounds`` set by ``compare``.

Ablations (paper §8.5): ``fixed`` is Nitro without boosting (``scaler.fixed_actors`` every round);
``random`` boosts at random rounds. ``random`` must match Nitro's *expected spend*: it boosts to
I_max with probability p, else I_min, with p chosen so that its mean actors per round equals
Nitro's (``ScalerConfig.random_mean_actors``). The experiment therefore orders the nitro cell of
each (env, algo, seed) before its random cell and passes the nitro cell's **measured** mean
actors per round (over the rounds that launched actors, read from its checkpoint) to the random
cell. With no nitro cell for that (env, algo, seed) the random cell keeps the base config's
``scaler.random_mean_actors`` or ``random_boost_prob``; the report says which was used.

Sensitivity (``--sensitivity``): one parameter at a time, the others at the base value, for the
``sensitivity.scaler`` cells (default nitro) over ``sensitivity.seeds``. A swept value equal to
the base value is the main matrix's cell itself, not a second run.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nitro.config import ConfigError, NitroConfig, ScalerName, validation_message

__all__ = [
    "ExperimentError",
    "ExperimentSpec",
    "MatrixSpec",
    "SensitivitySpec",
    "Cell",
    "load_spec",
    "expand_cells",
    "cell_run_id",
    "cell_config",
    "cell_state",
    "mean_actors_per_round",
    "experiment_rows",
    "summarize",
    "format_summary",
    "build_report",
    "machine_info",
]

SENSITIVITY_KEYS = ("scaler.decay", "scaler.window", "detector.subset_size")
REPORT_METRICS = ("return_mean", "return_max", "actors_launched", "env_steps_total", "spend_round_usd",
                  "spend_total_usd", "boost_score", "hessian_R", "round_s")
DONE_MARKER = "experiment-cell-done.json"


class ExperimentError(ConfigError):
    """An experiment spec is invalid; the message is one line and names the field."""


# -- the spec ----------------------------------------------------------------------------------


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


def load_spec(source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()) -> ExperimentSpec:
    """Validate a spec from a YAML path or a mapping; raise ExperimentError (one line).

    ``overrides`` are extra dotted config overrides appended to the spec's (e.g. ``home=/tmp/x``).
    Every cell's config is built once here, so a bad base config fails before anything runs."""
    if isinstance(source, Mapping):
        data = dict(source)
        where = "spec"
    else:
        path = Path(source)
        where = str(path)
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ExperimentError(f"experiment spec not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ExperimentError(f"experiment spec {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ExperimentError(f"experiment spec {path} must hold a mapping at the top level")
    if overrides:
        data = {**data, "overrides": list(data.get("overrides") or []) + list(overrides)}
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise ExperimentError(validation_message(exc, "experiment spec")) from None
    try:
        for cell in expand_cells(spec, sensitivity=True):
            cell_config(spec, cell)
    except ConfigError as exc:
        raise ExperimentError(f"{where}: {exc}") from None
    return spec


# -- cells ---------------------------------------------------------------------------------------


def _slug(text: str, n: int = 40) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", str(text).lower())).strip("-")[:n]


def _fmt_value(v: Any) -> str:
    return repr(v) if isinstance(v, str) else (f"{v:g}" if isinstance(v, float) else str(v))


@dataclass(frozen=True)
class Cell:
    """One training run of the matrix. ``variant``: a sensitivity override, e.g. (("scaler.decay", 0.9),)."""

    env: str
    algo: str
    scaler: str
    seed: int
    variant: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        parts = [self.env, self.algo, self.scaler, f"seed={self.seed}"]
        parts += [f"{k}={_fmt_value(v)}" for k, v in self.variant]
        return "/".join(parts)

    @property
    def label(self) -> str:
        """The group a cell's seeds are averaged in: the scaler, plus the sensitivity value."""
        return " ".join([self.scaler, *(f"{k}={_fmt_value(v)}" for k, v in self.variant)])

    @property
    def is_sensitivity(self) -> bool:
        return bool(self.variant)

    def overrides(self) -> list[str]:
        out = [f"env_id={self.env}", f"algo={self.algo}", f"scaler.name={self.scaler}", f"seed={self.seed}"]
        return out + [f"{k}={v}" for k, v in self.variant]


def cell_run_id(experiment: str, cell: Cell) -> str:
    """Deterministic Nitro run id of a cell: readable prefix + a hash of (experiment, cell key).

    The same spec always maps a cell to the same run id, which is what makes an experiment
    resumable (the run's checkpoints and MLflow run are found by it)."""
    digest = hashlib.sha1(json.dumps([experiment, cell.key]).encode()).hexdigest()[:8]
    parts = [_slug(experiment, 24), _slug(cell.env.split("/")[-1], 16), cell.algo, cell.scaler, f"s{cell.seed}"]
    parts += [f"{_slug(k.split('.')[-1], 8)}{_slug(_fmt_value(v), 8)}" for k, v in cell.variant]
    return "-".join(p for p in parts if p) + f"-{digest}"


def _base_value(spec: ExperimentSpec, key: str) -> Any:
    cfg = NitroConfig.load(copy.deepcopy(spec.base), list(spec.overrides))
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def expand_cells(spec: ExperimentSpec, sensitivity: bool = False) -> list[Cell]:
    """The cells in run order: per env, algo, seed, the scalers with ``nitro`` first (``random``
    needs its measured mean actors); then, with ``sensitivity``, the sweep's extra cells."""
    m = spec.matrix
    order = sorted(m.scaler, key=lambda s: (s != "nitro", s == "random"))  # stable otherwise
    cells = [Cell(env, algo, scaler, seed) for env in m.env for algo in m.algo for seed in m.seed for scaler in order]
    if sensitivity and spec.sensitivity is not None:
        seen = {c.key for c in cells}
        sens = spec.sensitivity
        for env in m.env:
            for algo in m.algo:
                for key, values in sens.sweep.items():
                    base_value = _base_value(spec, key)
                    for value in values:
                        for seed in spec.seeds_for_sensitivity:
                            variant = () if value == base_value else ((key, value),)
                            cell = Cell(env, algo, sens.scaler, seed, variant)
                            if cell.key not in seen:
                                seen.add(cell.key)
                                cells.append(cell)
    return cells


def sensitivity_cells(spec: ExperimentSpec, cells: Sequence[Cell]) -> dict[str, dict[Any, list[Cell]]]:
    """{swept key: {value: [cells over seeds]}}; the base value maps to the main matrix's cells."""
    out: dict[str, dict[Any, list[Cell]]] = {}
    if spec.sensitivity is None:
        return out
    by_key = {c.key: c for c in cells}
    sens = spec.sensitivity
    for key, values in sens.sweep.items():
        base_value = _base_value(spec, key)
        per_value: dict[Any, list[Cell]] = {}
        for value in sorted(set(values) | {base_value}):
            per_value[value] = []
            for env in spec.matrix.env:
                for algo in spec.matrix.algo:
                    for seed in spec.seeds_for_sensitivity:
                        variant = () if value == base_value else ((key, value),)
                        c = by_key.get(Cell(env, algo, sens.scaler, seed, variant).key)
                        if c is not None:
                            per_value[value].append(c)
        out[key] = per_value
    return out


def cell_config(spec: ExperimentSpec, cell: Cell, random_mean_actors: float | None = None) -> NitroConfig:
    """The cell's full NitroConfig (raises ConfigError)."""
    extra = list(spec.overrides) + cell.overrides() + [f"tracking.experiment={spec.name}"]
    if spec.compare == "budget":
        extra += [f"budget_usd={spec.budget_usd!r}", f"rounds={spec.max_rounds}"]
    else:
        extra += ["budget_usd=null", f"rounds={spec.rounds}"]
    if random_mean_actors is not None and cell.scaler == "random":
        extra.append(f"scaler.random_mean_actors={float(random_mean_actors)!r}")
    # A deep copy: NitroConfig.load applies dotted overrides in place into nested dicts of its input.
    return NitroConfig.load(copy.deepcopy(spec.base), extra)


def nitro_partner(cell: Cell) -> Cell:
    """The nitro cell whose measured mean actors a ``random`` cell matches."""
    return Cell(cell.env, cell.algo, "nitro", cell.seed)


# -- state of a cell (resume) --------------------------------------------------------------------


def _checkpoint_state(config: NitroConfig, run_id: str) -> dict[str, Any] | None:
    from nitro.checkpoint import CheckpointError, latest_round, load_checkpoint

    if latest_round(config.home, run_id) is None:
        return None
    try:
        return load_checkpoint(config.home, run_id)[1]
    except CheckpointError:
        return None


def _history_stop(config: NitroConfig, state: Mapping[str, Any]) -> str | None:
    """The stop the engine would have reported after the checkpointed round, from data only
    (mirrors ``Trainer.stop_reason``; a budget stop is a round whose capped decision was 0 actors)."""
    history = state.get("history") or []
    if int(state.get("next_round", 0)) >= config.rounds:
        return "round_limit"
    if not history:
        return None
    last = history[-1]
    ret = last.get("return_mean", math.nan)
    if config.target_reward is not None and ret is not None and not math.isnan(ret) and ret >= config.target_reward:
        return "target_reward"
    if config.budget_usd is not None and float(last.get("actors_launched", 1)) == 0:
        return "budget_spent"
    return None


def cell_state(config: NitroConfig, run_id: str) -> tuple[str, int]:
    """("new" | "partial" | "done", rounds done) from the cell's checkpoints (and done marker)."""
    from nitro.checkpoint import run_dir

    state = _checkpoint_state(config, run_id)
    rounds = int(state["next_round"]) if state else 0
    if (run_dir(config.home, run_id) / DONE_MARKER).exists():
        return "done", rounds
    if state is None:
        return "new", 0
    return ("done" if _history_stop(config, state) else "partial"), rounds


def mark_done(config: NitroConfig, run_id: str, result: Mapping[str, Any]) -> None:
    from nitro.checkpoint import run_dir

    path = run_dir(config.home, run_id) / DONE_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(result), indent=2, default=str))


def mean_actors_per_round(config: NitroConfig, run_id: str) -> float | None:
    """Mean actors launched per round over the rounds that launched any (the budget-stop round
    launches none and is left out), from the run's latest checkpoint; None if there is none."""
    state = _checkpoint_state(config, run_id)
    if not state:
        return None
    counts = [float(r.get("actors_launched", 0)) for r in state.get("history") or []]
    counts = [c for c in counts if c > 0]
    return sum(counts) / len(counts) if counts else None


def saved_config_mismatch(config: NitroConfig, run_id: str) -> str | None:
    """A one-line reason when the cell's run directory holds a different config (the spec was
    edited after the cell started), else None."""
    from nitro.checkpoint import run_dir

    path = run_dir(config.home, run_id) / "config.yaml"
    if not path.exists():
        return None
    old = yaml.safe_load(path.read_text()) or {}
    new = config.model_dump(mode="json", by_alias=True)
    diff = sorted(k for k in set(_flat(old)) | set(_flat(new)) if _flat(old).get(k) != _flat(new).get(k))
    if not diff:
        return None
    return (f"cell run {run_id} was started with a different config ({', '.join(diff[:4])}"
            f"{' ...' if len(diff) > 4 else ''}); rename the experiment or delete {path.parent}")


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


# -- numbers: the same rows as `nitro compare` ---------------------------------------------------


def experiment_rows(tracking_uri: str, spec: ExperimentSpec, cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """``compare_runs(tracking_uri, spec.name)`` rows (exactly what ``nitro compare --experiment
    <name>`` prints), restricted to this spec's cells, each with its cell's ``cell``, ``label``
    and ``variant`` added. Sorted as compare sorts them."""
    from nitro.compare import compare_runs

    by_run = {cell_run_id(spec.name, c): c for c in cells}
    rows = []
    for row in compare_runs(tracking_uri, spec.name):
        cell = by_run.get(row.get("nitro_run_id"))
        if cell is None:
            continue
        row = {**row, "cell": cell.key, "label": cell.label, "variant": dict(cell.variant)}
        rows.append(row)
    return rows


def _finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("env", "env"),
    ("algo", "algo"),
    ("label", "scaler"),
    ("n", "seeds"),
    ("final_return", "final return (mean ± 95% CI)"),
    ("total_spend_usd", "total spend USD (mean ± 95% CI)"),
    ("rounds_done", "rounds (mean)"),
    ("env_steps_total", "env steps (mean)"),
)


def summarize(rows: Sequence[Mapping[str, Any]], labels: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Per (env, algo, label): mean ± 95% CI over seeds of the compare rows' ``final_return`` and
    ``total_spend_usd``, and the means of ``rounds_done`` and ``env_steps_total``."""
    from nitro.plots import mean_ci95

    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["env"]), str(r["algo"]), str(r["label"])), []).append(r)
    order = {lab: i for i, lab in enumerate(labels or [])}
    out = []
    for (env, algo, label), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 1 << 30), kv[0][2])):
        fr = [float(r["final_return"]) for r in rs if _finite(r.get("final_return"))]
        sp = [float(r["total_spend_usd"]) for r in rs if _finite(r.get("total_spend_usd"))]
        rd = [float(r["rounds_done"]) for r in rs if _finite(r.get("rounds_done"))]
        st = [float(r["env_steps_total"]) for r in rs if _finite(r.get("env_steps_total"))]
        out.append({
            "env": env, "algo": algo, "label": label, "n": len(rs),
            "final_return_mean": mean_ci95(fr)[0], "final_return_ci95": mean_ci95(fr)[1],
            "total_spend_usd_mean": mean_ci95(sp)[0], "total_spend_usd_ci95": mean_ci95(sp)[1],
            "rounds_done_mean": sum(rd) / len(rd) if rd else math.nan,
            "env_steps_total_mean": sum(st) / len(st) if st else math.nan,
            "final_return_values": fr, "total_spend_usd_values": sp,
        })
    return out


def _pm(mean: float, half: float, fmt: str) -> str:
    if not _finite(mean):
        return "-"
    return f"{mean:{fmt}} ± {half:{fmt}}" if _finite(half) else f"{mean:{fmt}} (n=1)"


def format_summary(summary: Sequence[Mapping[str, Any]], *, markdown: bool = True) -> str:
    headers = [h for _, h in SUMMARY_COLUMNS]
    cells = [[
        s["env"], s["algo"], s["label"], str(s["n"]),
        _pm(s["final_return_mean"], s["final_return_ci95"], ".2f"),
        _pm(s["total_spend_usd_mean"], s["total_spend_usd_ci95"], ".4f"),
        f"{s['rounds_done_mean']:.1f}" if _finite(s["rounds_done_mean"]) else "-",
        f"{s['env_steps_total_mean']:.0f}" if _finite(s["env_steps_total_mean"]) else "-",
    ] for s in summary]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(c) for c in cells)])


# -- machine and versions --------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for pkg in ("nitro", "torch", "numpy", "gymnasium", "mujoco", "prefect", "mlflow", "pydantic", "redis",
                "matplotlib", "safetensors"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": mem_gib,
        "git_commit": commit,
        "packages": versions,
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# -- the report ----------------------------------------------------------------------------------


@dataclass
class Report:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    markdown: str = ""


def _write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return path


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def build_report(
    spec: ExperimentSpec,
    cells: Sequence[Cell],
    tracking_uri: str,
    out_dir: str | os.PathLike,
    *,
    parent_run_id: str | None = None,
    notes: Mapping[str, str] | None = None,
) -> Report:
    """Plots, Markdown summary (README.md), CSV/JSON raw numbers and machine info in ``out_dir``.

    Everything comes from MLflow: the per-run table is ``nitro compare``'s rows (same code, same
    formatting), the summary aggregates those rows, the curves are the runs' metric histories.
    ``notes``: per cell key, a remark (e.g. where a random cell's mean actors came from)."""
    from mlflow.tracking import MlflowClient

    from nitro import plots
    from nitro.compare import format_table

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    rows = experiment_rows(tracking_uri, spec, cells)
    report.rows = rows
    client = MlflowClient(tracking_uri=tracking_uri)
    histories: dict[str, list[dict[str, float]]] = {}
    for r in rows:
        per_step: dict[int, dict[str, float]] = {}
        for key in REPORT_METRICS:
            for m in client.get_metric_history(r["mlflow_run_id"], key):
                per_step.setdefault(int(m.step), {"round": int(m.step)})[key] = m.value
        histories[r["mlflow_run_id"]] = [per_step[k] for k in sorted(per_step)]

    main_labels = list(dict.fromkeys(c.label for c in cells if not c.is_sensitivity))
    main_rows = [r for r in rows if not r["variant"]]
    report.summary = summarize(main_rows, main_labels)

    md: list[str] = [f"# Experiment `{spec.name}`", ""]
    if spec.description:
        md += [spec.description.strip(), ""]
    common = (f"the same budget, ${spec.budget_usd:g} per cell (round cap {spec.max_rounds})"
              if spec.compare == "budget" else f"the same number of rounds, {spec.rounds} per cell")
    md += [
        f"Matrix: env {', '.join(spec.matrix.env)} × algo {', '.join(spec.matrix.algo)} × scaler "
        f"{', '.join(spec.matrix.scaler)} × seeds {', '.join(map(str, spec.matrix.seed))}; compared under {common}.",
        f"Cells finished: {sum(r['status'] == 'FINISHED' for r in rows)} of {len(cells)}"
        + (f"; MLflow parent run `{parent_run_id}`" if parent_run_id else "") + ".",
        "",
        "Final return: the mean episodic return of the run's last round with finished episodes "
        "(`nitro compare`'s `final return`); total spend: the ledger's cumulative spend. Both as "
        "mean ± 95% t-interval over seeds.",
        "",
    ]
    if spec.compare == "budget":
        md += ["A cell stops when the budget cap finds no room for another round. The cap reserves "
               "upper bounds: twice the last round's learner time and each actor's timeout-bounded cost, so "
               "cells with long (boosted) rounds leave more of the budget unspent; read the total spend "
               "column next to the return.", ""]
    def add(path: Path) -> str:
        report.files.append(path)
        return path.name

    for env in spec.matrix.env:
        for algo in spec.matrix.algo:
            stem = f"{_slug(env.split('/')[-1])}-{algo}"
            groups: dict[str, list[list[dict[str, float]]]] = {}
            for lab in main_labels:
                runs = [histories[r["mlflow_run_id"]] for r in main_rows
                        if r["env"] == env and r["algo"] == algo and r["label"] == lab]
                if runs:
                    groups[lab] = runs
            md += [f"## {env} · {algo}", ""]
            if not groups:
                md += ["No finished runs yet.", ""]
                continue
            title = f"{env} {algo}"
            figs = [
                plots.plot_group_curves(groups, out / f"{stem}-return-vs-round.png", x_key="round", y_key="return_mean",
                                        title=f"{title}: return vs round (mean ± 95% CI)", ylabel="mean episodic return"),
                plots.plot_group_curves(groups, out / f"{stem}-return-vs-spend.png", x_key="spend_total_usd",
                                        y_key="return_mean", title=f"{title}: return vs cumulative spend",
                                        xlabel="cumulative spend (USD)", ylabel="mean episodic return"),
                plots.plot_group_curves(groups, out / f"{stem}-actors-per-round.png", x_key="round",
                                        y_key="actors_launched", title=f"{title}: actors per round",
                                        ylabel="actors launched"),
            ]
            summ = [s for s in report.summary if s["env"] == env and s["algo"] == algo]
            figs.append(plots.plot_group_bars({s["label"]: s["final_return_values"] for s in summ},
                                              out / f"{stem}-final-return.png", title=f"{title}: final return",
                                              ylabel="final mean episodic return"))
            figs.append(plots.plot_group_bars({s["label"]: s["total_spend_usd_values"] for s in summ},
                                              out / f"{stem}-total-spend.png", title=f"{title}: total spend",
                                              ylabel="USD"))
            md += [format_summary(summ), ""]
            md += [f"![{p.stem}]({add(p)})" for p in figs] + [""]

    sens = sensitivity_cells(spec, cells)
    sens_rows = [r for r in rows if r["variant"]] or []
    if sens and sens_rows:
        md += ["## Sensitivity (paper §8.4)", "",
               f"Scaler `{spec.sensitivity.scaler}`, one parameter at a time, others at the base value; "
               "the base value is the main matrix's cells.", ""]
        by_cell = {r["cell"]: r for r in rows}
        sens_summary = []
        for key, per_value in sens.items():
            for env in spec.matrix.env:
                for algo in spec.matrix.algo:
                    values = {}
                    for value, cs in per_value.items():
                        rs = [by_cell[c.key] for c in cs if c.key in by_cell and c.env == env and c.algo == algo]
                        fr = [float(r["final_return"]) for r in rs if _finite(r.get("final_return"))]
                        if rs:
                            values[f"{key}={_fmt_value(value)}"] = fr
                            s = summarize([{**r, "label": f"{key}={_fmt_value(value)}"} for r in rs])[0]
                            sens_summary.append({**s, "param": key, "value": value})
                    if values:
                        p = plots.plot_group_bars(values, out / f"{_slug(env.split('/')[-1])}-{algo}-sensitivity-{_slug(key)}.png",
                                                  title=f"{env} {algo}: final return vs {key}", ylabel="final mean episodic return")
                        md += [f"![{p.stem}]({add(p)})"]
        md += ["", format_summary(sens_summary), ""]
        report.summary += [{**s, "sensitivity": True} for s in sens_summary]

    md += ["## Runs (`nitro compare --experiment " + spec.name + "`)", "",
           format_table(rows, markdown=True), ""]
    if notes:
        md += ["## Notes", ""] + [f"- `{k}`: {v}" for k, v in notes.items()] + [""]
    info = machine_info()
    md += ["## Machine and versions", "",
           f"- {info['platform']}, Python {info['python']}, {info['cpu']} ({info['cpu_count']} CPUs"
           f"{', ' + str(info['affinity_cpus']) + ' usable' if info.get('affinity_cpus') else ''}), "
           f"{info['memory_gib']} GiB RAM; git {info['git_commit']}",
           "- " + ", ".join(f"{k} {v}" for k, v in info["packages"].items()),
           f"- generated {info['generated_at']}", ""]

    run_cols = ["run_name", "nitro_run_id", "mlflow_run_id", "cell", "label", "env", "algo", "scaler", "seed",
                "rounds_done", "final_return", "total_spend_usd", "env_steps_total", "status"]
    add(_write_csv(out / "runs.csv", rows, run_cols))
    round_rows = [{"run_name": r["run_name"], "label": r["label"], "env": r["env"], "algo": r["algo"], "seed": r["seed"],
                   **h} for r in rows for h in histories[r["mlflow_run_id"]]]
    add(_write_csv(out / "rounds.csv", round_rows, ["run_name", "label", "env", "algo", "seed", "round", *REPORT_METRICS]))
    summary_cols = ["env", "algo", "label", "n", "final_return_mean", "final_return_ci95", "total_spend_usd_mean",
                    "total_spend_usd_ci95", "rounds_done_mean", "env_steps_total_mean"]
    add(_write_csv(out / "summary.csv", report.summary, summary_cols))
    results = {
        "experiment": spec.name, "spec": spec.model_dump(mode="json"), "parent_run_id": parent_run_id,
        "tracking_uri": tracking_uri, "machine": info, "summary": report.summary, "runs": rows,
        "rounds": {r["run_name"]: histories[r["mlflow_run_id"]] for r in rows}, "notes": dict(notes or {}),
    }
    results_path = out / "results.json"
    results_path.write_text(json.dumps(_json_safe(results), indent=1, default=str))
    add(results_path)
    report.markdown = "\n".join(md)
    add_path = out / "README.md"
    add_path.write_text(report.markdown + "\n")
    add(add_path)
    return report


def iter_report_files(report: Report) -> Iterable[Path]:
    return iter(report.files)


# -- command line (`nitro experiment`) -------------------------------------------------------------


def cmd_experiment(args) -> int:
    """``nitro experiment SPEC [--sensitivity] [--report-dir DIR] [--fail-fast] [key=value ...]``.

    Validates the spec before Prefect starts, runs the ``nitro-experiment`` flow in this process
    and prints the summary table. Exit 0: all cells finished; 1: some cells failed (re-run the same
    command to resume them); 2: invalid spec (raised as ExperimentError, a ConfigError)."""
    import asyncio

    load_spec(args.spec, args.overrides)  # fail fast, before Prefect starts
    from flows.experiment import ExperimentFailed, experiment

    try:
        result = asyncio.run(experiment(spec_path=str(args.spec), sensitivity=args.sensitivity,
                                        overrides=list(args.overrides), report_dir=args.report_dir,
                                        fail_fast=args.fail_fast))
    except ExperimentFailed as exc:
        print(f"nitro: experiment incomplete: {exc}", file=sys.stderr)
        return 1
    summary = json.loads((Path(result["report_dir"]) / "results.json").read_text())["summary"]
    print(format_summary([s for s in summary if not s.get("sensitivity")], markdown=False))
    print(f"report: {result['report_dir']}/README.md   MLflow parent run: {result['parent_run_id']}")
    return 0
