"""Reading an experiment spec: validate it, then build every cell's config, so that a bad spec
or a bad base config fails before anything runs."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from nitro.config import ConfigError, load_spec_model
from nitro.experiments.cells import cell_config, expand_cells
from nitro.experiments.spec import ExperimentError, ExperimentSpec


def load_spec(source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()) -> ExperimentSpec:
    """Validate a spec from a YAML path or a mapping; raise ExperimentError (one line).

    ``overrides`` are extra dotted config overrides appended to the spec's (e.g. ``home=/tmp/x``).
    Every cell's config is built once here, so a bad base config fails before anything runs."""
    spec, where = load_spec_model(source, overrides, ExperimentSpec, "experiment spec", ExperimentError)
    try:
        for cell in expand_cells(spec, sensitivity=True):
            cell_config(spec, cell)
    except ConfigError as exc:
        raise ExperimentError(f"{where}: {exc}") from None
    return spec
