"""MLflow logging for one Nitro training run, by run id (never the thread-local active run).

Why by run id: MLflow's active run is thread-local, so ``mlflow.log_metric`` called from a
Prefect task on a worker thread silently starts a new, stray run (../shared/NOTES.md). Every
call here goes through ``MlflowClient`` with an explicit run id; nothing uses ``mlflow.start_run``
or the fluent API.

One MLflow run per training run
-------------------------------
``RunTracker.start_or_attach`` looks the run up by the tag ``nitro.run_id`` (and, for a run
logged without one, ``prefect.flow_run_id``) and re-attaches to it; only when none exists does
it create one. A resumed run therefore continues its MLflow run, and ``log_round`` skips a
round whose step is already logged, so no metric ever holds two values at one step.

Canonical per-round metrics (step = round index, 0-based)
---------------------------------------------------------
Rounds are numbered from 0 everywhere: MLflow step k, Prefect subflow ``<run id>-round-k``, row
``round=k`` of the Prefect table artifact and the CLI's ``round k`` line are the same round.
The engine produces exactly these names; ``nitro.compare`` and ``nitro.plots`` read them::

    eval_return_mean, eval_return_std    evaluation: whole episodes of the round's policy, mean action
                                         (NaN between evaluations; the score a run is judged by)
    eval_stochastic_return_mean, _std    the same with sampled actions
    eval_episodes, eval_invocations      evaluation episodes finished / invocations
    train_return_mean, train_return_max  whole training episodes that ended in the round (sampled
                                         actions, may span rounds): a diagnostic
    train_episodes                       training episodes that ended in the round
    env_steps, env_steps_total           env steps this round / cumulative
    actors_launched, actors_failed       actor invocations started / failed or missing
    boost_score                          the scaler's boosting score S_k (NaN: no score)
    hessian_R, lambda_max, lambda_min    detection output
    spend_round_usd, spend_total_usd     spend of the round / cumulative
    spend_learner_usd, spend_lambda_compute_usd, spend_requests_usd, spend_provisioned_usd
                                         the round's spend by ledger line
    learner_s, detection_s, actor_s, orchestration_s, round_s
                                         wall seconds of the round's parts and of the whole round
    round_lambda_s, round_billed_s       the round had its invocations run at once on Lambda
                                         (nitro.clock) / the seconds the learner was billed for
    ppo/<name>                           PPO diagnostics (e.g. ppo/kl, ppo/clip_frac, ppo/entropy)

``log_round`` adds two things itself: the bookkeeping metric ``round`` (value = step = round
index; the sentinel that says which rounds are logged; ``rounds done = last round + 1``), and a
copy of each ``HEADLINE_METRICS`` value under ``Headline/<name>``. The copy is for the MLflow UI:
it draws one chart section per ``prefix/`` in alphabetical order and puts unprefixed metrics
last, so without it the ``ppo/*`` charts came first and the score was one chart among two dozen.
``Headline/eval_return_mean`` carries the last evaluation forward (the canonical metric is NaN
between evaluations), so the run list always shows a run's latest score. Readers (compare,
reports, tests) keep using the canonical names.

The MLflow UI
-------------
The experiment is tagged ``mlflow.experimentKind=custom_model_development`` (MLflow 3 otherwise
opens it on its GenAI overview) and holds a saved view, ``mlflow.sharedViewState.nitro``: the
run list with the headline metrics and the run's env/algo/scaler/seed as columns (the UI's own
default shows no metric column). ``experiment_url`` links to it; it and ``run_url`` also switch
the UI to its model-training mode (``UI_MODE``). Each run is named after its Prefect flow run,
and its description links back to that flow run.

Tags set on a new run: ``nitro.run_id``, ``env``, ``algo``, ``scaler``, ``seed``, ``backend``,
``nitro.cost_model`` (local backend: "local actors priced as Lambda"), ``prefect.flow_run_id``,
``prefect.flow_run_name`` and ``prefect.flow_run_url`` (when the Prefect UI's address is known),
plus any caller tags (pass ``mlflow.parentRunId`` to nest a run under an experiment's parent run).
On re-attach the Prefect tags are updated to the current flow run and ``prefect.flow_run_ids``
keeps them all.

Artifacts: ``config/config.yaml`` at start; at the end ``checkpoint/POINTER.txt`` (+ tag
``nitro.checkpoint_uri``) and the plots ``return.png``, ``actors.png``, ``spend.png`` at the
artifact root (MLflow's Compare page lists root files only), and the final policy as an MLflow
model (a LoggedModel named ``policy``, pyfunc: observations in, actions out; see
``nitro.policy_model``), linked to the run at the last round's step.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from nitro.config import NitroConfig

__all__ = [
    "CANONICAL_METRICS",
    "HEADLINE_METRICS",
    "HEADLINE_PREFIX",
    "PPO_PREFIX",
    "SENTINEL_METRIC",
    "TAG_RUN_ID",
    "TAG_FLOW_RUN_ID",
    "TAG_CHECKPOINT",
    "LOCAL_COST_MODEL",
    "RunTracker",
    "TrackingError",
    "default_tracking_uri",
    "normalize_tracking_uri",
    "params_from_config",
]

CANONICAL_METRICS: tuple[str, ...] = (
    "eval_return_mean",
    "eval_return_std",
    "eval_stochastic_return_mean",
    "eval_stochastic_return_std",
    "eval_episodes",
    "eval_invocations",
    "train_return_mean",
    "train_return_max",
    "train_episodes",
    "env_steps",
    "env_steps_total",
    "actors_launched",
    "actors_failed",
    "boost_score",
    "hessian_R",
    "lambda_max",
    "lambda_min",
    "spend_round_usd",
    "spend_total_usd",
    "spend_learner_usd",
    "spend_lambda_compute_usd",
    "spend_requests_usd",
    "spend_provisioned_usd",
    "learner_s",
    "detection_s",
    "actor_s",
    "orchestration_s",
    "round_s",
    "round_lambda_s",
    "round_billed_s",
)
PPO_PREFIX = "ppo/"
SENTINEL_METRIC = "round"
# What a user judges a run by, in the order the UI shows them (issue 12: evaluation return,
# training return, spend, actors, R, boosting score).
HEADLINE_METRICS: tuple[str, ...] = (
    "eval_return_mean", "train_return_mean", "spend_total_usd", "actors_launched", "hessian_R", "boost_score",
)
# Capitalised so that it sorts before every lowercase group (the UI sorts section names by code point).
HEADLINE_PREFIX = "Headline/"
SCORE_METRIC = "eval_return_mean"

TAG_RUN_ID = "nitro.run_id"
TAG_FLOW_RUN_ID = "prefect.flow_run_id"
TAG_FLOW_RUN_IDS = "prefect.flow_run_ids"
TAG_FLOW_RUN_URL = "prefect.flow_run_url"
TAG_COST_MODEL = "nitro.cost_model"
TAG_CHECKPOINT = "nitro.checkpoint_uri"
TAG_FLOW_RUN_NAME = "prefect.flow_run_name"
TAG_RUN_NAME = "mlflow.runName"
TAG_NOTE = "mlflow.note.content"  # the run's description in the UI (Markdown)
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
VIEW_KEY = "nitro"
TAG_SHARED_VIEW = "mlflow.sharedViewState."  # + key; the UI's "Share" button stores views here
POLICY_MODEL_NAME = "policy"
# MLflow 3's UI has a global GenAI / Model training switch (GenAI by default, remembered in the
# browser); this query parameter opens a link in model-training mode.
UI_MODE = "workflowType=machine_learning"
LOCAL_COST_MODEL = "local actors priced as Lambda"

MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE = 8000  # MAX_TAG_VAL_LENGTH
MAX_KEY = 250  # MAX_ENTITY_KEY_LENGTH
PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH
_TRUNCATED = "...[truncated; full value in config/config.yaml]"
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


class TrackingError(RuntimeError):
    """The tracking store can't be used; the message is one line and says what to do."""


# -- store URIs ------------------------------------------------------------------------------


def default_tracking_uri(config: NitroConfig | None = None) -> str:
    """config.tracking.mlflow_uri, else $MLFLOW_TRACKING_URI, else sqlite:///<home>/mlflow.db."""
    if config is not None and config.tracking.mlflow_uri:
        return normalize_tracking_uri(config.tracking.mlflow_uri)
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return normalize_tracking_uri(env)
    home = Path(config.home) if config is not None else Path(".nitro")
    return "sqlite:///" + str((home / "mlflow.db").resolve())


def normalize_tracking_uri(uri: str) -> str:
    """A bare ``*.db`` path becomes a sqlite URI; other URIs pass through unchanged."""
    uri = str(uri).strip()
    if "://" not in uri and uri.endswith((".db", ".sqlite", ".sqlite3")):
        return "sqlite:///" + str(Path(uri).expanduser().resolve())
    return uri


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///path`` URI (None for other stores or in-memory)."""
    if not uri.startswith("sqlite://"):
        return None
    rest = uri[len("sqlite://"):]
    if not rest.startswith("/"):
        return None
    path = rest[1:]  # sqlite:///rel/x.db -> rel/x.db ; sqlite:////abs/x.db -> /abs/x.db
    path = path.split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path)


def _ensure_store(uri: str) -> tuple[str, str | None]:
    """Create what a local store needs; return (uri, artifact root for new experiments)."""
    db = _sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        # Next to the database, not ./mlruns relative to whatever the worker's cwd is.
        return uri, (db.parent.resolve() / "mlartifacts").as_uri()
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true", "yes"):
            raise TrackingError(
                f"MLflow tracking URI {uri!r} is a file store, which MLflow 3.17 refuses; "
                "use sqlite:///path/to/mlflow.db (or set MLFLOW_ALLOW_FILE_STORE=true)"
            )
        Path(parsed.path if parsed.scheme else uri).mkdir(parents=True, exist_ok=True)
    return uri, None


# -- params ----------------------------------------------------------------------------------


def _clean_key(key: str) -> str:
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip("/") or "_"
    key = re.sub(r"/+", "/", key).replace("/./", "/")
    return key[:MAX_KEY]


def _param_value(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, (bool, int, float)):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, default=str)
    if len(text) > MAX_PARAM_VALUE:
        text = text[: MAX_PARAM_VALUE - len(_TRUNCATED)] + _TRUNCATED
    return text


def params_from_config(config: NitroConfig) -> dict[str, str]:
    """The whole config as MLflow params: dotted keys, valid characters, values within limits."""
    out: dict[str, str] = {}
    for key, value in config.to_flat_dict().items():
        k = _clean_key(key)
        while k in out:  # two keys that cleaned to the same name: keep both
            k = (k[: MAX_KEY - 1] + "_")
        out[k] = _param_value(value)
    return out


def _tag_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_TAG_VALUE else text[: MAX_TAG_VALUE - 3] + "..."


def _q(value: str) -> str:
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _chunks(items: list, n: int) -> Iterable[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


# -- the MLflow UI ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _FlowRun:
    """The Prefect flow run that trains a run, as far as it is known (all None outside Prefect)."""

    id: str | None
    name: str | None = None
    url: str | None = None


def _env_flow_run_url(flow_run_id: str | None) -> str | None:
    """The flow run's page from ``$PREFECT_UI_URL``, for callers that do not pass the URL."""
    ui = os.environ.get("PREFECT_UI_URL")
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None


def _description(nitro_run_id: str, flow: _FlowRun) -> str:
    """The run's description (Markdown in the MLflow UI): a link back to the Prefect flow run."""
    label = flow.name or flow.id
    where = f"[{label}]({flow.url})" if flow.url else f"`{label}`"
    return (f"Nitro run `{nitro_run_id}`, trained by the Prefect flow run {where}. "
            f"Resume it with that flow run's *Retry*, or `nitro resume {nitro_run_id}`.")


def experiment_view_state() -> str:
    """The saved run-list view (JSON) the experiment's ``experiment_url`` opens: the headline
    metrics and the run's identity tags as columns, newest runs first."""
    columns = [f"metrics.`{HEADLINE_PREFIX}{name}`" for name in HEADLINE_METRICS]
    columns += [f"tags.`{tag}`" for tag in ("env", "algo", "scaler", "seed")]
    columns += ["attributes.`Models`"]
    return json.dumps({"selectedColumns": columns, "columnOrder": columns, "orderByKey": "attributes.start_time",
                       "orderByAsc": False})


# -- the tracker -----------------------------------------------------------------------------


class RunTracker:
    """Logs one or more Nitro training runs to MLflow, always by explicit MLflow run id.

    Thread-safe: a Prefect task on any thread may call ``log_round``; writes to one store go
    through a lock (SQLite allows one writer at a time anyway) and the set of logged steps per
    run is cached, loaded from the store the first time a run is seen.
    """

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.tracking_uri, artifact_root = _ensure_store(normalize_tracking_uri(tracking_uri))
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
            location = f"{artifact_root}/{_clean_key(name).replace('/', '_')}" if artifact_root else None
            experiment_id = self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            experiment_id = exp.experiment_id
        self._set_experiment_view(experiment_id, {})
        return experiment_id

    def _set_experiment_view(self, experiment_id: str, tags: Mapping[str, str]) -> None:
        """Mark the experiment as model training (unless someone chose a kind) and store the run
        list view that shows the headline metrics (see the module docstring)."""
        if TAG_EXPERIMENT_KIND not in tags:
            self.client.set_experiment_tag(experiment_id, TAG_EXPERIMENT_KIND, MODEL_TRAINING_KIND)
        view = experiment_view_state()
        if tags.get(TAG_SHARED_VIEW + VIEW_KEY) != view:
            self.client.set_experiment_tag(experiment_id, TAG_SHARED_VIEW + VIEW_KEY, view)

    def _search(self, tag: str, value: str) -> list:
        return self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{tag}` = {_q(value)}",
            run_view_type=ViewType.ACTIVE_ONLY,
            order_by=["attributes.start_time ASC"],
            max_results=50,
        )

    def find_run(self, nitro_run_id: str, prefect_flow_run_id: str | None = None) -> str | None:
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
        flow = _FlowRun(prefect_flow_run_id, flow_run_name, flow_run_url or _env_flow_run_url(prefect_flow_run_id))
        with self._lock:
            run_id = self.find_run(nitro_run_id, prefect_flow_run_id)
            if run_id is not None:
                self._reattach(run_id, flow, nitro_run_id)
                return run_id
            run_id = self._create(flow, nitro_run_id, config, dict(tags or {}))
            # Two processes may have raced to create it: the oldest one wins, the other goes.
            runs = self._search(TAG_RUN_ID, nitro_run_id)
            if len(runs) > 1 and runs[0].info.run_id != run_id:
                self.client.delete_run(run_id)
                run_id = runs[0].info.run_id
                self._reattach(run_id, flow, nitro_run_id)
            self._logged_steps[run_id] = set()
            return run_id

    def _run_tags(self, flow: "_FlowRun", nitro_run_id: str, config: NitroConfig, extra: dict) -> dict[str, str]:
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
        if flow.id:
            tags.update(self._prefect_tags(flow, nitro_run_id, [flow.id]))
        tags.update(extra)
        return {_clean_key(k): _tag_value(v) for k, v in tags.items() if v is not None}

    @staticmethod
    def _prefect_tags(flow: "_FlowRun", nitro_run_id: str, all_ids: list[str]) -> dict[str, str]:
        tags = {TAG_FLOW_RUN_ID: flow.id, TAG_FLOW_RUN_IDS: ",".join(all_ids)}
        if flow.name:
            tags[TAG_FLOW_RUN_NAME] = flow.name
        if flow.url:
            tags[TAG_FLOW_RUN_URL] = flow.url
        tags[TAG_NOTE] = _description(nitro_run_id, flow)
        return tags

    def _create(self, flow: "_FlowRun", nitro_run_id: str, config: NitroConfig, extra: dict) -> str:
        tags = self._run_tags(flow, nitro_run_id, config, extra)
        run = self.client.create_run(self.experiment_id, run_name=tags[TAG_RUN_NAME], tags=tags)
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in params_from_config(config).items()]
        for chunk in _chunks(params, PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk, synchronous=True)
        self.client.log_text(run_id, config.dump_yaml(), "config/config.yaml")
        return run_id

    def _reattach(self, run_id: str, flow: "_FlowRun", nitro_run_id: str) -> None:
        run = self.client.get_run(run_id)
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        known = run.data.tags
        if flow.id and (known.get(TAG_FLOW_RUN_ID) != flow.id or (flow.url and known.get(TAG_FLOW_RUN_URL) != flow.url)):
            ids = [i for i in known.get(TAG_FLOW_RUN_IDS, "").split(",") if i]
            if flow.id not in ids:
                ids.append(flow.id)
            tags = self._prefect_tags(flow, nitro_run_id, ids)
            self.client.log_batch(run_id, tags=[RunTag(k, _tag_value(v)) for k, v in tags.items()])
        if TAG_RUN_ID not in run.data.tags:
            self.client.set_tag(run_id, TAG_RUN_ID, nitro_run_id)
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
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if value is None or key == SENTINEL_METRIC:
                continue
            try:
                values[_clean_key(key)] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"metric {key!r} at round {step} is not a number: {value!r}") from None
        with self._lock:
            steps = self._logged_steps.get(run_id)
            if steps is None:
                steps = self._logged_steps[run_id] = self._load_steps(run_id)
            if step in steps:
                return False
            headline = {name: values[name] for name in HEADLINE_METRICS if name in values}
            if SCORE_METRIC in headline:
                if math.isfinite(headline[SCORE_METRIC]):
                    self._last_score[run_id] = headline[SCORE_METRIC]
                else:
                    headline[SCORE_METRIC] = self._latest_score(run_id)
            batch = [Metric(key, v, ts, step) for key, v in values.items()]
            batch += [Metric(HEADLINE_PREFIX + key, v, ts, step) for key, v in headline.items()]
            batch.append(Metric(SENTINEL_METRIC, float(step), ts, step))
            for chunk in _chunks(batch, METRICS_PER_BATCH):
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

    def ui_base_url(self) -> str:
        """The MLflow UI's address: ``$MLFLOW_UI_URL``, else an http(s) tracking URI (a tracking
        server serves the UI too), else what ``mlflow ui --backend-store-uri <this store>``
        serves by default (http://127.0.0.1:5000)."""
        base = os.environ.get("MLFLOW_UI_URL")
        if not base and self.tracking_uri.startswith(("http://", "https://")):
            base = self.tracking_uri
        return (base or "http://127.0.0.1:5000").rstrip("/")

    def run_url(self, run_id: str) -> str:
        """Link to the run's page in the MLflow UI."""
        return f"{self.ui_base_url()}/#/experiments/{self.experiment_id}/runs/{run_id}?{UI_MODE}"

    def experiment_url(self) -> str:
        """Link to the experiment's run list, in the saved view with the headline columns."""
        return f"{self.ui_base_url()}/#/experiments/{self.experiment_id}/runs?viewStateShareKey={VIEW_KEY}&{UI_MODE}"

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
        from nitro import plots  # matplotlib only when a run ends

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
                self.client.set_tag(run_id, TAG_CHECKPOINT, _tag_value(pointer))
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

        from nitro.policy_model import save_policy_model

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
