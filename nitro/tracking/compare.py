"""A table of Nitro runs from MLflow: what ``nitro compare`` prints.

Each row comes from one MLflow run logged by ``nitro.tracking.tracker.RunTracker``: identity from its
tags (``env``, ``algo``, ``scaler``, ``seed``; falling back to the params ``env_id``, ``algo``,
``scaler.name``, ``seed``), progress and results from its latest metrics (``round``,
``eval_return_mean``, ``spend_total_usd``). The same tags, params and metrics are what the MLflow UI's
compare view lines up, so the table and the UI agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from mlflow.entities import Run, ViewType
from mlflow.tracking import MlflowClient

from nitro.tracking.store import sqlite_path
from nitro.tracking.tracker import (
    SENTINEL_METRIC,
    TAG_MACHINE,
    TAG_RUN_ID,
    TrackingError,
    normalize_tracking_uri,
)

__all__ = ["COLUMNS", "PRETRAIN_COLUMNS", "columns_for", "compare_runs", "format_table"]

# (row key, header)
COLUMNS: tuple[tuple[str, str], ...] = (
    ("run_name", "run"),
    ("env", "env"),
    ("algo", "algo"),
    ("scaler", "scaler"),
    ("seed", "seed"),
    ("rounds_done", "rounds"),
    ("final_return", "final eval return"),
    ("total_spend_usd", "spend USD"),
    ("status", "status"),
    ("mlflow_run_id", "mlflow run id"),
)

# A MinionsRL run's scheduler was pre-trained before the run (nitro/scaling/minionsrl/pretrain.py); its
# record, carried in the run's tags, sits beside the run's own spend and env steps.
PRETRAIN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("env_steps_total", "env steps"),
    ("pretrain_episodes", "pretrain episodes"),
    ("pretrain_env_steps", "pretrain env steps"),
    ("pretrain_usd", "pretrain USD (projected)"),
)
PRETRAIN_TAGS = {"pretrain_episodes": "minionsrl.pretrain_episodes",
                 "pretrain_env_steps": "minionsrl.pretrain_env_steps", "pretrain_usd": "minionsrl.pretrain_usd"}

_PARAM_FALLBACK = {"env": "env_id", "algo": "algo", "scaler": "scaler.name", "seed": "seed"}


def _q(value: str) -> str:
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _filter_clause(key: str, value: str) -> str:
    for prefix in ("tags.", "params.", "attributes."):
        if key.startswith(prefix):
            return f"{prefix}`{key[len(prefix):]}` = {_q(value)}"
    return f"tags.`{key}` = {_q(value)}"


def compare_runs(
    tracking_uri: str,
    experiment: str | None = None,
    tag_filters: Mapping[str, str] | None = None,
    *,
    include_unfinished: bool = True,
) -> list[dict[str, Any]]:
    """Rows for every Nitro run (one with a ``nitro.run_id`` tag) matching the filters.

    ``experiment``: an experiment name (None: all experiments). ``tag_filters``: ``{key: value}``
    ANDed; a bare key is a tag, ``params.x`` / ``attributes.x`` filter on those instead.
    Sorted by env, algo, scaler, seed, run name.
    """
    uri = normalize_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        raise TrackingError(f"no MLflow store at {db} (nothing has been tracked there yet)")
    client = MlflowClient(tracking_uri=uri)
    if experiment is None:
        exps = list(client.search_experiments(view_type=ViewType.ACTIVE_ONLY))
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            known = ", ".join(sorted(e.name for e in client.search_experiments())) or "none"
            raise TrackingError(f"unknown MLflow experiment {experiment!r}; known: {known}")
        exps = [exp]
    if not exps:
        return []
    names = {e.experiment_id: e.name for e in exps}
    filter_string = " and ".join(_filter_clause(k, v) for k, v in (tag_filters or {}).items())
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs(
            list(names),
            filter_string=filter_string,
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            break
    rows = [_row(client, r, names) for r in runs if TAG_RUN_ID in r.data.tags]
    if not include_unfinished:
        rows = [r for r in rows if r["status"] == "FINISHED"]
    rows.sort(key=lambda r: (str(r["env"]), str(r["algo"]), str(r["scaler"]), _seed_key(r["seed"]), str(r["run_name"])))
    return rows


def _seed_key(seed: Any) -> tuple[int, str]:
    try:
        return (int(seed), "")
    except (TypeError, ValueError):
        return (1 << 62, str(seed))


def _row(client: MlflowClient, run, experiment_names: Mapping[str, str]) -> dict[str, Any]:
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    row: dict[str, Any] = {
        "run_name": run.info.run_name or tags.get(TAG_RUN_ID),
        "nitro_run_id": tags.get(TAG_RUN_ID),
        "mlflow_run_id": run.info.run_id,
        "experiment": experiment_names.get(run.info.experiment_id, run.info.experiment_id),
    }
    for key, param in _PARAM_FALLBACK.items():
        row[key] = tags.get(key, params.get(param))
    last_round = metrics.get(SENTINEL_METRIC)
    row["rounds_done"] = int(last_round) + 1 if last_round is not None else 0
    row["rounds_limit"] = _int_or_none(params.get("rounds"))
    # The final return is the last evaluation's (whole episodes, mean action); rounds between
    # evaluations log NaN, so it is the last finite value.
    final = metrics.get("eval_return_mean")
    row["final_return"] = final if finite(final) else last_finite_metric(client, run.info.run_id, "eval_return_mean")
    row["total_spend_usd"] = metrics.get("spend_total_usd")
    row["env_steps_total"] = metrics.get("env_steps_total")
    row.update(pretrain_record(tags))
    row["status"] = run.info.status
    row["machine"] = tags.get(TAG_MACHINE)
    row["start_time"] = (
        datetime.fromtimestamp(run.info.start_time / 1000, tz=UTC).isoformat(timespec="seconds")
        if run.info.start_time
        else None
    )
    return row


def pretrain_record(tags: Mapping[str, str]) -> dict[str, Any]:
    """The pre-training a run's scheduler took, from its ``minionsrl.pretrain_*`` tags (None each
    for a run without one)."""
    return {"pretrain_episodes": _int_or_none(tags.get(PRETRAIN_TAGS["pretrain_episodes"])),
            "pretrain_env_steps": _int_or_none(tags.get(PRETRAIN_TAGS["pretrain_env_steps"])),
            "pretrain_usd": _finite_float(tags.get(PRETRAIN_TAGS["pretrain_usd"]))}


def last_finite_metric(client: MlflowClient, mlflow_run_id: str, key: str) -> float | None:
    """The value at the highest step whose value is finite (None if there is none)."""
    pts = [(m.step, m.timestamp, m.value) for m in client.get_metric_history(mlflow_run_id, key) if finite(m.value)]
    return float(max(pts)[2]) if pts else None


def finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _finite_float(v: Any) -> float | None:
    return float(v) if finite(v) else None


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if key in ("total_spend_usd", "pretrain_usd"):
            return f"{value:.4f}"
        if key == "env_steps_total":
            return f"{value:.0f}"
        return f"{value:.2f}"
    return str(value)


def columns_for(rows: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """``COLUMNS``, with the pre-training columns after the spend when any row used a pre-trained
    scheduler (a row without one shows "-" there)."""
    if not any(r.get("pretrain_usd") is not None for r in rows):
        return COLUMNS
    at = [k for k, _ in COLUMNS].index("total_spend_usd") + 1
    return COLUMNS[:at] + PRETRAIN_COLUMNS + COLUMNS[at:]


def format_table(rows: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """A fixed-width text table (or a Markdown table) of ``compare_runs`` rows."""
    columns = columns_for(rows)
    headers = [h for _, h in columns]
    cells = [[_fmt(k, r.get(k)) for k, _ in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    if not rows:
        return "no runs found"
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    numeric = {"seed", "rounds_done", "final_return", "total_spend_usd", *(k for k, _ in PRETRAIN_COLUMNS)}
    def line(vals: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if columns[i][0] in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))
        ).rstrip()
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    return "\n".join(out)
