"""Actor functions for the local-pool tests, run inside worker processes
(``actor_fn="tests.support.actor_helpers:..."``).

``scripted`` behaves by the event's seed: 1 segfaults, 2 exits with os._exit(3), 3 hangs, 4 raises,
5 kills its own process with SIGKILL (as the kernel's OOM killer does), anything else answers at
once. A successful summary carries the worker pid and how many invocations that process's state
has served in ``batch_key`` (``pid:<pid>:<count>``).
"""

from __future__ import annotations

import ctypes
import os
import signal
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
    elif seed == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(event.get("n_steps", 1) / 1e5)
    state.invocations += 1
    return ActorSummary(invocation_id=event["invocation_id"], ok=True, steps=event["n_steps"],
                        batch_key=f"pid:{os.getpid()}:{state.invocations}")


def where(event: dict, state) -> ActorSummary:
    """Answers after ``n_steps`` milliseconds with the Ray node and worker pid it ran on in
    ``batch_key`` (``node:<node id>:<pid>``): for placement tests on a Ray cluster."""
    import ray

    time.sleep(event.get("n_steps", 1) / 1000)
    node = ray.get_runtime_context().get_node_id()
    return ActorSummary(invocation_id=event["invocation_id"], ok=True, steps=event["n_steps"],
                        batch_key=f"node:{node}:{os.getpid()}")


def gradient_killed_mid_compute(event: dict, state) -> ActorSummary:
    """The real learner function (``nitro.stellaris.function.run_gradient``), whose process is
    SIGKILLed once the job has read and decoded its inputs, as its forward-backward starts: a Ray
    worker (or a machine) lost mid-gradient, with nothing written."""
    import nitro.stellaris.gradient as gradient
    from nitro.stellaris.function import run_gradient

    def dying(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    gradient.slice_gradient = dying
    return run_gradient(event, state)
