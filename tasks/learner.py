"""Step 1 of a round: update the policy on the trajectories in the cache."""

from dataclasses import asdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.runtime import get_run


@task(name="policy-update", cache_policy=NO_CACHE)
def update_policy(run_id: str, k: int) -> dict:
    report = get_run(run_id).trainer.update_policy(k)
    return asdict(report)


@task(name="policy-update-while-acting", cache_policy=NO_CACHE)
def learn_while_acting(run_id: str, k: int, invocation_ids: list[str]) -> dict:
    """Off-policy: update on each batch as it lands, replay while none has (paper §4)."""
    return asdict(get_run(run_id).trainer.learn_while_acting(k, invocation_ids))


@task(name="actors-finished", cache_policy=NO_CACHE)
def actors_finished(run_id: str) -> None:
    get_run(run_id).trainer.actors_finished()
