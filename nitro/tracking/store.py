"""Where the MLflow tracking store is: its URI, and what a local store needs before first use.

The default store is ``sqlite:///<home>/mlflow.db``, with artifacts next to the database; MLflow
refuses the ``./mlruns`` file store unless ``MLFLOW_ALLOW_FILE_STORE=true`` (docs/decisions.md,
MLflow).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from nitro.config import NitroConfig

__all__ = ["TrackingError", "default_tracking_uri", "ensure_store", "normalize_tracking_uri", "sqlite_path"]


class TrackingError(RuntimeError):
    """The tracking store can't be used; the message is one line and says what to do."""


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


def sqlite_path(uri: str) -> Path | None:
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


def ensure_store(uri: str) -> tuple[str, str | None]:
    """Create what a local store needs; return (uri, artifact root for new experiments)."""
    db = sqlite_path(uri)
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
