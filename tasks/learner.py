"""The policy update, in the run's update mode (``nitro.run.updates``): on the previous round's
trajectories before the decision (sync), or beside the actors (learn-while-acting)."""

import threading

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.actors.events import ActorEvent
from nitro.run.runtime import get_run
from nitro.run.updates import LearnWhileActing, SyncUpdate, UpdateReport


@task(name="update-policy", cache_policy=NO_CACHE)
def update_policy(run_id: str, k: int) -> UpdateReport:
    return get_run(run_id).training.mode_as(SyncUpdate).update(k)


@task(name="learn-while-acting", cache_policy=NO_CACHE)
def learn_while_acting(run_id: str, k: int, events: list[ActorEvent], actors_done: threading.Event) -> UpdateReport:
    """Off-policy: update on each batch as it lands, replay while none has, until every batch is
    in or ``actors_done`` is set and nothing more came."""
    mode = get_run(run_id).training.mode_as(LearnWhileActing)
    return mode.update(k, [e.invocation_id for e in events], actors_done)
