"""What a finished training run reports: the CLI prints it, an experiment keeps it per cell."""

from __future__ import annotations

from pydantic import BaseModel


class RunResult(BaseModel):
    """A training run's outcome, as ``flows.training.run_training`` returns it."""

    run_id: str
    mlflow_run_id: str | None
    mlflow_url: str | None
    prefect_url: str | None  # the flow run's page in the Prefect UI; None outside a flow run
    rounds_done: int
    stop_reason: str
    # the last evaluation: whole episodes, mean action (None if the run never evaluated)
    final_eval_return: float | None
    final_eval_round: int | None
    spend_usd: float
    checkpoints: str  # the run's directory of checkpoints
