"""Step 2 of a round: Hessian boosting detection on a subset of the round's trajectories."""

from dataclasses import asdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.runtime import get_run


@task(name="boosting-detection", cache_policy=NO_CACHE)
def detect_boosting(run_id: str, k: int) -> dict | None:
    detection = get_run(run_id).trainer.detect(k)
    return asdict(detection) if detection is not None else None
