"""Stellaris's learner side (``nitro.run.updates.StellarisUpdate``): plan the round's gradient jobs,
run each on a learner function, and the parameter server that applies their gradients as they land."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.run.runtime import get_run
from nitro.run.updates import StellarisUpdate, UpdateReport
from nitro.stellaris.jobs import GradientJob
from nitro.stellaris.round import GradientPlan


@task(name="plan-gradients", cache_policy=NO_CACHE)
def plan_gradients(run_id: str, k: int, events: list[ActorEvent], weights_key: str) -> GradientPlan:
    return get_run(run_id).training.mode_as(StellarisUpdate).plan(k, events, weights_key)


@task(name="apply-gradients", cache_policy=NO_CACHE)
def apply_gradients(run_id: str, k: int, plan: GradientPlan) -> UpdateReport:
    """The parameter server: each gradient in the schedule's order, each new version published."""
    return get_run(run_id).training.mode_as(StellarisUpdate).serve(k, plan)


# No retry: a job's gradient is written once (SET NX); a failed job is a lost slice, by rule.
@task(name="compute-gradient", cache_policy=NO_CACHE, task_run_name="gradient-{job.invocation_id}")
def compute_gradient(run_id: str, job: GradientJob) -> ActorSummary:
    """One job on a learner function, once its batch has landed and its snapshot is published."""
    run = get_run(run_id)
    return run.training.mode_as(StellarisUpdate).compute(job, run.backend)
