"""Reading an experiment spec: validate it, then build every cell's config, so that a bad spec
or a bad base config fails before anything runs."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from nitro.config import ConfigError, load_spec_model
from nitro.experiments.cells import cell_config, expand_cells
from nitro.experiments.spec import ExperimentError, ExperimentSpec


def load_spec(source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()) -> ExperimentSpec:
    """Validate a spec from a YAML path or a mapping; raise ExperimentError (one line).

    ``overrides`` are extra dotted config overrides appended to the spec's (e.g. ``home=/tmp/x``).
    Every cell's config is built once here, so a bad base config fails before anything runs."""
    spec, where = load_spec_model(source, overrides, ExperimentSpec, "experiment spec", ExperimentError)
    checked: set[str] = set()
    for cell in expand_cells(spec, sensitivity=True):
        in_baseline = f"baseline {cell.scaler}: " if spec.baseline(cell.scaler).overrides else ""
        try:
            config = cell_config(spec, cell)
        except ConfigError as exc:
            raise ExperimentError(f"{where}: {in_baseline}{exc}") from None
        path = config.scaler.minionsrl.path
        if config.scaler.name == "minionsrl" and path is not None and path not in checked:  # validated: it is set
            checked.add(path)
            _check_scheduler(path, f"{where}: {in_baseline}scaler.minionsrl.path")
    return spec


def _check_scheduler(path: str, field: str) -> None:
    """A MinionsRL cell's scheduler file must be one before any cell runs, not when its cell starts."""
    from nitro.scaling.minionsrl.pretrain import load_scheduler

    try:
        load_scheduler(path)
    except ValueError as exc:
        raise ExperimentError(f"{field}: {exc}") from None
