"""Step 4 of a round: publish the weights once, then one task run per actor invocation."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.runtime import get_run


@task(name="publish-weights", cache_policy=NO_CACHE)
def publish_weights(run_id: str, k: int) -> str:
    return get_run(run_id).trainer.publish_weights(k)


@task(name="plan-invocations", cache_policy=NO_CACHE)
def plan_invocations(run_id: str, k: int, n_actors: int, weights_key: str) -> list[dict]:
    events = get_run(run_id).trainer.actor_events(k, n_actors, weights_key)
    return [e.model_dump() for e in events]


# A retry is safe: the batch is stored with SET NX under the invocation id, so a second delivery
# never counts twice. Backends report actor failures as summaries; only unexpected errors raise.
@task(name="invoke-actor", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1,
      task_run_name="actor-{event[invocation_id]}")
def invoke_actor(run_id: str, event: dict) -> dict:
    summary = get_run(run_id).backend.invoke(ActorEvent.model_validate(event))
    return summary.model_dump()


def collect_summaries(events: list[dict], futures) -> list[ActorSummary]:
    """Wait for the mapped task runs; a task that failed for good is a failed invocation with
    its reason, never a failed round."""
    out = []
    for event, future in zip(events, futures):
        try:
            out.append(ActorSummary.model_validate(future.result()))
        except Exception as exc:
            out.append(ActorSummary.failed(event["invocation_id"], f"task failed: {type(exc).__name__}: {exc}"))
    return out
