"""The interface every actor backend implements: local processes (``nitro.actors.local``), AWS
Lambda (``nitro.actors.lambda_``) and Ray (``nitro.actors.ray_``).

A backend runs the run's one function (``nitro.run.functions.run_function``: an actor's rollout
or a learner function's gradient job) wherever its workers live, and reports every failure as
``ActorSummary.failed``, never by raising.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from nitro.actors.events import ActorEvent, ActorSummary


class ActorBackend(Protocol):
    def launch(self, events: Iterable[ActorEvent | dict[str, Any]]) -> int:
        """Start every invocation at once where the backend can (Lambda and Ray: returns once all
        requests have left the client; ``invoke`` then hands back each one's answer); returns how
        many it started, 0 where each invocation starts in its own ``invoke`` (local processes)."""
        ...

    def invoke(self, event: ActorEvent | dict[str, Any]) -> ActorSummary:
        """One invocation's answer (that of a launched one, if it was launched)."""
        ...

    def invoke_many(self, events: Iterable[ActorEvent | dict[str, Any]]) -> list[ActorSummary]:
        """Every invocation's answer, in order."""
        ...

    def close(self) -> None:
        """Stop what the backend started; its workers never outlive it."""
        ...
