"""Shared set-up for the benchmarks: a private Prefect home, MLflow store and run home per run."""

from __future__ import annotations

import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def isolated_home(name: str) -> Path:
    """A fresh temporary home, with Prefect pointed into it; call before importing flows."""
    sys.path.insert(0, str(ROOT))
    home = Path(tempfile.mkdtemp(prefix=f"nitro-bench-{name}-"))
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nitro").setLevel(logging.INFO)
    return home


def run_overrides(home: Path) -> list[str]:
    return [f"home={home}", f"tracking.mlflow_uri=sqlite:///{home}/mlflow.db"]


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}
