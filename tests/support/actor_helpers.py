"""Actor functions for the local-pool tests, run inside worker processes (``actor_fn="tests.support.actor_helpers:..."``).

``scripted`` behaves by the event's seed: 1 segfaults, 2 exits with os._exit(3), 3 hangs, 4 raises,
anything else answers at once. A successful summary carries the worker pid in ``batch_key``.
"""

from __future__ import annotations

import ctypes
import os
import time

from nitro.actors.events import ActorSummary


def scripted(event: dict, state) -> ActorSummary:
    seed = event["seed"]
    if seed == 1:
        ctypes.string_at(0)  # SIGSEGV
    elif seed == 2:
        os._exit(3)
    elif seed == 3:
        time.sleep(3600)
    elif seed == 4:
        raise RuntimeError("boom in the actor")
    time.sleep(event.get("n_steps", 1) / 1e5)
    return ActorSummary(invocation_id=event["invocation_id"], ok=True, steps=event["n_steps"], batch_key=f"pid:{os.getpid()}")
