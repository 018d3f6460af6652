"""MLflow: attach the training run to its MLflow run (re-attach on resume), link it both ways with
the Prefect flow run, and close it."""

from __future__ import annotations

from prefect import runtime, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.urls import url_for

from nitro.run.rundir import RunDir
from nitro.run.runtime import get_run
from nitro.tracking.tracker import RunTracker, default_tracking_uri
from tasks import background
from tasks.artifacts import artifact_key, upsert_artifact
from tasks.bookkeeping import catch_up_mlflow


def flow_run_url() -> str | None:
    """This flow run's page in the Prefect UI (from ``PREFECT_UI_URL``, which Prefect derives from
    ``PREFECT_API_URL`` when unset). Under the CLI's temporary API server, which has no UI, that
    is the page a later ``prefect server start`` over the same database shows (cli/session.py)."""
    flow_run_id = runtime.flow_run.id
    return url_for("flow-run", obj_id=flow_run_id) if flow_run_id else None


@task(name="attach-mlflow", cache_policy=NO_CACHE)
def attach_mlflow(run_id: str) -> str:
    """Start or re-attach the run's MLflow run, named after the flow run and linking back to it,
    re-log checkpointed rounds it lacks, and put a link to it on the flow run."""
    ctx = get_run(run_id)
    cfg = ctx.config
    ctx.lease.check()  # fenced: only the run's one writer attaches, re-logs and tags
    tracker = ctx.store or RunTracker(cfg.tracking.mlflow_uri or default_tracking_uri(cfg), cfg.tracking.experiment)
    flow_run_id = runtime.flow_run.id
    mlflow_run = tracker.start_or_attach(str(flow_run_id) if flow_run_id else None, run_id, cfg,
                                         tags={**ctx.training.ledger.tags(), **ctx.training.scaler.tags()},
                                         flow_run_name=runtime.flow_run.name,
                                         flow_run_url=flow_run_url())
    tracker.client.set_tag(mlflow_run, "nitro.lease_token", str(ctx.lease.token))  # the writer of what follows
    # A resumed run re-logs the rounds it has checkpointed; rounds already in MLflow are skipped.
    for row in ctx.training.history:
        tracker.log_round(mlflow_run, int(row["round"]), {k: v for k, v in row.items() if k != "round"})
    ctx.tracker, ctx.mlflow_run_id = tracker, mlflow_run
    if flow_run_id:
        name = tracker.client.get_run(mlflow_run).info.run_name
        upsert_artifact(
            flow_run_id, artifact_key("mlflow", run_id), "markdown",
            f"**MLflow run [{name}]({tracker.run_url(mlflow_run)})** (Nitro run `{run_id}`): metrics per "
            f"round, plots, the final policy as a model.\n\nAll runs of experiment "
            f"[{tracker.experiment_name}]({tracker.experiment_url()}), with the headline metrics as columns.",
            f"Nitro run {run_id} in MLflow",
        )
    return mlflow_run


@task(name="finish-mlflow", cache_policy=NO_CACHE)
def finish_mlflow(run_id: str, status: str = "FINISHED") -> None:
    # The rounds' MLflow logging runs in the background (tasks/background.py): finish it first.
    background.drain(run_id, raise_failure=status == "FINISHED")
    ctx = get_run(run_id)
    tracker, mlflow_run = ctx.tracker, ctx.mlflow_run_id
    if tracker is None or mlflow_run is None:  # MLflow was never attached: nothing to finish
        return
    ctx.lease.check()
    if status != "FINISHED":
        tracker.end_run(mlflow_run, status)
        return
    catch_up_mlflow(ctx, final=True)  # a store that was down logs what it missed, or fails the run now
    policy = ctx.training.policy_payload(ctx.training.next_round)
    tracker.log_final(mlflow_run, policy, RunDir(ctx.config.home, run_id).checkpoints, ctx.training.history)
