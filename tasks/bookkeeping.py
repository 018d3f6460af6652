"""End of a round: the ledger and metrics, then the checkpoint, MLflow and the Prefect artifacts
(updated after every round, so the flow run page shows the live state); and, on resume, the
tidying of what a killed attempt left behind in Prefect."""

from __future__ import annotations

import logging

from prefect import runtime, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterName,
    FlowRunFilterState,
    FlowRunFilterStateType,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.states import Crashed

from nitro.actors.events import ActorSummary
from nitro.run.engine import Decision, RoundReport
from nitro.run.failures import component_of, one_line
from nitro.run.runtime import RunContext, checkpoint_run, get_run, notify_round
from nitro.run.updates import UpdateReport
from nitro.scaling.detector import Detection
from nitro.tracking.metrics import round_line
from tasks import background
from tasks.artifacts import artifact_key, upsert_artifact

log = logging.getLogger("nitro")

# The columns of the flow run's round table (round first: 0-based, like everywhere else).
TABLE_COLUMNS = ("round", "actors_launched", "actors_wanted", "actors_failed", "env_steps", "eval_return_mean",
                 "train_return_mean", "hessian_R", "boost_score", "spend_round_usd", "spend_total_usd", "round_s")
# The round table holds the newest rounds only. Prefect sends the whole table with each update,
# inside an event of at most 1.5 MB, which a table of ~4,700 rounds outgrows: the update then raised
# EventTooLarge and failed the run, at the same round again on resume. Its cost grew with it too
# (one update: ~20 ms with 100 rows, ~150 ms with 4,000, on a 2-core host). MLflow holds every round.
TABLE_ROWS = 100
# States a run can be left in by a process that was killed (all but the final ones).
UNFINISHED = [StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.PAUSED, StateType.CANCELLING]


@task(name="end-round", cache_policy=NO_CACHE)
def end_round(run_id: str, k: int, update: UpdateReport, detection: Detection | None, decision: Decision,
              summaries: list[ActorSummary], actor_s: float, elapsed_s: float,
              functions: list[ActorSummary] | None = None) -> RoundReport:
    return get_run(run_id).training.end_round(k, update, detection, decision, summaries, actor_s, elapsed_s, functions)


@task(name="record-round", cache_policy=NO_CACHE)
def record_round(run_id: str, report: RoundReport, round_s: float) -> RoundReport:
    """Add the round's wall time (``round_s``, around its whole flow), log it to MLflow, and
    checkpoint it; returns the round's report with its final timings.

    The checkpoint comes first: a crash before it redoes the whole round on resume; MLflow then
    logs every checkpointed round it lacks, so a crash between the two loses no record and
    MLflow's per-step de-duplication keeps a re-run round from logging a value twice."""
    ctx = get_run(run_id)
    report = ctx.training.record_round(report, round_s)
    checkpoint_run(ctx.training.run_dir, report.round, ctx.training, ctx.lease)
    if ctx.tracker is not None:  # off the critical path, in order (tasks/background.py)
        ctx.mlflow_tags.update({f"nitro.{key}": value[:5000] for key, value in report.tags.items()})
        if not ctx.mlflow_queued:  # one catch-up waits at a time: a store that is down does not pile them up
            ctx.mlflow_queued = True
            background.submit(run_id, catch_up_mlflow, ctx)
    log.info(round_line(report.round, report.metrics, ctx.config.rounds))
    notify_round(run_id, report)
    # In line, not in the background lane: two artifact writes racing the next round's subflow
    # start for the Prefect server's database make that start wait ~2 s in one round of two;
    # in line they cost two API calls (25-40 ms) and never overlap it (bench/orchestration_overhead.py).
    _publish_live_state(ctx)
    return report


def catch_up_mlflow(ctx: RunContext, final: bool = False) -> None:
    """Log to MLflow every checkpointed round it lacks, and the tags not yet logged (e.g. why a
    batch was dropped). A store that does not answer (a server or database that went away) does
    not stop the run: one line says so, and the records catch up once it answers again; at the
    end of the run (``final``) it fails the run with one line instead, and ``nitro resume`` logs
    the rest. Any other error fails the run."""
    ctx.mlflow_queued = False
    if ctx.tracker is None or ctx.mlflow_run_id is None:
        return
    ctx.lease.check()  # fenced: only the run's one writer logs its rounds
    try:
        # Only the rounds not logged yet: rebuilding every round's metrics only for log_round to
        # skip them grew with the history, and in this thread it held the GIL against the next
        # update (a Humanoid update took 0.47 s a round early in a 490-round run, 0.55 s late).
        done = ctx.tracker.logged_rounds(ctx.mlflow_run_id)
        logged = [row["round"] for row in list(ctx.training.history) if int(row["round"]) not in done
                  and ctx.tracker.log_round(ctx.mlflow_run_id, int(row["round"]),
                                            {k: v for k, v in row.items() if k != "round"})]
        for key in list(ctx.mlflow_tags):
            ctx.tracker.client.set_tag(ctx.mlflow_run_id, key, ctx.mlflow_tags.pop(key))
    except Exception as exc:
        if final or component_of(exc) != "MLflow store":
            raise
        if ctx.mlflow_down is None:
            log.warning("run %s: the MLflow store does not answer (%s); the run goes on and logs its rounds "
                        "once it answers again", ctx.run_id, one_line(exc))
        ctx.mlflow_down = one_line(exc)
        return
    if ctx.mlflow_down is not None:
        ctx.mlflow_down = None
        log.warning("run %s: the MLflow store answers again: caught up rounds %s", ctx.run_id,
                    f"{int(logged[0])}-{int(logged[-1])}" if logged else "(none missing)")


def _publish_live_state(ctx: RunContext) -> None:
    """The flow run's progress and round table, as of the round just checkpointed."""
    flow_run_id = runtime.flow_run.id
    if not flow_run_id:
        return
    rounds, done = ctx.config.rounds, ctx.training.next_round
    upsert_artifact(
        flow_run_id, artifact_key("progress", ctx.run_id), "progress", 100.0 * done / rounds,
        f"Nitro run {ctx.run_id}: {done} of {rounds} rounds done")
    rows = [{key: row.get(key) for key in TABLE_COLUMNS} for row in ctx.training.history[-TABLE_ROWS:]]
    upsert_artifact(flow_run_id, artifact_key("rounds", ctx.run_id), "table", rows,
                    f"Nitro run {ctx.run_id}: one row per round (rounds 0 to {rounds - 1}), updated after each; "
                    f"the newest {TABLE_ROWS} are shown, MLflow holds them all")


@task(name="tidy-previous-attempts", cache_policy=NO_CACHE)
def tidy_previous_attempts(run_id: str) -> list[str]:
    """Mark Crashed what an earlier attempt of this run left unfinished in Prefect; return the names
    of the round subflows it marked.

    A process killed in the middle of a round (kill -9, OOM, a lost machine) leaves its round
    subflow, and that subflow's tasks, "Running" forever: the worker crashes only the flow run it
    started. Call this before the first round of a resumed run: the round subflows are found by
    name (``<run id>-round-<k>``, which covers a Retry in the UI and ``nitro resume`` alike); the
    task runs are those of the orphaned subflows and of this flow run, whose own earlier attempt
    left them, except this task."""
    prefix = f"{run_id}-round-"
    unfinished = FlowRunFilterState(type=FlowRunFilterStateType(any_=UNFINISHED))
    message = "its process died; the run resumes from its last checkpoint"
    with get_client(sync_client=True) as client:
        orphans = [fr for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(like_=prefix), state=unfinished)) if fr.name.startswith(prefix)]
        for fr in orphans:
            client.set_flow_run_state(fr.id, Crashed(message=f"Round subflow {fr.name}: {message}"), force=True)
        owners = [fr.id for fr in orphans] + ([runtime.flow_run.id] if runtime.flow_run.id else [])
        stale = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=owners)),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED))),
        ) if owners else []
        for tr in stale:
            if str(tr.id) != str(runtime.task_run.id):
                client.set_task_run_state(tr.id, Crashed(message=f"Task run {tr.name}: {message}"), force=True)
    if orphans:
        log.info("run %s: marked %d orphaned round subflow(s) Crashed: %s", run_id, len(orphans),
                 ", ".join(fr.name for fr in orphans))
    return [fr.name for fr in orphans]
