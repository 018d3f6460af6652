"""Step 2 of a round: Hessian boosting detection on a subset of the round's trajectories."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.detector import Detection
from nitro.engine import UpdateReport
from nitro.runtime import get_run


@task(name="boosting-detection", cache_policy=NO_CACHE)
def detect_boosting(run_id: str, k: int, update: UpdateReport | None = None) -> Detection | None:
    """``update``: the update this round made; None off-policy (the learner's latest update)."""
    return get_run(run_id).trainer.detect(k, update)
