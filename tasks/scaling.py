"""The scaling decision: how many actors a round gets (the scaler, capped by the remaining budget)."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.detector import Detection
from nitro.engine import Decision, UpdateReport
from nitro.runtime import get_run


@task(name="decide-actors", cache_policy=NO_CACHE)
def decide_actors(run_id: str, k: int, detection: Detection | None, update: UpdateReport, started: float) -> Decision:
    """``started``: the ``time.perf_counter()`` at which the round began, in this process."""
    return get_run(run_id).training.decide_actors(k, detection, update, started)
