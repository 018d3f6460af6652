"""One training round as a Prefect flow of tasks (SPEC.md, paper §4 Fig. 6):

    policy update -> boosting detection -> scaling decision -> mapped actor invocations

The flow is ``async`` on purpose: Prefect's sync flow engine joins its heartbeat thread on exit,
which sleeps in 1 s steps, and that cost about 1.1 s per round; the async engine does not join.
The tasks themselves are plain sync functions.
"""

from __future__ import annotations

import time

from prefect import flow, unmapped

from tasks.actors import invoke_actor, plan_invocations, publish_weights, collect_summaries
from tasks.bookkeeping import end_round
from tasks.detection import detect_boosting
from tasks.learner import actors_finished, learn_while_acting, update_policy
from tasks.scaling import decide_actors


@flow(name="nitro-round", flow_run_name="{run_id}-round-{k}", persist_result=False, validate_parameters=False)
async def training_round(run_id: str, k: int) -> dict:
    update_policy(run_id, k)
    detect_boosting(run_id, k)
    n_actors = decide_actors(run_id, k)

    weights_key = publish_weights(run_id, k)
    events = plan_invocations(run_id, k, n_actors, weights_key)
    started = time.perf_counter()
    futures = invoke_actor.map(unmapped(run_id), events)
    summaries = collect_summaries(events, futures)
    actor_s = time.perf_counter() - started

    return end_round(run_id, k, [s.model_dump() for s in summaries], actor_s)


@flow(name="nitro-round-async", flow_run_name="{run_id}-round-{k}", persist_result=False, validate_parameters=False)
async def asynchronous_round(run_id: str, k: int) -> dict:
    """Off-policy (IMPACT): detection and scaling use the updates made so far; then the policy
    update runs *alongside* the actors, learning from each batch as it lands and replaying from
    the buffer while none has (paper §4). The task timeline shows the overlap."""
    detect_boosting(run_id, k)
    n_actors = decide_actors(run_id, k)

    weights_key = publish_weights(run_id, k)
    events = plan_invocations(run_id, k, n_actors, weights_key)
    started = time.perf_counter()
    learning = learn_while_acting.submit(run_id, k, [e["invocation_id"] for e in events])
    futures = invoke_actor.map(unmapped(run_id), events)
    summaries = collect_summaries(events, futures)
    actor_s = time.perf_counter() - started
    actors_finished(run_id)
    learning.result()

    return end_round(run_id, k, [s.model_dump() for s in summaries], actor_s)
