"""The one function every backend runs: an event's ``kind`` says what it is.

``"gradient"`` is a learner function's job (``nitro.stellaris.function.run_gradient``),
``"gradient-lane"`` a lane of them in one invocation (``run_lane``); anything
else is an actor's event (``nitro.actors.worker.run_actor``). One image, one worker pool and one
Lambda function serve both, so a round's actors and learner functions share warm instances.
"""

from __future__ import annotations

from typing import Any

from nitro.actors.events import ActorSummary
from nitro.actors.worker import ActorState, run_actor


def run_function(event: Any, state: ActorState | None = None, *, memory_mb: int | None = None) -> ActorSummary:
    kind = event.get("kind") if isinstance(event, dict) else getattr(event, "kind", None)
    if kind == "gradient":
        from nitro.stellaris.function import run_gradient

        return run_gradient(event, state, memory_mb=memory_mb)
    if kind == "gradient-lane":
        from nitro.stellaris.function import run_lane

        return run_lane(event, state, memory_mb=memory_mb)
    return run_actor(event, state, memory_mb=memory_mb)
