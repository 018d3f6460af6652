"""A run's Prefect artifacts: one of each kind per flow run, under a stable key, updated in place.

Why in place: the flow run page is where a user watches a run. A table artifact created once at
the end showed nothing while the run ran and nothing at all for a crashed run; created again on
each retry, the progress and MLflow-link artifacts piled up (issue 12). So each artifact is
created the first time and PATCHed afterwards; the key's latest version is always the live state.
A retried flow run (same flow-run id, new process) finds its artifacts again by key and flow run.

The artifacts are attached to the flow run itself (no task run), so the run's Artifacts tab
names the flow run, not a task of it.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Literal
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

ArtifactType = Literal["table", "progress", "markdown"]

_IDS: dict[tuple[str, str], UUID] = {}  # (flow run id, key) -> artifact id, for this process
_LOCK = threading.Lock()


def artifact_key(kind: str, run_id: str) -> str:
    """``nitro-<kind>-<run id>`` in the characters Prefect allows (lowercase, digits, dashes)."""
    slug = "".join(c if c.isalnum() else "-" for c in run_id.lower()).strip("-")
    return f"nitro-{kind}-{slug}"[:100]


def upsert_artifact(flow_run_id: str | UUID, key: str, type_: ArtifactType, data: Any, description: str) -> UUID:
    """Create the flow run's artifact ``key``, or update the one it already has; return its id."""
    flow_run_id = UUID(str(flow_run_id))
    payload = _encode(type_, data)
    with _LOCK, get_client(sync_client=True) as client:
        artifact_id = _IDS.get((str(flow_run_id), key))
        if artifact_id is None:
            found = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                                               flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
                limit=1,
            )
            artifact_id = found[0].id if found else None
        if artifact_id is None:
            artifact_id = client.create_artifact(ArtifactCreate(
                type=type_, key=key, description=description, data=payload, flow_run_id=flow_run_id)).id
        else:
            client.update_artifact(artifact_id, ArtifactUpdate(data=payload, description=description))
        _IDS[(str(flow_run_id), key)] = artifact_id
        return artifact_id


def _encode(type_: ArtifactType, data: Any) -> Any:
    """What Prefect's own ``create_*_artifact`` would store: tables as JSON text (NaN as null,
    which JSON lacks), progress as a float, Markdown as text."""
    if type_ == "table":
        return json.dumps([{k: _json_number(v) for k, v in row.items()} for row in data])
    if type_ == "progress":
        return float(data)
    return str(data)


def _json_number(value: Any) -> Any:
    """NaN/inf -> null; whole numbers (counts, the round) as ints; the rest to 4 decimals."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return int(value) if value.is_integer() else round(value, 4)
    return value
