"""The cells of an experiment: which training runs its spec asks for, in what order, under which
run ids and with which configs."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nitro.config import NitroConfig

if TYPE_CHECKING:
    from nitro.experiments.spec import ExperimentSpec


def slug(text: str, n: int = 40) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", str(text).lower())).strip("-")[:n]


def fmt_value(v: Any) -> str:
    return repr(v) if isinstance(v, str) else (f"{v:g}" if isinstance(v, float) else str(v))


@dataclass(frozen=True)
class Cell:
    """One training run of the matrix. ``variant``: a sensitivity override, e.g. (("scaler.decay", 0.9),)."""

    env: str
    algo: str
    scaler: str  # the matrix entry: a scaler name or a baseline name (ExperimentSpec.baseline)
    seed: int
    variant: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        parts = [self.env, self.algo, self.scaler, f"seed={self.seed}"]
        parts += [f"{k}={fmt_value(v)}" for k, v in self.variant]
        return "/".join(parts)

    @property
    def label(self) -> str:
        """The group a cell's seeds are averaged in: the scaler or baseline, plus the sensitivity value."""
        return " ".join([self.scaler, *(f"{k}={fmt_value(v)}" for k, v in self.variant)])

    @property
    def is_sensitivity(self) -> bool:
        return bool(self.variant)

    def overrides(self) -> list[str]:
        """The cell's place in the matrix (its scaler comes from its baseline: ``cell_config``)."""
        out = [f"env_id={self.env}", f"algo={self.algo}", f"seed={self.seed}"]
        return out + [f"{k}={v}" for k, v in self.variant]


def cell_run_id(experiment: str, cell: Cell) -> str:
    """Deterministic Nitro run id of a cell: readable prefix + a hash of (experiment, cell key).

    The same spec always maps a cell to the same run id, which is what makes an experiment
    resumable (the run's checkpoints and MLflow run are found by it)."""
    digest = hashlib.sha1(json.dumps([experiment, cell.key]).encode()).hexdigest()[:8]
    parts = [slug(experiment, 24), slug(cell.env.split("/")[-1], 16), cell.algo, cell.scaler, f"s{cell.seed}"]
    parts += [f"{slug(k.split('.')[-1], 8)}{slug(fmt_value(v), 8)}" for k, v in cell.variant]
    return "-".join(p for p in parts if p) + f"-{digest}"


def _base_value(spec: ExperimentSpec, key: str) -> Any:
    cfg = NitroConfig.load(copy.deepcopy(spec.base), list(spec.overrides))
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def cell_scaler(spec: ExperimentSpec, cell: Cell) -> str:
    """The scaler a cell runs (``scaler.name``): its baseline's."""
    return spec.baseline(cell.scaler).scaler


def expand_cells(spec: ExperimentSpec, sensitivity: bool = False) -> list[Cell]:
    """The cells in run order: per env, algo, seed, the scalers with ``nitro`` first and the
    cells that read another cell's outcome last (``random`` needs nitro's measured mean actors, a
    ``replay`` the counts of the entry it replays); then, with ``sensitivity``, the sweep's extra
    cells."""
    m = spec.matrix
    # the cells that read another's outcome after it: random after nitro, a replay after what it replays
    order = sorted(m.scaler, key=lambda s: (s != "nitro", spec.baseline(s).scaler in ("random", "replay")))
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


CELL_FIELDS = ("env", "algo", "scaler", "seed")


def select_cells(cells: Sequence[Cell], only: Mapping[str, Sequence[str]]) -> list[Cell]:
    """The cells whose env, algo, scaler and seed are each among ``only``'s values for that field
    (a field ``only`` does not name matches any value), in run order. Raises ExperimentError,
    naming the field, for a field that is not a cell's or a value no cell has."""
    from nitro.experiments.spec import ExperimentError

    for field, values in only.items():
        if field not in CELL_FIELDS:
            raise ExperimentError(f"--only {field}: not a cell field; choose from {', '.join(CELL_FIELDS)}")
        present = {str(getattr(c, field)) for c in cells}
        missing = [v for v in values if str(v) not in present]
        if missing:
            raise ExperimentError(f"--only {field}: {', '.join(map(str, missing))} not in the spec's cells "
                                  f"({', '.join(sorted(present))})")
    return [c for c in cells if all(str(getattr(c, f)) in {str(v) for v in vs} for f, vs in only.items())]


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


def cell_config(spec: ExperimentSpec, cell: Cell, random_mean_actors: float | None = None,
                replay_actors: Sequence[int] | None = None) -> NitroConfig:
    """The cell's full NitroConfig (raises ConfigError): base, the spec's overrides, the cell's
    baseline (its scaler and overrides), its place in the matrix, then what ``compare`` sets, and
    what it reads from its partner cell (``partner_cell``): a random cell nitro's mean actors, a
    replay cell the counts it replays."""
    baseline = spec.baseline(cell.scaler)
    extra = [*spec.overrides, f"scaler.name={baseline.scaler}", *baseline.overrides, *cell.overrides(),
             f"tracking.experiment={spec.name}"]
    if spec.compare == "budget":
        extra += [f"budget_usd={spec.budget_usd!r}", f"rounds={spec.max_rounds}"]
    else:
        extra += ["budget_usd=null", f"rounds={spec.rounds}"]
    if random_mean_actors is not None and baseline.scaler == "random":
        extra.append(f"scaler.random_mean_actors={float(random_mean_actors)!r}")
    if replay_actors is not None and baseline.scaler == "replay":
        extra.append(f"scaler.replay_actors=[{', '.join(str(int(n)) for n in replay_actors)}]")
    # A deep copy: NitroConfig.load applies dotted overrides in place into nested dicts of its input.
    return NitroConfig.load(copy.deepcopy(spec.base), extra)


def nitro_partner(cell: Cell) -> Cell:
    """The nitro cell whose measured mean actors a ``random`` cell matches."""
    return Cell(cell.env, cell.algo, "nitro", cell.seed)


def replay_partner(spec: ExperimentSpec, cell: Cell) -> Cell | None:
    """The cell whose actor counts a ``replay`` cell replays (its baseline's ``replays`` entry, at
    the same env, algo and seed); None for any other cell."""
    replays = spec.baseline(cell.scaler).replays
    return Cell(cell.env, cell.algo, replays, cell.seed) if replays is not None else None
