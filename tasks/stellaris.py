"""Stellaris's learner side (``nitro.run.updates.StellarisUpdate``): plan the round's gradient jobs,
run them lane by lane on the round's learner functions (one task per lane, not per job: a boosted
round's hundreds of jobs would otherwise be as many task runs in the parameter server's process),
and the parameter server that applies their gradients as they land."""

import logging

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.run.runtime import get_run
from nitro.run.updates import StellarisUpdate, UpdateReport
from nitro.stellaris.round import GradientPlan

log = logging.getLogger("nitro")


@task(name="plan-gradients", cache_policy=NO_CACHE)
def plan_gradients(run_id: str, k: int, events: list[ActorEvent], weights_key: str) -> GradientPlan:
    return get_run(run_id).training.mode_as(StellarisUpdate).plan(k, events, weights_key)


@task(name="apply-gradients", cache_policy=NO_CACHE)
def apply_gradients(run_id: str, k: int, plan: GradientPlan) -> UpdateReport:
    """The parameter server: each gradient in the schedule's order, each new version published."""
    return get_run(run_id).training.mode_as(StellarisUpdate).serve(k, plan)


# No retry: a job's gradient is written once (SET NX); a failed job is a lost slice, by rule.
@task(name="gradient-lane", cache_policy=NO_CACHE, task_run_name="gradient-lane-{lane}")
def run_gradient_lane(run_id: str, plan: GradientPlan, lane: int) -> list[ActorSummary]:
    """One learner function's jobs, one after another, each once its batch has landed and its
    snapshot is published (or, measured, once the job ahead of it has started)."""
    run = get_run(run_id)
    return run.training.mode_as(StellarisUpdate).run_lane(plan, lane, run.backend)


def collect_lanes(futures: list[PrefectFuture]) -> list[ActorSummary]:
    """Every job's answer, lane by lane. A lane answers each of its jobs to the parameter server as
    it goes and never raises for one; a lane task that failed for good is logged, and its jobs that
    never answered are lost at the server's deadline."""
    out = []
    for lane, future in enumerate(futures):
        try:
            out.extend(future.result())
        except Exception as exc:
            log.error("gradient lane %d failed: %s: %s", lane, type(exc).__name__, exc)
    return out
