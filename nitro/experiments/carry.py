"""Cells an experiment's report already holds from another machine.

A study that outlives one machine (its MLflow store and checkpoints stay behind) goes on from its
report: ``results.json`` keeps every finished cell's row, its per-round history, its config and
the machine it ran on. A cell finished there is carried into the next report as it was, and the
runner does not train it again. Only a finished cell with the same run id and the same training
config is carried; anything else runs here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from nitro.experiments.cells import Cell, cell_config, cell_run_id
from nitro.experiments.spec import ExperimentSpec

# Where a run keeps its files and its metrics, not what it trains: a cell carried from another
# machine may differ in these.
PLACE_FIELDS = ("home", "tracking", "redis")


@dataclass(frozen=True)
class CarriedRun:
    row: dict[str, Any]  # the report's runs row, with its ``machine``
    history: list[dict[str, float]]  # the report's per-round metrics of the run
    note: str | None = None  # the report's note on the cell, e.g. where a random cell's mean actors came from


def training_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in PLACE_FIELDS}


def carried_runs(out_dir: str | Path, spec: ExperimentSpec, cells: Sequence[Cell]) -> dict[str, CarriedRun]:
    """Per cell key, the finished runs that ``out_dir/results.json`` holds for this spec's cells."""
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
    carried: dict[str, CarriedRun] = {}
    for row in old.get("runs") or []:
        cell = by_key.get(row.get("cell"))
        if cell is None or row.get("status") != "FINISHED" or row.get("nitro_run_id") != cell_run_id(spec.name, cell):
            continue
        saved = configs.get(cell.key)
        if saved is None or training_config(saved) != training_config(cell_config(spec, cell).model_dump(mode="json")):
            continue
        carried[cell.key] = CarriedRun(row={**row, "machine": row.get("machine") or report_machine},
                                       history=list((old.get("rounds") or {}).get(row["run_name"]) or []),
                                       note=(old.get("notes") or {}).get(cell.key))
    return carried
