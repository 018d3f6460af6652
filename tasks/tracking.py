"""MLflow: attach the training run to its MLflow run (re-attach on resume), and close it."""

from __future__ import annotations

from prefect import runtime, task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE

from nitro.checkpoint import checkpoint_dir
from nitro.runtime import get_run
from nitro.serialization import dumps_tensors
from nitro.tracking import RunTracker, default_tracking_uri


@task(name="attach-mlflow", cache_policy=NO_CACHE)
def attach_mlflow(run_id: str) -> str:
    ctx = get_run(run_id)
    cfg = ctx.config
    tracker = RunTracker(cfg.tracking.mlflow_uri or default_tracking_uri(cfg), cfg.tracking.experiment)
    flow_run_id = runtime.flow_run.id
    mlflow_run = tracker.start_or_attach(str(flow_run_id) if flow_run_id else None, run_id, cfg,
                                         tags=ctx.trainer.ledger.tags())
    # A resumed run re-logs the rounds it has checkpointed; rounds already in MLflow are skipped.
    for row in ctx.trainer.history:
        tracker.log_round(mlflow_run, int(row["round"]), {k: v for k, v in row.items() if k != "round"})
    ctx.extras.update(tracker=tracker, mlflow_run_id=mlflow_run)
    uri = tracker.run_url(mlflow_run) if hasattr(tracker, "run_url") else f"{tracker.tracking_uri}#/runs/{mlflow_run}"
    create_link_artifact(uri, link_text=f"MLflow run {mlflow_run}", description=f"Nitro run {run_id} in MLflow")
    return mlflow_run


@task(name="finish-mlflow", cache_policy=NO_CACHE)
def finish_mlflow(run_id: str, status: str = "FINISHED") -> None:
    ctx = get_run(run_id)
    tracker, mlflow_run = ctx.extras["tracker"], ctx.extras["mlflow_run_id"]
    if status != "FINISHED":
        tracker.end_run(mlflow_run, status)
        return
    policy = dumps_tensors(ctx.trainer.learner.weights(), {"format": "nitro.policy/1", "env_id": ctx.config.env_id,
                                                            "version": ctx.trainer.next_round})
    tracker.log_final(mlflow_run, policy, checkpoint_dir(ctx.config.home, run_id), ctx.trainer.history)
