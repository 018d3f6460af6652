"""The policy update: on the previous round's trajectories (on-policy), or beside the actors."""

import threading

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.actors.events import ActorEvent
from nitro.engine import UpdateReport
from nitro.runtime import get_run


@task(name="update-policy", cache_policy=NO_CACHE)
def update_policy(run_id: str, k: int) -> UpdateReport:
    return get_run(run_id).training.update_policy(k)


@task(name="learn-while-acting", cache_policy=NO_CACHE)
def learn_while_acting(run_id: str, k: int, events: list[ActorEvent], actors_done: threading.Event) -> UpdateReport:
    """Off-policy: update on each batch as it lands, replay while none has, until every batch is
    in or ``actors_done`` is set and nothing more came."""
    return get_run(run_id).training.learn_while_acting(k, [e.invocation_id for e in events], actors_done)
