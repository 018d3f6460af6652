"""Crash points: the places between the steps of a round where the fault suite
(tests/test_faults.py) kills a real run, so that each can be tested by hand and by CI.

``NITRO_CRASH_AT=<point>:<round>`` (e.g. ``after-update:2``) makes the process SIGKILL itself when
round ``<round>`` reaches ``<point>``: no handler runs, no file is closed, nothing is flushed, as
with an OOM kill or a lost machine. ``NITRO_PAUSE_AT=<point>:<round>[,...]`` holds the process at
each point named instead (it says so on stderr), for a signal sent at exactly that moment or for a
server to be stopped or started between two rounds; with ``NITRO_RELEASE_DIR`` set, a hold ends
when a file named like the point (``after-checkpoint:3``) appears in that folder. Unset (always,
outside the fault suite), each point is two dictionary lookups.
"""

from __future__ import annotations

import os
import signal
import time

CRASH_ENV = "NITRO_CRASH_AT"
PAUSE_ENV = "NITRO_PAUSE_AT"
RELEASE_ENV = "NITRO_RELEASE_DIR"
HOLD_S = 900.0
POINTS = ("after-update", "after-actors", "after-end-round", "mid-checkpoint", "after-checkpoint")


def crash_point(point: str, round_idx: int) -> None:
    """Die here, at once, if ``NITRO_CRASH_AT`` names this point and round; hold here if
    ``NITRO_PAUSE_AT`` does, until released (the module docstring) or killed."""
    here = f"{point}:{round_idx}"
    if os.environ.get(CRASH_ENV) == here:
        os.kill(os.getpid(), signal.SIGKILL)
    pauses = os.environ.get(PAUSE_ENV)
    if pauses and here in pauses.split(","):
        os.write(2, f"nitro: paused at {here}\n".encode())
        release = os.environ.get(RELEASE_ENV)
        deadline = time.monotonic() + HOLD_S
        while not (release and os.path.exists(os.path.join(release, here))):  # or a signal ends the process
            if time.monotonic() > deadline:  # a test that forgot its process: it dies as a kill would
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
