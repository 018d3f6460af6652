"""The actors: publish the weights once, plan the invocations, then one task run per invocation."""

from collections.abc import Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.run.engine import Decision
from nitro.run.runtime import get_run
from nitro.stellaris.jobs import GradientJob


@task(name="publish-weights", cache_policy=NO_CACHE)
def publish_weights(run_id: str, k: int) -> str:
    """The policy's weights under round k's versioned key; returns the key."""
    return get_run(run_id).training.publish_weights(k)


@task(name="plan-invocations", cache_policy=NO_CACHE)
def plan_invocations(run_id: str, k: int, decision: Decision, weights_key: str) -> list[ActorEvent]:
    return get_run(run_id).training.plan_invocations(k, decision, weights_key)


@task(name="launch-actors", cache_policy=NO_CACHE)
def launch_actors(run_id: str, events: list[ActorEvent]) -> int:
    """Start every invocation of the round at once, where the backend can (Lambda: returns once
    all requests have left the client); each ``invoke-actor`` task then receives its invocation's
    summary. Without it, a round of 1000 actors would leave the client only as fast as Prefect
    starts task runs, one by one. Local actors are started by their tasks. Returns how many."""
    return get_run(run_id).backend.launch(events)


# A retry is safe: the batch is stored with SET NX under the invocation id, so a second delivery
# never counts twice. Backends report actor failures as summaries; only unexpected errors raise.
@task(name="invoke-actor", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1,
      task_run_name="actor-{event.invocation_id}")
def invoke_actor(run_id: str, event: ActorEvent) -> ActorSummary:
    return get_run(run_id).backend.invoke(event)


def collect_summaries(events: Sequence[ActorEvent | GradientJob], futures: list[PrefectFuture]) -> list[ActorSummary]:
    """Wait for the mapped task runs; a task that failed for good is a failed invocation with
    its reason, never a failed round."""
    out = []
    for event, future in zip(events, futures):
        try:
            out.append(future.result())
        except Exception as exc:
            out.append(ActorSummary.failed(event.invocation_id, f"task failed: {type(exc).__name__}: {exc}"))
    return out
