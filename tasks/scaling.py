"""The scaling decision: how many actors a round gets (the scaler, capped by the remaining budget),
and, with actors on VMs, what the learner does while the instances it starts boot."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.run.engine import Decision
from nitro.run.runtime import get_run
from nitro.run.updates import UpdateReport
from nitro.run.vm_replay import ReplayReport, replay_while_instances_start as replay_while
from nitro.scaling.detector import Detection


@task(name="decide-actors", cache_policy=NO_CACHE)
def decide_actors(run_id: str, k: int, detection: Detection | None, update: UpdateReport, started: float) -> Decision:
    """``started``: the ``time.perf_counter()`` at which the round began, in this process."""
    return get_run(run_id).training.decide_actors(k, detection, update, started)


@task(name="replay-while-instances-start", cache_policy=NO_CACHE)
def replay_while_instances_start(run_id: str, k: int) -> ReplayReport:
    """vm-replay: the learner trains on replayed batches while the decision's instances start."""
    return replay_while(get_run(run_id).training, k)
