"""Experiments: a matrix of env × algo × scaler × seed, each cell one training run, and a report.

Plain Python, no Prefect; ``flows/experiment.py`` orchestrates, ``cli/experiment.py`` is the
command line. Import the public names from ``nitro.experiments``; the submodules each do one job
(the spec, its cells, a cell's resume state, the statistics, rliable's aggregates, the report).

The spec (YAML)
---------------
::

    name: hopper-study               # MLflow experiment name; cell run ids derive from it
    base: {env_id: Hopper-v5, steps_per_actor: 256, ...}   # any NitroConfig mapping
    overrides: ["ppo.lr=5e-5"]       # optional dotted overrides, applied after ``base``
    matrix: {env: [Hopper-v5], algo: [ppo], scaler: [nitro, fixed, always, random], seed: [0, 1, 2]}
    baselines:                       # optional: named matrix entries, each a scaler + its own overrides
      serverful-32: {scaler: fixed, overrides: [backend.pricing=vm, scaler.fixed_actors=32]}
    compare: budget                  # budget: every cell gets budget_usd (rounds: max_rounds cap)
    budget_usd: 0.05                 # rounds: every cell runs `rounds` rounds, no budget
    max_rounds: 200
    reference: fixed                 # the entry the report's ratio tables divide by (default fixed)
    best_of: [fixed-8, fixed-16]     # optional: a grid; per task its best entry is the bar, seed by seed
    sensitivity:                     # optional; run with --sensitivity (paper §8.4)
      scaler: nitro
      seeds: [0, 1, 2]               # default: the matrix's seeds
      sweep: {scaler.decay: [0.9, 0.99], scaler.window: [3, 12], detector.subset_size: [256, 4096]}

Every cell's config is ``base`` + ``overrides`` + the cell's env/algo/scaler/seed (+ its
sensitivity value), with ``tracking.experiment`` forced to ``name`` (so ``nitro compare
--experiment <name>`` lists the cells) and ``budget_usd``/``rounds`` set by ``compare``.

Baselines
---------
A ``matrix.scaler`` entry is a scaler name or a baseline name. A baseline is a scaler with the
config overrides that make it the baseline, applied to its cells only, after the spec's
``overrides``; so Lambda-priced and VM-priced cells share one matrix. Built in
(``BUILTIN_BASELINES`` in spec.py; a spec's ``baselines`` entry of the same name replaces one):
``serverful`` (``fixed`` on ``backend.pricing: vm``), ``vm-pause`` and ``vm-replay`` (on VM
pricing), ``nitro-vm`` (Nitro without serverless: one always-on c5.18xlarge) and ``minionsrl``
(its scheduler file from ``scaler.minionsrl.path``, checked when the spec loads). A baseline may
not set what the matrix or ``compare`` sets (env_id, algo, seed, scaler.name, budget_usd, rounds).
The cell's label, run id and report row carry the baseline's name; its MLflow tag ``scaler`` the
scaler it ran.

Ablations (paper §8.5): ``fixed`` is Nitro without boosting (``scaler.fixed_actors`` every round);
``random`` boosts at random rounds. ``random`` must match Nitro's *expected spend*: it boosts to
I_max with probability p, else I_min, with p chosen so that its mean actors per round equals
Nitro's (``ScalerConfig.random_mean_actors``). The experiment therefore orders the nitro cell of
each (env, algo, seed) before its random cell and passes the nitro cell's **measured** mean
actors per round (over the rounds that launched actors, read from its checkpoint) to the random
cell. With no nitro cell for that (env, algo, seed) the random cell keeps the base config's
``scaler.random_mean_actors`` or ``random_boost_prob``; the report says which was used.

On another machine: a cell's checkpoints and MLflow run stay where it ran, but its report keeps
its numbers (``results.json``: row, config, machine; ``rounds.csv``, or ``rounds.csv.gz`` when
large: the per-round history). Run on a new machine with the same report directory, the
experiment carries each finished cell whose training config is unchanged (``carry.py``) into the
new report and does not train it again; a random cell is matched to a carried nitro cell's actors.
Each run's CPU model is in ``runs.csv`` (``machine``, the run's ``nitro.machine`` tag), and the
report lists the runs by machine when they differ.

Sensitivity (``--sensitivity``): one parameter at a time, the others at the base value, for the
``sensitivity.scaler`` cells (default nitro) over ``sensitivity.seeds``. A swept value equal to
the base value is the main matrix's cell itself, not a second run.
"""

from nitro.experiments.carry import CarriedRun, carried_runs, replay_counts
from nitro.experiments.cells import (
    Cell,
    cell_config,
    cell_run_id,
    cell_scaler,
    expand_cells,
    nitro_partner,
    replay_partner,
    select_cells,
    sensitivity_cells,
)
from nitro.experiments.load import load_spec
from nitro.experiments.machine import machine_info
from nitro.experiments.report import REPORT_METRICS, Report, build_report, iter_report_files
from nitro.experiments.spec import (
    BUILTIN_BASELINES,
    SENSITIVITY_KEYS,
    BaselineSpec,
    ExperimentError,
    ExperimentSpec,
    MatrixSpec,
    SensitivitySpec,
)
from nitro.experiments.state import (
    DONE_MARKER,
    actors_launched,
    actors_per_round,
    cell_state,
    mark_done,
    mean_actors_launched,
    mean_actors_per_round,
    saved_config_mismatch,
)
from nitro.experiments.stats import SUMMARY_COLUMNS, experiment_rows, format_summary, summarize

__all__ = [
    "BUILTIN_BASELINES",
    "DONE_MARKER",
    "REPORT_METRICS",
    "SENSITIVITY_KEYS",
    "SUMMARY_COLUMNS",
    "BaselineSpec",
    "CarriedRun",
    "Cell",
    "ExperimentError",
    "ExperimentSpec",
    "MatrixSpec",
    "Report",
    "SensitivitySpec",
    "actors_launched",
    "actors_per_round",
    "build_report",
    "carried_runs",
    "cell_config",
    "cell_run_id",
    "cell_scaler",
    "cell_state",
    "expand_cells",
    "experiment_rows",
    "format_summary",
    "iter_report_files",
    "load_spec",
    "machine_info",
    "mark_done",
    "mean_actors_launched",
    "mean_actors_per_round",
    "nitro_partner",
    "replay_counts",
    "replay_partner",
    "saved_config_mismatch",
    "select_cells",
    "sensitivity_cells",
    "summarize",
]
