"""Step 3 of a round: how many actors it gets (scaler, capped by the remaining budget)."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.runtime import get_run


@task(name="scaling-decision", cache_policy=NO_CACHE)
def decide_actors(run_id: str, k: int) -> int:
    return get_run(run_id).trainer.decide(k).n_actors
