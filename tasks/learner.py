"""Step 1 of a round: collect the previous round's trajectories and update the policy."""

from dataclasses import asdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.runtime import get_run


@task(name="policy-update", cache_policy=NO_CACHE)
def update_policy(run_id: str, k: int) -> dict:
    report = get_run(run_id).trainer.update_policy(k)
    return asdict(report)
