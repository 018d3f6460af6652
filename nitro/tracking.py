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
The engine produces exactly these names; ``nitro.compare`` and ``nitro.plots`` read them::

    return_mean, return_max              mean / max episodic return of the round's finished episodes
    episodes                             finished episodes in the round
    env_steps, env_steps_total           env steps this round / cumulative
    actors_launched, actors_failed       actor invocations started / failed or missing
    boost_score                          the scaler's boosting score S_k (NaN: no score)
    hessian_R, lambda_max, lambda_min    detection output
    spend_round_usd, spend_total_usd     spend of the round / cumulative
    spend_learner_usd, spend_lambda_compute_usd, spend_requests_usd, spend_provisioned_usd
                                         the round's spend by ledger line
    learner_s, detection_s, actor_s, orchestration_s, round_s
                                         wall seconds of the round's parts and of the whole round
    ppo/<name>                           PPO diagnostics (e.g. ppo/kl, ppo/clip_frac, ppo/entropy)

``log_round`` adds one bookkeeping metric itself: ``round`` (value = step = round index). It is
the sentinel used to know which rounds are already logged; ``rounds done = last round + 1``.

Tags set on a new run: ``nitro.run_id``, ``env``, ``algo``, ``scaler``, ``seed``, ``backend``,
``nitro.cost_model`` (local backend: "local actors priced as Lambda"), ``prefect.flow_run_id``
and ``prefect.flow_run_url`` (when ``PREFECT_UI_URL`` is set), plus any caller tags (pass
``mlflow.parentRunId`` to nest a run under an experiment's parent run). On re-attach the
Prefect tags are updated to the current flow run and ``prefect.flow_run_ids`` keeps them all.

Artifacts: ``config/config.yaml`` at start; ``policy/policy.safetensors``,
``checkpoint/POINTER.txt`` (+ tag ``nitro.checkpoint_uri``) and ``plots/*.png`` at the end.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from nitro.config import NitroConfig

__all__ = [
    "CANONICAL_METRICS",
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
    "return_mean",
    "return_max",
    "episodes",
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
)
PPO_PREFIX = "ppo/"
SENTINEL_METRIC = "round"

TAG_RUN_ID = "nitro.run_id"
TAG_FLOW_RUN_ID = "prefect.flow_run_id"
TAG_FLOW_RUN_IDS = "prefect.flow_run_ids"
TAG_FLOW_RUN_URL = "prefect.flow_run_url"
TAG_COST_MODEL = "nitro.cost_model"
TAG_CHECKPOINT = "nitro.checkpoint_uri"
TAG_RUN_NAME = "mlflow.runName"
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

    # -- experiment / run lookup ------------------------------------------------------------

    def _ensure_experiment(self, name: str, artifact_root: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        try:
            location = f"{artifact_root}/{_clean_key(name).replace('/', '_')}" if artifact_root else None
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

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
    ) -> str:
        """Return the MLflow run id of this training run, creating the run only if none exists."""
        if not nitro_run_id:
            raise ValueError("nitro_run_id must be a non-empty string")
        with self._lock:
            run_id = self.find_run(nitro_run_id, prefect_flow_run_id)
            if run_id is not None:
                self._reattach(run_id, prefect_flow_run_id, nitro_run_id)
                return run_id
            run_id = self._create(prefect_flow_run_id, nitro_run_id, config, dict(tags or {}))
            # Two processes may have raced to create it: the oldest one wins, the other goes.
            runs = self._search(TAG_RUN_ID, nitro_run_id)
            if len(runs) > 1 and runs[0].info.run_id != run_id:
                self.client.delete_run(run_id)
                run_id = runs[0].info.run_id
                self._reattach(run_id, prefect_flow_run_id, nitro_run_id)
            self._logged_steps[run_id] = set()
            return run_id

    def _run_tags(
        self, prefect_flow_run_id: str | None, nitro_run_id: str, config: NitroConfig, extra: dict
    ) -> dict[str, str]:
        tags: dict[str, Any] = {
            TAG_RUN_ID: nitro_run_id,
            TAG_RUN_NAME: nitro_run_id,
            "env": config.env_id,
            "algo": config.algo,
            "scaler": config.scaler.name,
            "seed": config.seed,
            "backend": config.backend.kind,
        }
        if config.backend.kind == "local":
            tags[TAG_COST_MODEL] = LOCAL_COST_MODEL
        if prefect_flow_run_id:
            tags.update(self._prefect_tags(prefect_flow_run_id, [prefect_flow_run_id]))
        tags.update(extra)
        return {_clean_key(k): _tag_value(v) for k, v in tags.items() if v is not None}

    @staticmethod
    def _prefect_tags(flow_run_id: str, all_ids: list[str]) -> dict[str, str]:
        tags = {TAG_FLOW_RUN_ID: flow_run_id, TAG_FLOW_RUN_IDS: ",".join(all_ids)}
        ui = os.environ.get("PREFECT_UI_URL")
        if ui:
            tags[TAG_FLOW_RUN_URL] = f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}"
        return tags

    def _create(
        self, prefect_flow_run_id: str | None, nitro_run_id: str, config: NitroConfig, extra: dict
    ) -> str:
        tags = self._run_tags(prefect_flow_run_id, nitro_run_id, config, extra)
        run = self.client.create_run(self.experiment_id, run_name=nitro_run_id, tags=tags)
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in params_from_config(config).items()]
        for chunk in _chunks(params, PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk, synchronous=True)
        self.client.log_text(run_id, config.dump_yaml(), "config/config.yaml")
        return run_id

    def _reattach(self, run_id: str, prefect_flow_run_id: str | None, nitro_run_id: str) -> None:
        run = self.client.get_run(run_id)
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        if prefect_flow_run_id and run.data.tags.get(TAG_FLOW_RUN_ID) != prefect_flow_run_id:
            ids = [i for i in run.data.tags.get(TAG_FLOW_RUN_IDS, "").split(",") if i]
            if prefect_flow_run_id not in ids:
                ids.append(prefect_flow_run_id)
            tags = self._prefect_tags(prefect_flow_run_id, ids)
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
        returned. None values are dropped; NaN/inf are logged as MLflow stores them.
        """
        step = int(round_idx)
        ts = int(time.time() * 1000)
        batch: list[Metric] = []
        for key, value in metrics.items():
            if value is None or key == SENTINEL_METRIC:
                continue
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"metric {key!r} at round {step} is not a number: {value!r}") from None
            batch.append(Metric(_clean_key(key), v, ts, step))
        batch.append(Metric(SENTINEL_METRIC, float(step), ts, step))
        with self._lock:
            steps = self._logged_steps.get(run_id)
            if steps is None:
                steps = self._logged_steps[run_id] = self._load_steps(run_id)
            if step in steps:
                return False
            for chunk in _chunks(batch, METRICS_PER_BATCH):
                self.client.log_batch(run_id, metrics=chunk, synchronous=True)
            steps.add(step)
        return True

    def round_rows(self, run_id: str, keys: Iterable[str] | None = None) -> list[dict[str, float]]:
        """Per-round rows rebuilt from the store (one query per metric), sorted by round."""
        run = self.client.get_run(run_id)
        wanted = list(keys) if keys is not None else sorted(run.data.metrics)
        rows: dict[int, dict[str, float]] = {}
        for key in wanted:
            for m in self.client.get_metric_history(run_id, key):
                rows.setdefault(int(m.step), {"round": int(m.step)})[key] = m.value
        return [rows[k] for k in sorted(rows)]

    def run_url(self, run_id: str) -> str:
        """Link to the run in the MLflow UI: $MLFLOW_UI_URL, else an http(s) tracking URI, else
        the address ``mlflow ui --backend-store-uri <this store>`` serves (127.0.0.1:5000)."""
        base = os.environ.get("MLFLOW_UI_URL")
        if not base and self.tracking_uri.startswith(("http://", "https://")):
            base = self.tracking_uri
        base = (base or "http://127.0.0.1:5000").rstrip("/")
        return f"{base}/#/experiments/{self.experiment_id}/runs/{run_id}"

    # -- end of run -------------------------------------------------------------------------

    def log_final(
        self,
        run_id: str,
        policy_bytes: bytes | None,
        checkpoint_dir_or_uri: str | os.PathLike | None,
        round_rows: list[dict[str, Any]] | None,
        status: str = "FINISHED",
    ) -> dict[str, str]:
        """Final policy, checkpoint pointer, PNG plots; then end the run with ``status``.

        ``round_rows=None`` rebuilds the rows from the run's metric history. Returns the artifact
        paths written (relative to the run's artifact root).
        """
        from nitro import plots  # matplotlib only when a run ends

        written: dict[str, str] = {}
        with self._lock, tempfile.TemporaryDirectory(prefix="nitro-final-") as tmp:
            root = Path(tmp)
            if policy_bytes is not None:
                (root / "policy").mkdir()
                (root / "policy" / "policy.safetensors").write_bytes(bytes(policy_bytes))
                written["policy"] = "policy/policy.safetensors"
            if checkpoint_dir_or_uri is not None:
                pointer = str(checkpoint_dir_or_uri)
                if "://" not in pointer:
                    pointer = str(Path(pointer).expanduser().resolve())
                (root / "checkpoint").mkdir()
                (root / "checkpoint" / "POINTER.txt").write_text(
                    f"Round checkpoints of this run live at:\n{pointer}\n"
                    "Resume with: nitro resume <nitro run id>\n"
                )
                self.client.set_tag(run_id, TAG_CHECKPOINT, _tag_value(pointer))
                written["checkpoint"] = "checkpoint/POINTER.txt"
            rows = round_rows if round_rows is not None else self.round_rows(run_id)
            if rows:
                (root / "plots").mkdir()
                for name, path in plots.write_run_plots(rows, root / "plots").items():
                    written[f"plot_{name}"] = f"plots/{Path(path).name}"
            if written:
                self.client.log_artifacts(run_id, str(root))
            self.client.set_terminated(run_id, status=status)
        return written

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """End the run without final artifacts (e.g. FAILED or KILLED)."""
        self.client.set_terminated(run_id, status=status)
