"""Experiments: a matrix of env × algo × scaler × seed, each cell one training run, and a report.

Plain Python, no Prefect; ``flows/experiment.py`` orchestrates, ``cli/experiment.py`` is the
command line. Import the public names from ``nitro.experiments``; the submodules each do one job
(the spec, its cells, a cell's resume state, the statistics, the report).

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

from nitro.experiments.cells import (
    Cell,
    cell_config,
    cell_run_id,
    expand_cells,
    nitro_partner,
    sensitivity_cells,
)
from nitro.experiments.load import load_spec
from nitro.experiments.machine import machine_info
from nitro.experiments.report import REPORT_METRICS, Report, build_report, iter_report_files
from nitro.experiments.spec import (
    SENSITIVITY_KEYS,
    ExperimentError,
    ExperimentSpec,
    MatrixSpec,
    SensitivitySpec,
)
from nitro.experiments.state import (
    DONE_MARKER,
    cell_state,
    mark_done,
    mean_actors_per_round,
    saved_config_mismatch,
)
from nitro.experiments.stats import SUMMARY_COLUMNS, experiment_rows, format_summary, summarize

__all__ = [
    "DONE_MARKER",
    "REPORT_METRICS",
    "SENSITIVITY_KEYS",
    "SUMMARY_COLUMNS",
    "Cell",
    "ExperimentError",
    "ExperimentSpec",
    "MatrixSpec",
    "Report",
    "SensitivitySpec",
    "build_report",
    "cell_config",
    "cell_run_id",
    "cell_state",
    "expand_cells",
    "experiment_rows",
    "format_summary",
    "iter_report_files",
    "load_spec",
    "machine_info",
    "mark_done",
    "mean_actors_per_round",
    "nitro_partner",
    "saved_config_mismatch",
    "sensitivity_cells",
    "summarize",
]
