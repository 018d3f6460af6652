"""Step 1 of a round: update the policy on the trajectories in the cache."""

import threading

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.actors.events import ActorEvent
from nitro.engine import UpdateReport
from nitro.runtime import get_run


@task(name="policy-update", cache_policy=NO_CACHE)
def update_policy(run_id: str, k: int) -> UpdateReport:
    return get_run(run_id).trainer.update_policy(k)


@task(name="policy-update-while-acting", cache_policy=NO_CACHE)
def learn_while_acting(run_id: str, k: int, events: list[ActorEvent], actors_done: threading.Event) -> UpdateReport:
    """Off-policy: update on each batch as it lands, replay while none has (paper §4), until
    every batch is in or ``actors_done`` is set and nothing more came."""
    return get_run(run_id).trainer.learn_while_acting(k, [e.invocation_id for e in events], actors_done)
