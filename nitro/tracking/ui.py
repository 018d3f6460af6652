"""How Nitro's experiments and runs look in the MLflow UI, and how they link to Prefect.

The experiment is tagged ``mlflow.experimentKind=custom_model_development``: MLflow 3's UI
otherwise opens it on its GenAI overview (docs/decisions.md, MLflow). It also holds a saved view,
``mlflow.sharedViewState.nitro`` (where the UI's "Share" button stores views): the run list with
the headline metrics and the run's env/algo/scaler/seed as columns, since the UI's own default
shows no metric column. ``experiment_url`` opens that view; it and ``run_url`` also switch the UI
to its model-training mode (``UI_MODE``).

Each run links back to the Prefect flow run that trains it: the ``prefect.flow_run_*`` tags and
the run's description (Markdown in the UI). On re-attach they follow the current flow run, and
``prefect.flow_run_ids`` keeps every flow run that trained the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "TAG_FLOW_RUN_ID",
    "UI_MODE",
    "VIEW_KEY",
    "FlowRun",
    "env_flow_run_url",
    "experiment_tags",
    "experiment_url",
    "experiment_view_state",
    "prefect_tags",
    "reattach_prefect_tags",
    "run_url",
    "ui_base_url",
]

TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
VIEW_KEY = "nitro"
TAG_SHARED_VIEW = "mlflow.sharedViewState."  # + key
# MLflow 3's UI has a global GenAI / Model training switch (GenAI by default, remembered in the
# browser); this query parameter opens a link in model-training mode.
UI_MODE = "workflowType=machine_learning"
DEFAULT_UI = "http://127.0.0.1:5000"  # what `mlflow ui --backend-store-uri <store>` serves

TAG_FLOW_RUN_ID = "prefect.flow_run_id"
TAG_FLOW_RUN_IDS = "prefect.flow_run_ids"
TAG_FLOW_RUN_NAME = "prefect.flow_run_name"
TAG_FLOW_RUN_URL = "prefect.flow_run_url"
TAG_NOTE = "mlflow.note.content"  # the run's description in the UI (Markdown)


# -- the experiment's run list ----------------------------------------------------------------


def experiment_view_state(metric_keys: Iterable[str]) -> str:
    """The saved run-list view (JSON) that ``experiment_url`` opens: ``metric_keys`` and the run's
    identity tags as columns, newest runs first."""
    columns = [f"metrics.`{key}`" for key in metric_keys]
    columns += [f"tags.`{tag}`" for tag in ("env", "algo", "scaler", "seed")]
    columns += ["attributes.`Models`"]
    return json.dumps({"selectedColumns": columns, "columnOrder": columns, "orderByKey": "attributes.start_time",
                       "orderByAsc": False})


def experiment_tags(current: Mapping[str, str], metric_keys: Iterable[str]) -> dict[str, str]:
    """The experiment tags to set, given its ``current`` tags: the model-training kind unless
    someone chose a kind, and the saved view with ``metric_keys`` as columns unless it is there."""
    tags: dict[str, str] = {}
    if TAG_EXPERIMENT_KIND not in current:
        tags[TAG_EXPERIMENT_KIND] = MODEL_TRAINING_KIND
    view = experiment_view_state(metric_keys)
    if current.get(TAG_SHARED_VIEW + VIEW_KEY) != view:
        tags[TAG_SHARED_VIEW + VIEW_KEY] = view
    return tags


# -- links into the UI ------------------------------------------------------------------------


def ui_base_url(tracking_uri: str) -> str:
    """The MLflow UI's address: ``$MLFLOW_UI_URL``, else an http(s) tracking URI (a tracking
    server serves the UI too), else what ``mlflow ui`` serves by default."""
    base = os.environ.get("MLFLOW_UI_URL")
    if not base and tracking_uri.startswith(("http://", "https://")):
        base = tracking_uri
    return (base or DEFAULT_UI).rstrip("/")


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Link to the run's page in the MLflow UI."""
    return f"{ui_base_url(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}?{UI_MODE}"


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """Link to the experiment's run list, in the saved view."""
    return f"{ui_base_url(tracking_uri)}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}&{UI_MODE}"


# -- links back to Prefect --------------------------------------------------------------------


@dataclass(frozen=True)
class FlowRun:
    """The Prefect flow run that trains a run, as far as it is known (all None outside Prefect)."""

    id: str | None
    name: str | None = None
    url: str | None = None


def env_flow_run_url(flow_run_id: str | None) -> str | None:
    """The flow run's page from ``$PREFECT_UI_URL``, for callers that do not pass the URL."""
    ui = os.environ.get("PREFECT_UI_URL")
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None


def description(nitro_run_id: str, flow: FlowRun) -> str:
    """The run's description (Markdown in the MLflow UI): a link back to the Prefect flow run."""
    label = flow.name or flow.id
    where = f"[{label}]({flow.url})" if flow.url else f"`{label}`"
    return (f"Nitro run `{nitro_run_id}`, trained by the Prefect flow run {where}. "
            f"Resume it with that flow run's *Retry*, or `nitro resume {nitro_run_id}`.")


def prefect_tags(flow: FlowRun, nitro_run_id: str, all_ids: list[str]) -> dict[str, str]:
    """The tags that link a run to ``flow``, its current flow run; ``all_ids``: every flow run
    that has trained it."""
    if flow.id is None:
        raise ValueError("prefect_tags needs the flow run's id (its callers check that there is one)")
    tags = {TAG_FLOW_RUN_ID: flow.id, TAG_FLOW_RUN_IDS: ",".join(all_ids)}
    if flow.name:
        tags[TAG_FLOW_RUN_NAME] = flow.name
    if flow.url:
        tags[TAG_FLOW_RUN_URL] = flow.url
    tags[TAG_NOTE] = description(nitro_run_id, flow)
    return tags


def reattach_prefect_tags(known: Mapping[str, str], flow: FlowRun, nitro_run_id: str) -> dict[str, str]:
    """The Prefect tags to set when ``flow`` re-attaches to a run tagged ``known``: none when it is
    outside Prefect or already the run's flow run (same id, same URL)."""
    if not flow.id:
        return {}
    if known.get(TAG_FLOW_RUN_ID) == flow.id and (not flow.url or known.get(TAG_FLOW_RUN_URL) == flow.url):
        return {}
    ids = [i for i in known.get(TAG_FLOW_RUN_IDS, "").split(",") if i]
    if flow.id not in ids:
        ids.append(flow.id)
    return prefect_tags(flow, nitro_run_id, ids)
