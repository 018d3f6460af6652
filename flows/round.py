"""One training round as a Prefect flow of tasks:

    update policy -> detect boosting -> decide actors -> mapped actor invocations -> end round

(with actors on VMs, a decision that starts instances is followed by the learner's replay while
they boot, for ``vm-replay``; ``nitro.run.vm_replay``)

Each step's result is passed to the steps that use it, so the flow body is the round's data flow
and Prefect's graph shows it. The flow is ``async`` on purpose: Prefect's sync flow engine joins
its heartbeat thread on exit, which sleeps in 1 s steps and so costs about 1.1 s per round; the
async engine does not join (docs/decisions.md). The tasks themselves are plain sync functions.
"""

from __future__ import annotations

import threading
import time

from prefect import flow, unmapped

from nitro.run.engine import LatestUpdate, RoundReport
from nitro.run.updates import UpdateReport
from tasks.actors import collect_summaries, invoke_actor, launch_actors, plan_invocations, publish_weights
from tasks.bookkeeping import end_round
from tasks.detection import detect_boosting
from tasks.learner import learn_while_acting, update_policy
from tasks.scaling import decide_actors, replay_while_instances_start
from tasks.stellaris import apply_gradients, collect_lanes, plan_gradients, run_gradient_lane


@flow(name="nitro-round", flow_run_name="{run_id}-round-{k}", persist_result=False, validate_parameters=False)
async def training_round(run_id: str, k: int) -> RoundReport:
    """On-policy (PPO): learn from the last round's trajectories, then decide and act."""
    started = time.perf_counter()
    update = update_policy(run_id, k)
    detection = detect_boosting(run_id, k, update)
    decision = decide_actors(run_id, k, detection, update, started)
    if decision.instances_started:  # actors on VMs: vm-replay trains while they boot (nitro.run.vm_replay)
        replay_while_instances_start(run_id, k)

    weights_key = publish_weights(run_id, k)
    events = plan_invocations(run_id, k, decision, weights_key)
    acting = time.perf_counter()
    launch_actors(run_id, events)
    summaries = collect_summaries(events, invoke_actor.map(unmapped(run_id), events))
    actor_s = time.perf_counter() - acting

    return end_round(run_id, k, update, detection, decision, summaries, actor_s, time.perf_counter() - started)


@flow(name="nitro-round-async", flow_run_name="{run_id}-round-{k}", persist_result=False, validate_parameters=False)
async def asynchronous_round(run_id: str, k: int) -> RoundReport:
    """Off-policy (IMPACT): detection and the decision use the updates made so far; then the
    policy update runs *alongside* the actors, learning from each batch as it lands and replaying
    from the buffer while none has. The task timeline shows the overlap."""
    started = time.perf_counter()
    detection = detect_boosting(run_id, k, LatestUpdate())
    decision = decide_actors(run_id, k, detection, UpdateReport(), started)  # no update before the decision
    if decision.instances_started:
        replay_while_instances_start(run_id, k)

    weights_key = publish_weights(run_id, k)
    events = plan_invocations(run_id, k, decision, weights_key)
    acting = time.perf_counter()
    actors_done = threading.Event()
    learning = learn_while_acting.submit(run_id, k, events, actors_done)
    launch_actors(run_id, events)
    summaries = collect_summaries(events, invoke_actor.map(unmapped(run_id), events))
    actor_s = time.perf_counter() - acting
    actors_done.set()
    update = learning.result()

    return end_round(run_id, k, update, detection, decision, summaries, actor_s, time.perf_counter() - started)


@flow(name="nitro-round-stellaris", flow_run_name="{run_id}-round-{k}", persist_result=False, validate_parameters=False)
async def stellaris_round(run_id: str, k: int) -> RoundReport:
    """Stellaris: the actors and the learner functions run side by side. Each gradient job starts
    as soon as its batch has landed and its snapshot is published; the parameter server applies
    the gradients as they land and publishes new versions, which later jobs compute against. The
    graph shows the actor tasks and one task per learner function (a lane, running its jobs one
    after another) mapped beside the parameter server."""
    started = time.perf_counter()
    detection = detect_boosting(run_id, k, LatestUpdate())
    decision = decide_actors(run_id, k, detection, UpdateReport(), started)

    weights_key = publish_weights(run_id, k)
    events = plan_invocations(run_id, k, decision, weights_key)
    plan = plan_gradients(run_id, k, events, weights_key)
    acting = time.perf_counter()
    server = apply_gradients.submit(run_id, k, plan)
    launch_actors(run_id, events)
    actor_runs = invoke_actor.map(unmapped(run_id), events)
    lane_runs = run_gradient_lane.map(unmapped(run_id), unmapped(plan), list(range(plan.lanes)))
    summaries = collect_summaries(events, actor_runs)
    functions = collect_lanes(lane_runs)
    update = server.result()
    actor_s = time.perf_counter() - acting

    elapsed_s = time.perf_counter() - started
    return end_round(run_id, k, update, detection, decision, summaries, actor_s, elapsed_s, functions)
