"""Cells an experiment's report already holds from another machine.

A study that outlives one machine (its MLflow store and checkpoints stay behind) goes on from its
report: ``results.json`` keeps every finished cell's row, its config and the machine it ran on,
and the rounds file (``rounds.py``) its per-round history. A cell finished there is carried into
the next report as it was, and the runner does not train it again. Only a finished cell with the
same run id and the same training config (fields added to the config since at their defaults) is
carried; anything else runs here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nitro.config import ConfigError, NitroConfig
from nitro.experiments.cells import Cell, cell_config, cell_run_id, replay_partner
from nitro.experiments.rounds import read_rounds
from nitro.experiments.spec import ExperimentSpec
from nitro.experiments.state import actors_launched, actors_per_round, cell_state

# Where a run keeps its files and its metrics, not what it trains: a cell carried from another
# machine may differ in these.
PLACE_FIELDS = ("home", "tracking", "redis")
# What a cell reads from its partner cell's outcome (cells.cell_config): the partner is checked
# on its own, and the spec alone cannot say these.
PARTNER_FIELDS = ("random_mean_actors", "replay_actors")


@dataclass(frozen=True)
class CarriedRun:
    row: dict[str, Any]  # the report's runs row, with its ``machine``
    history: list[dict[str, float]]  # the report's per-round metrics of the run
    note: str | None = None  # the report's note on the cell, e.g. where a random cell's mean actors came from


def training_config(config: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k not in PLACE_FIELDS}
    if isinstance(out.get("scaler"), Mapping):
        out["scaler"] = {k: v for k, v in out["scaler"].items() if k not in PARTNER_FIELDS}
    return out


def with_defaults(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A config as a report saved it, with the fields added to the config since at their defaults:
    a field the cell's code did not have did not change what it trained. (A changed default is not
    filled in: the saved config names the old value, and the cell runs again.) A config that no
    longer validates is returned as saved, and matches nothing."""
    try:
        return NitroConfig.load(dict(saved)).model_dump(mode="json")
    except ConfigError:
        return dict(saved)


def carried_runs(out_dir: str | Path, spec: ExperimentSpec, cells: Sequence[Cell]) -> dict[str, CarriedRun]:
    """Per cell key, the finished runs that the report in ``out_dir`` holds for this spec's cells:
    their rows and configs from ``results.json``, their rounds from the rounds file."""
    path = Path(out_dir) / "results.json"
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable report ({exc}); move it away to start the report afresh") from exc
    if old.get("experiment") != spec.name:
        return {}
    by_key = {c.key: c for c in cells}
    configs = old.get("configs") or {}
    report_machine = (old.get("machine") or {}).get("cpu")
    try:
        rounds = read_rounds(out_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: its rounds are not readable ({exc}); "
                         "move the report away to start it afresh") from exc
    carried: dict[str, CarriedRun] = {}
    for row in old.get("runs") or []:
        cell = by_key.get(row.get("cell"))
        if cell is None or row.get("status") != "FINISHED" or row.get("nitro_run_id") != cell_run_id(spec.name, cell):
            continue
        saved = configs.get(cell.key)
        if saved is None or training_config(with_defaults(saved)) != training_config(
                cell_config(spec, cell).model_dump(mode="json")):
            continue
        carried[cell.key] = CarriedRun(row={**row, "machine": row.get("machine") or report_machine},
                                       history=rounds.get(row["run_name"], []),
                                       note=(old.get("notes") or {}).get(cell.key))
    return carried


def replay_counts(spec: ExperimentSpec, cell: Cell, carried: Mapping[str, CarriedRun]) -> tuple[list[int] | None, str]:
    """The actor counts a replay cell replays, from its partner cell (``cells.replay_partner``)
    once that has finished here or in the report, and a note saying where they came from; None
    and why not while the partner has not finished (a replay of part of a run would replay
    other counts than the finished run's)."""
    partner = replay_partner(spec, cell)
    if partner is None:
        raise ValueError(f"{cell.key} replays no other cell")
    if partner.key in carried:
        counts, where = actors_launched(carried[partner.key].history), f"{partner.key} (carried from the report)"
    elif cell_state(cell_config(spec, partner), cell_run_id(spec.name, partner))[0] == "done":
        counts = actors_per_round(cell_config(spec, partner), cell_run_id(spec.name, partner)) or []
        where = partner.key
    else:
        return None, f"its partner {partner.key} has not finished: run it first (e.g. --only scaler={partner.scaler})"
    if not counts:
        return None, f"its partner {partner.key} launched no actors"
    mean = sum(counts) / len(counts)
    return counts, f"replays the {len(counts)} actor counts of {where} shuffled (mean {mean:.3f} actors a round)"
