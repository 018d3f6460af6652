"""Boosting detection: the Hessian ratio R on a subset of what the learner last trained on."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.detector import Detection
from nitro.engine import LatestUpdate, UpdateReport
from nitro.runtime import get_run


@task(name="detect-boosting", cache_policy=NO_CACHE)
def detect_boosting(run_id: str, k: int, update: UpdateReport | LatestUpdate) -> Detection | None:
    """``update``: the update this round made, or ``LatestUpdate()`` off-policy."""
    return get_run(run_id).training.detect_boosting(k, update)
