"""Boosting detection: the Hessian ratio R on a subset of what the learner last trained on."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.run.engine import LatestUpdate
from nitro.run.runtime import get_run
from nitro.run.updates import UpdateReport
from nitro.scaling.detector import Detection


@task(name="detect-boosting", cache_policy=NO_CACHE)
def detect_boosting(run_id: str, k: int, update: UpdateReport | LatestUpdate) -> Detection | None:
    """``update``: the update this round made, or ``LatestUpdate()`` off-policy."""
    return get_run(run_id).training.detect_boosting(k, update)
