"""Step 3 of a round: how many actors it gets (scaler, capped by the remaining budget)."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.detector import Detection
from nitro.engine import Decision, UpdateReport
from nitro.runtime import get_run


@task(name="scaling-decision", cache_policy=NO_CACHE)
def decide_actors(run_id: str, k: int, detection: Detection | None, update: UpdateReport | None = None) -> Decision:
    return get_run(run_id).trainer.decide(k, detection, update)
