"""Migrated databases made once per test session and copied where a test needs a new one.

A new Prefect database migrates for ~8 CPU-seconds and a new MLflow store for ~2; the suite makes
dozens of them (every `prefect server`, every `nitro` command with its own temporary API, every
`nitro` run in a new home). The first test that needs one migrates it, under a file lock shared by
the session's pytest-xdist workers (``SHARED``, set by tests/conftest.py); the others copy it.
Copies start from the same schema a user's first run creates.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from filelock import FileLock

from tests.support.servers import PREFECT, base_env

SHARED = Path(os.environ["NITRO_TESTS_SHARED"])  # one folder for the session, made by tests/conftest.py


def _template(name: str, make) -> Path:
    """``SHARED/<name>``, made by ``make(folder)`` the first time any worker asks."""
    done = SHARED / name
    with FileLock(str(SHARED / f"{name}.lock"), timeout=300):
        if not done.exists():
            tmp = SHARED / f"{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            make(tmp)
            os.replace(tmp, done)
    return done


def _migrate_prefect(folder: Path) -> None:
    done = subprocess.run([PREFECT, "--no-prompt", "server", "database", "upgrade", "-y"],
                          env={**base_env(), "PREFECT_HOME": str(folder)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and (folder / "prefect.db").exists(), done.stdout + done.stderr


def _migrate_mlflow(folder: Path) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db").search_experiments()  # runs the migrations


def _copy(template: Path, path: Path) -> Path:
    """``template`` copied to ``path`` (a file), unless a database is there already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        shutil.copyfile(template, path)
    return path


def prefect_db(path: Path) -> Path:
    """A migrated Prefect SQLite database at ``path`` (a file)."""
    return _copy(_template("prefect", _migrate_prefect) / "prefect.db", path)


def prefect_home(path: Path) -> Path:
    """``path`` as a PREFECT_HOME whose database (``prefect.db``) is already migrated."""
    prefect_db(path / "prefect.db")
    return path


def mlflow_db(path: Path) -> Path:
    """A migrated MLflow SQLite store at ``path`` (a file), unless one is there already."""
    return _copy(_template("mlflow", _migrate_mlflow) / "mlflow.db", path)


def nitro_home(path: Path) -> Path:
    """``path`` as a new `nitro` home (``home=``) whose MLflow store is already migrated."""
    mlflow_db(path / "mlflow.db")
    return path
