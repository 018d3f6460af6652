"""End of a round: the ledger and metrics, then the checkpoint, MLflow and Prefect artifacts."""

from __future__ import annotations

import logging

from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from nitro.actors.events import ActorSummary
from nitro.checkpoint import save_checkpoint
from nitro.engine import RoundReport, round_line
from nitro.runtime import get_run, notify_round

log = logging.getLogger("nitro")


@task(name="end-round", cache_policy=NO_CACHE)
def end_round(run_id: str, k: int, summaries: list[dict], actor_s: float) -> dict:
    trainer = get_run(run_id).trainer
    _maybe_inject_failure(run_id, k)
    report = trainer.end_round(k, [ActorSummary.model_validate(s) for s in summaries], actor_s)
    return {"round": report.round, "metrics": report.metrics, "stop_reason": report.stop_reason}


@task(name="record-round", cache_policy=NO_CACHE)
def record_round(run_id: str, k: int, round_wall_s: float) -> str | None:
    """Account the round's orchestration time, log it to MLflow, and checkpoint it.

    The checkpoint is written last: a crash before it redoes the whole round on resume, and
    MLflow's per-step de-duplication keeps that from logging a value twice."""
    ctx = get_run(run_id)
    trainer = ctx.trainer
    metrics = trainer.record_wall_time(k, round_wall_s)
    tracker, mlflow_run = ctx.extras.get("tracker"), ctx.extras.get("mlflow_run_id")
    if tracker is not None:
        tracker.log_round(mlflow_run, k, metrics)
    save_checkpoint(ctx.config.home, run_id, k, trainer.state_dict())
    report = RoundReport(k, metrics, trainer.stop_reason(metrics))
    line = round_line(report, ctx.config.rounds)
    log.info(line)
    notify_round(run_id, report)
    progress_id = ctx.extras.get("progress_artifact")
    done = 100.0 * (k + 1) / ctx.config.rounds
    if progress_id is None:
        ctx.extras["progress_artifact"] = create_progress_artifact(
            done, key=f"nitro-progress-{_slug(run_id)}", description=f"rounds done of {ctx.config.rounds}")
    else:
        update_progress_artifact(progress_id, done)
    return report.stop_reason


@task(name="round-table", cache_policy=NO_CACHE)
def publish_round_table(run_id: str) -> None:
    ctx = get_run(run_id)
    keys = ("round", "actors_launched", "actors_failed", "env_steps", "return_mean", "hessian_R",
            "boost_score", "spend_round_usd", "spend_total_usd", "round_s")
    rows = [{k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keys} for r in ctx.trainer.history]
    create_table_artifact(rows, key=f"nitro-rounds-{_slug(run_id)}", description=f"Nitro run {run_id}: one row per round")


def _slug(text: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:60]


def _maybe_inject_failure(run_id: str, k: int) -> None:
    """Test hook: ``NITRO_INJECT_FAILURE_AT_ROUND=k`` fails round k once per run (a marker file
    in the run directory makes the retry pass), to exercise resume end to end."""
    import os

    from nitro.checkpoint import run_dir

    if os.environ.get("NITRO_INJECT_FAILURE_AT_ROUND") != str(k):
        return
    marker = run_dir(get_run(run_id).config.home, run_id) / f"injected-failure-round-{k}"
    if not marker.exists():
        marker.touch()
        raise RuntimeError(f"injected failure in round {k} (NITRO_INJECT_FAILURE_AT_ROUND)")
