"""Faults injected into a training run, for the tests of resume and of a run's live state.

``install`` wraps ``TrainingRun.end_round`` so that round ``fail_at`` fails once per run, or round
``hang_at`` is held once per run inside its round subflow; a marker file in the run directory
makes the retry pass. In-process tests call it through the ``inject_faults`` fixture. A run in a
Prefect worker's flow-run process takes its faults from its home folder, where the test ``plant``s
them: a worker started with ``worker_env`` (whose ``PYTHONPATH`` puts
``faults_site/sitecustomize.py`` first) installs ``install_planted`` in every process it starts,
so one worker serves runs with different faults and runs with none.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

SITE = Path(__file__).resolve().parent / "faults_site"
ENABLED = "NITRO_TEST_FAULTS"  # set by worker_env: sitecustomize installs install_planted
PLANTED = "nitro-test-faults.json"  # in a run's home: {"fail_at": k or null, "hang_at": k or null}


def install(fail_at: int | None = None, hang_at: int | None = None, hang_s: float = 600.0):
    """Wrap ``TrainingRun.end_round``; returns the original, to put back."""
    return _wrap(lambda run: (fail_at, hang_at), hang_s)


def _wrap(faults_of: Callable, hang_s: float = 600.0):
    """Wrap ``TrainingRun.end_round`` with the faults ``faults_of(run)`` says: (fail_at, hang_at)."""
    from nitro.run.engine import TrainingRun
    from nitro.run.rundir import RunDir

    original = TrainingRun.end_round

    def end_round(self, k, *args, **kwargs):
        fail_at, hang_at = faults_of(self)
        if k == fail_at:
            marker = RunDir(self.config.home, self.run_id).path / f"injected-failure-round-{k}"
            if not marker.exists():
                marker.touch()
                raise RuntimeError(f"injected failure in round {k}")
        if k == hang_at:
            marker = RunDir(self.config.home, self.run_id).path / f"injected-hang-round-{k}"
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


def plant(home: Path, *, fail_at: int | None = None, hang_at: int | None = None) -> None:
    """The faults of every run whose config's ``home`` is ``home``, in a process from ``worker_env``."""
    home.mkdir(parents=True, exist_ok=True)
    (home / PLANTED).write_text(json.dumps({"fail_at": fail_at, "hang_at": hang_at}))


def install_planted() -> None:
    def planted(run) -> tuple[int | None, int | None]:
        try:
            faults = json.loads((Path(run.config.home) / PLANTED).read_text())
        except OSError:
            return None, None
        return faults["fail_at"], faults["hang_at"]

    _wrap(planted)


def worker_env(env: dict) -> dict:
    """``env`` for a process whose Python children install the planted faults at start-up."""
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p),
                **{ENABLED: "1"})
