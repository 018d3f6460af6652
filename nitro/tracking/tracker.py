"""MLflow logging for one Nitro training run, by run id (never the thread-local active run).

Every call goes through ``MlflowClient`` with an explicit run id; nothing uses
``mlflow.start_run`` or the fluent API, because MLflow's active run is thread-local and a fluent
call from a Prefect task on a worker thread silently starts a new, stray run (docs/decisions.md,
MLflow). Around the tracker: ``nitro.tracking.store`` (where the store is),
``nitro.tracking.values`` (keys and values within MLflow's limits) and ``nitro.tracking.ui``
(the saved view, the links into the MLflow UI and back to Prefect).

One MLflow run per training run
-------------------------------
``RunTracker.start_or_attach`` looks the run up by the tag ``nitro.run_id`` and re-attaches to
it; only when none exists does it create one. A resumed run therefore continues its MLflow run,
and ``log_round`` skips a round whose step is already logged, so no metric ever holds two values
at one step. The lookup is by Nitro's run id alone, since one Prefect flow run may train several
runs (an experiment).

Per-round metrics (step = round index, 0-based)
-----------------------------------------------
The names, what each means and how rounds are numbered are in ``nitro.tracking.metrics``
(``ROUND_METRICS``, plus the learner's diagnostics such as ``ppo/kl``). ``log_round`` writes a
round in one ``log_batch`` (one ``log_metric`` call costs about 3.4 ms on SQLite) and adds two
things itself: the bookkeeping metric ``round`` (value = step = round index; the sentinel that
says which rounds are logged; ``rounds done = last round + 1``), and a copy of each
``HEADLINE_METRICS`` value under ``Headline/<name>``. The copy is for the MLflow UI: it draws
one chart section per ``prefix/`` in alphabetical order and puts unprefixed metrics last, so
without it the ``ppo/*`` charts would come first and the score would be one chart among two
dozen. ``Headline/eval_return_mean`` carries the last evaluation forward (the metric itself is
NaN between evaluations), so the run list always shows a run's latest score. Readers (compare,
reports, tests) use the names of ``nitro.tracking.metrics``.

Tags and artifacts
------------------
Tags set on a new run: ``nitro.run_id``, ``env``, ``algo``, ``scaler``, ``seed``, ``backend``,
``nitro.cost_model`` (local backend: "local actors priced as Lambda"; Ray: "ray actors priced as Lambda"), the Prefect
flow run's ``prefect.flow_run_*`` tags (see ``nitro.tracking.ui``), plus any caller tags (pass
``mlflow.parentRunId`` to nest a run under an experiment's parent run). Each run is named after
its Prefect flow run, else its Nitro run id.

Artifacts: ``config/config.yaml`` at start; at the end ``checkpoint/POINTER.txt`` (+ tag
``nitro.checkpoint_uri``) and the plots ``return.png``, ``actors.png``, ``spend.png`` at the
artifact root (MLflow's Compare page lists root files only), and the final policy as an MLflow
model (a LoggedModel named ``policy``, pyfunc: observations in, actions out; see
``nitro.tracking.policy_model``), linked to the run at the last round's step.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from nitro.config import NitroConfig
from nitro.tracking import ui
from nitro.tracking.metrics import HEADLINE_METRICS, SCORE_METRIC
from nitro.tracking.store import TrackingError, default_tracking_uri, ensure_store, normalize_tracking_uri
from nitro.tracking.ui import TAG_FLOW_RUN_ID, FlowRun
from nitro.tracking.values import (
    METRICS_PER_BATCH,
    PARAMS_PER_BATCH,
    chunks,
    clean_key,
    filter_value,
    params_from_config,
    tag_value,
)

__all__ = [
    "HEADLINE_PREFIX",
    "LOCAL_COST_MODEL",
    "RAY_COST_MODEL",
    "SENTINEL_METRIC",
    "TAG_CHECKPOINT",
    "TAG_FLOW_RUN_ID",
    "TAG_RUN_ID",
    "RunTracker",
    "TrackingError",
    "default_tracking_uri",
    "normalize_tracking_uri",
    "params_from_config",
]

SENTINEL_METRIC = "round"
# Capitalised so that it sorts before every lowercase group (the UI sorts section names by code point).
HEADLINE_PREFIX = "Headline/"

TAG_RUN_ID = "nitro.run_id"
# The CPU model a run trained on: the projected clock bills measured learner time, so spend compares within one.
TAG_MACHINE = "nitro.machine"
TAG_COST_MODEL = "nitro.cost_model"
TAG_CHECKPOINT = "nitro.checkpoint_uri"
TAG_RUN_NAME = "mlflow.runName"
POLICY_MODEL_NAME = "policy"
LOCAL_COST_MODEL = "local actors priced as Lambda"
RAY_COST_MODEL = "ray actors priced as Lambda"


class RunTracker:
    """Logs one or more Nitro training runs to MLflow, always by explicit MLflow run id.

    Thread-safe: a Prefect task on any thread may call ``log_round``; writes to one store go
    through a lock (SQLite allows one writer at a time anyway) and the set of logged steps per
    run is cached, loaded from the store the first time a run is seen.
    """

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.tracking_uri, artifact_root = ensure_store(normalize_tracking_uri(tracking_uri))
        self.experiment_name = experiment
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._ensure_experiment(experiment, artifact_root)
        self._lock = threading.RLock()
        self._logged_steps: dict[str, set[int]] = {}
        self._last_score: dict[str, float] = {}  # run id -> last finite eval_return_mean

    # -- experiment / run lookup ------------------------------------------------------------

    def _ensure_experiment(self, name: str, artifact_root: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            self._set_experiment_view(exp.experiment_id, exp.tags)
            return exp.experiment_id
        try:
            location = f"{artifact_root}/{clean_key(name).replace('/', '_')}" if artifact_root else None
            experiment_id = self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            experiment_id = exp.experiment_id
        self._set_experiment_view(experiment_id, {})
        return experiment_id

    def _set_experiment_view(self, experiment_id: str, tags: Mapping[str, str]) -> None:
        """Mark the experiment as model training and store the run-list view whose columns are
        the headline metrics (see ``nitro.tracking.ui``)."""
        headline = [HEADLINE_PREFIX + name for name in HEADLINE_METRICS]
        for key, value in ui.experiment_tags(tags, headline).items():
            self.client.set_experiment_tag(experiment_id, key, value)

    def _search(self, tag: str, value: str) -> list:
        return self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{tag}` = {filter_value(value)}",
            run_view_type=ViewType.ACTIVE_ONLY,
            order_by=["attributes.start_time ASC"],
            max_results=50,
        )

    def find_run(self, nitro_run_id: str) -> str | None:
        """The MLflow run id of this training run, or None."""
        # Only by Nitro's run id: one Prefect flow run may train several runs (an experiment).
        runs = self._search(TAG_RUN_ID, nitro_run_id)
        return runs[0].info.run_id if runs else None

    # -- start / attach ---------------------------------------------------------------------

    def start_or_attach(
        self,
        prefect_flow_run_id: str | None,
        nitro_run_id: str,
        config: NitroConfig,
        tags: Mapping[str, Any] | None = None,
        *,
        flow_run_name: str | None = None,
        flow_run_url: str | None = None,
    ) -> str:
        """Return the MLflow run id of this training run, creating the run only if none exists.

        A new run is named ``flow_run_name`` (the Prefect flow run's name, so both UIs show one
        name), else the Nitro run id. ``flow_run_url`` (default: from ``$PREFECT_UI_URL``) goes in
        a tag and in the run's description, so the MLflow UI links back to the flow run."""
        if not nitro_run_id:
            raise ValueError("nitro_run_id must be a non-empty string")
        flow = FlowRun(prefect_flow_run_id, flow_run_name, flow_run_url or ui.env_flow_run_url(prefect_flow_run_id))
        with self._lock:
            run_id = self.find_run(nitro_run_id)
            if run_id is not None:
                self._reattach(run_id, flow, nitro_run_id, dict(tags or {}))
                return run_id
            run_id = self._create(flow, nitro_run_id, config, dict(tags or {}))
            # Two processes may have raced to create it: the oldest one wins, the other goes.
            runs = self._search(TAG_RUN_ID, nitro_run_id)
            if len(runs) > 1 and runs[0].info.run_id != run_id:
                self.client.delete_run(run_id)
                run_id = runs[0].info.run_id
                self._reattach(run_id, flow, nitro_run_id, dict(tags or {}))
            self._logged_steps[run_id] = set()
            return run_id

    def _run_tags(self, flow: FlowRun, nitro_run_id: str, config: NitroConfig, extra: dict) -> dict[str, str]:
        tags: dict[str, Any] = {
            TAG_RUN_ID: nitro_run_id,
            TAG_RUN_NAME: flow.name or nitro_run_id,
            "env": config.env_id,
            "algo": config.algo,
            "scaler": config.scaler.name,
            "seed": config.seed,
            "backend": config.backend.kind,
        }
        if config.backend.kind == "local":
            tags[TAG_COST_MODEL] = LOCAL_COST_MODEL
        elif config.backend.kind == "ray":
            tags[TAG_COST_MODEL] = RAY_COST_MODEL
        if flow.id:
            tags.update(ui.prefect_tags(flow, nitro_run_id, [flow.id]))
        tags.update(extra)
        return {clean_key(k): tag_value(v) for k, v in tags.items() if v is not None}

    def _create(self, flow: FlowRun, nitro_run_id: str, config: NitroConfig, extra: dict) -> str:
        tags = self._run_tags(flow, nitro_run_id, config, extra)
        run = self.client.create_run(self.experiment_id, run_name=tags[TAG_RUN_NAME], tags=tags)
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in params_from_config(config).items()]
        for chunk in chunks(params, PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk, synchronous=True)
        self.client.log_text(run_id, config.dump_yaml(), "config/config.yaml")
        return run_id

    def _reattach(self, run_id: str, flow: FlowRun, nitro_run_id: str, extra: Mapping[str, Any] | None = None) -> None:
        """Mark the run RUNNING, point its Prefect tags at this flow run, and add the caller's tags
        it lacks: a run created by someone else (an experiment creates its cells' runs) still gets
        what this run's own attach says about it, e.g. its scheduler's pre-training."""
        run = self.client.get_run(run_id)
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        tags = ui.reattach_prefect_tags(run.data.tags, flow, nitro_run_id)
        for key, value in (extra or {}).items():
            if value is not None and clean_key(key) not in run.data.tags:
                tags[clean_key(key)] = value
        if tags:
            self.client.log_batch(run_id, tags=[RunTag(k, tag_value(v)) for k, v in tags.items()])
        self._logged_steps[run_id] = self._load_steps(run_id)

    def _load_steps(self, run_id: str) -> set[int]:
        return {int(m.step) for m in self.client.get_metric_history(run_id, SENTINEL_METRIC)}

    # -- per round --------------------------------------------------------------------------

    def logged_rounds(self, run_id: str) -> set[int]:
        """Round indices already logged for this run (from the cache; loaded once per run)."""
        with self._lock:
            steps = self._logged_steps.get(run_id)
            if steps is None:
                steps = self._logged_steps[run_id] = self._load_steps(run_id)
            return set(steps)

    def log_round(self, run_id: str, round_idx: int, metrics: Mapping[str, Any]) -> bool:
        """Log one round's metrics in ONE ``log_batch`` at step=round_idx.

        Idempotent: a round already logged (a resumed run re-logging it) is skipped and False is
        returned. None values are dropped; NaN/inf are logged as MLflow stores them. The
        ``Headline/`` copies are added here (see the module docstring); the evaluation return's
        copy carries the last evaluation forward over the rounds between evaluations, so the
        run list and the headline chart always show the latest score instead of NaN.
        """
        step = int(round_idx)
        ts = int(time.time() * 1000)
        with self._lock:
            steps = self._logged_steps.get(run_id)
            if steps is None:
                steps = self._logged_steps[run_id] = self._load_steps(run_id)
            if step in steps:
                return False
            values: dict[str, float] = {}
            for key, value in metrics.items():
                if value is None or key == SENTINEL_METRIC:
                    continue
                try:
                    values[clean_key(key)] = float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"metric {key!r} at round {step} is not a number: {value!r}") from None
            headline = {name: values[name] for name in HEADLINE_METRICS if name in values}
            if SCORE_METRIC in headline:
                if math.isfinite(headline[SCORE_METRIC]):
                    self._last_score[run_id] = headline[SCORE_METRIC]
                else:
                    headline[SCORE_METRIC] = self._latest_score(run_id)
            batch = [Metric(key, v, ts, step) for key, v in values.items()]
            batch += [Metric(HEADLINE_PREFIX + key, v, ts, step) for key, v in headline.items()]
            batch.append(Metric(SENTINEL_METRIC, float(step), ts, step))
            for chunk in chunks(batch, METRICS_PER_BATCH):
                self.client.log_batch(run_id, metrics=chunk, synchronous=True)
            steps.add(step)
        return True

    def _latest_score(self, run_id: str) -> float:
        """The last finite evaluation return logged for the run (NaN before the first one); read
        from the store once per run and tracker, so a resumed run carries its score forward."""
        if run_id not in self._last_score:
            finite = [(m.step, m.value) for m in self.client.get_metric_history(run_id, SCORE_METRIC)
                      if math.isfinite(m.value)]
            self._last_score[run_id] = max(finite)[1] if finite else math.nan
        return self._last_score[run_id]

    def round_rows(self, run_id: str, keys: Iterable[str] | None = None) -> list[dict[str, float]]:
        """Per-round rows rebuilt from the store (one query per metric), sorted by round."""
        run = self.client.get_run(run_id)
        wanted = list(keys) if keys is not None else sorted(run.data.metrics)
        rows: dict[int, dict[str, float]] = {}
        for key in wanted:
            for m in self.client.get_metric_history(run_id, key):
                rows.setdefault(int(m.step), {"round": int(m.step)})[key] = m.value
        return [rows[k] for k in sorted(rows)]

    # -- links into the MLflow UI -----------------------------------------------------------

    def run_url(self, run_id: str) -> str:
        """Link to the run's page in the MLflow UI."""
        return ui.run_url(self.tracking_uri, self.experiment_id, run_id)

    def experiment_url(self) -> str:
        """Link to the experiment's run list, in the saved view with the headline columns."""
        return ui.experiment_url(self.tracking_uri, self.experiment_id)

    # -- end of run -------------------------------------------------------------------------

    def log_final(
        self,
        run_id: str,
        policy_bytes: bytes | None,
        checkpoint_dir_or_uri: str | os.PathLike | None,
        round_rows: list[dict[str, Any]] | None,
        status: str = "FINISHED",
    ) -> dict[str, str]:
        """Final policy (an MLflow model), checkpoint pointer, PNG plots; then end the run.

        ``round_rows=None`` rebuilds the rows from the run's metric history. Returns what was
        written: artifact paths relative to the run's artifact root, and under ``policy`` the
        model URI (``models:/<model id>``).
        """
        from nitro.tracking import plots  # matplotlib only when a run ends

        written: dict[str, str] = {}
        with self._lock, tempfile.TemporaryDirectory(prefix="nitro-final-") as tmp:
            root = Path(tmp)
            rows = round_rows if round_rows is not None else self.round_rows(run_id)
            if policy_bytes is not None:
                last_round = int(rows[-1]["round"]) if rows else 0
                written["policy"] = "models:/" + self.log_policy_model(run_id, policy_bytes, step=last_round)
            if checkpoint_dir_or_uri is not None:
                pointer = str(checkpoint_dir_or_uri)
                if "://" not in pointer:
                    pointer = str(Path(pointer).expanduser().resolve())
                nitro_run_id = self.client.get_run(run_id).data.tags.get(TAG_RUN_ID, "<nitro run id>")
                (root / "checkpoint").mkdir()
                (root / "checkpoint" / "POINTER.txt").write_text(
                    f"Round checkpoints of this run live at:\n{pointer}\n"
                    f"Resume with: nitro resume {nitro_run_id}\n"
                )
                self.client.set_tag(run_id, TAG_CHECKPOINT, tag_value(pointer))
                written["checkpoint"] = "checkpoint/POINTER.txt"
            if rows:
                for name, path in plots.write_run_plots(rows, root).items():
                    written[f"plot_{name}"] = Path(path).name
            if any(key != "policy" for key in written):
                self.client.log_artifacts(run_id, str(root))
            self.client.set_terminated(run_id, status=status)
        return written

    def log_policy_model(self, run_id: str, policy_bytes: bytes, step: int) -> str:
        """Log ``policy_bytes`` (``Trainer.policy_payload``) as a pyfunc LoggedModel named
        ``policy``, linked to the run at ``step``; return its model id.

        By explicit ids, like everything here: ``mlflow.pyfunc.log_model`` would resolve the
        active run and the global tracking URI, neither of which belongs to this tracker."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus
        from mlflow.models import Model

        from nitro.tracking.policy_model import save_policy_model

        run = self.client.get_run(run_id)
        model = self.client.create_logged_model(
            self.experiment_id, name=POLICY_MODEL_NAME, source_run_id=run_id, model_type="nitro-policy",
            tags={TAG_RUN_ID: run.data.tags.get(TAG_RUN_ID, ""), "round": str(step)},
        )
        try:
            with tempfile.TemporaryDirectory(prefix="nitro-model-") as tmp:
                local = Path(tmp) / "model"
                meta = Model(artifact_path=model.artifact_location, model_uuid=model.model_id, run_id=run_id,
                             model_id=model.model_id)
                save_policy_model(local, policy_bytes, mlflow_model=meta)
                self.client.log_model_artifacts(model.model_id, str(local))
            self.client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
        except BaseException:
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
            raise
        self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        return model.model_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """End the run without final artifacts (e.g. FAILED or KILLED)."""
        self.client.set_terminated(run_id, status=status)
