"""Faults injected into a training run, for the tests of resume and of a run's live state.

``install`` wraps ``TrainingRun.end_round`` so that round ``fail_at`` fails once per run, or round
``hang_at`` is held once per run inside its round subflow; a marker file in the run directory
makes the retry pass. In-process tests call it through the ``inject_faults`` fixture; a Prefect
worker gets it through ``worker_env``, whose ``PYTHONPATH`` puts ``faults_site/sitecustomize.py``
first, which installs the faults in every flow-run process from ``NITRO_TEST_*`` variables.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

SITE = Path(__file__).resolve().parent / "faults_site"
FAIL_AT = "NITRO_TEST_FAIL_AT_ROUND"
HANG_AT = "NITRO_TEST_HANG_AT_ROUND"
HANG_S = "NITRO_TEST_HANG_S"


def install(fail_at: int | None = None, hang_at: int | None = None, hang_s: float = 600.0):
    """Wrap ``TrainingRun.end_round``; returns the original, to put back."""
    from nitro.checkpoint import run_dir
    from nitro.engine import TrainingRun

    original = TrainingRun.end_round

    def end_round(self, k, *args, **kwargs):
        if k == fail_at:
            marker = run_dir(self.config.home, self.run_id) / f"injected-failure-round-{k}"
            if not marker.exists():
                marker.touch()
                raise RuntimeError(f"injected failure in round {k}")
        if k == hang_at:
            marker = run_dir(self.config.home, self.run_id) / f"injected-hang-round-{k}"
            if not marker.exists():
                marker.touch()
                logging.getLogger("nitro").info("run %s: holding round %d (injected hang)", self.run_id, k)
                deadline = time.monotonic() + hang_s
                while time.monotonic() < deadline:
                    time.sleep(0.5)
                raise RuntimeError(f"injected hang in round {k} was never interrupted")
        return original(self, k, *args, **kwargs)

    TrainingRun.end_round = end_round
    return original


def worker_env(env: dict, *, fail_at: int | None = None, hang_at: int | None = None) -> dict:
    """``env`` for a process whose Python children install these faults at start-up."""
    out = dict(env, PYTHONPATH=os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p))
    if fail_at is not None:
        out[FAIL_AT] = str(fail_at)
    if hang_at is not None:
        out[HANG_AT] = str(hang_at)
    return out


def install_from_env() -> None:
    fail_at, hang_at = os.environ.get(FAIL_AT), os.environ.get(HANG_AT)
    if fail_at is None and hang_at is None:
        return
    install(int(fail_at) if fail_at is not None else None, int(hang_at) if hang_at is not None else None,
            float(os.environ.get(HANG_S, "600")))
