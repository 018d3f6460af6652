"""A training run: rounds until the round limit, the target reward or the budget is reached.

Resume: retrying a failed flow run (the UI's Retry button, or ``prefect flow-run retry <id>``)
re-runs this flow with the same flow-run id, hence the same Nitro run id, and ``open_run``
restores the last completed round's checkpoint; completed rounds are neither re-run nor
re-charged. ``nitro resume <run>`` does the same from the command line.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

from prefect import flow, runtime
from prefect.task_runners import ThreadPoolTaskRunner

from flows.round import asynchronous_round, training_round
from nitro.checkpoint import run_dir
from nitro.config import NitroConfig
from nitro.runtime import open_run
from tasks.bookkeeping import publish_round_table, record_round
from tasks.tracking import attach_mlflow, finish_mlflow

log = logging.getLogger("nitro")

EnvId = Literal["Hopper-v5", "Walker2d-v5", "Humanoid-v5", "ALE/SpaceInvaders-v5", "ALE/Qbert-v5", "ALE/Gravitar-v5"]
Scaler = Literal["nitro", "fixed", "always", "hydrozoa", "kungfu", "random"]


def default_run_id() -> str:
    flow_run_id = runtime.flow_run.id
    return f"run-{str(flow_run_id).replace('-', '')[:12]}" if flow_run_id else f"run-{os.getpid()}-{int(time.time())}"


@flow(name="nitro-train", persist_result=False, log_prints=True)
async def train(
    env_id: EnvId | None = None,
    algo: Literal["ppo", "impact"] | None = None,
    scaler: Scaler | None = None,
    rounds: int | None = None,
    seed: int | None = None,
    budget_usd: float | None = None,
    steps_per_actor: int | None = None,
    backend: Literal["local", "lambda"] | None = None,
    overrides: list[str] | None = None,
    config_path: str | None = None,
    run_id: str | None = None,
) -> dict:
    """Train one agent with Nitro. ``overrides`` are dotted ``key=value`` pairs for any config
    field (e.g. ``ppo.lr=1e-4``, ``scaler.i_max=32``); ``run_id`` resumes or names a run. Unset
    parameters keep the value from ``config_path``, else the built-in default."""
    given = {"env_id": env_id, "algo": algo, "scaler.name": scaler, "rounds": rounds, "seed": seed,
             "budget_usd": budget_usd, "steps_per_actor": steps_per_actor, "backend.kind": backend}
    base = [f"{key}={value}" for key, value in given.items() if value is not None]
    config = NitroConfig.from_yaml(config_path, base + list(overrides or []))
    return await run_training(config, run_id or default_run_id())


async def run_training(config: NitroConfig, run_id: str) -> dict:
    """The loop over rounds, shared by the deployment's flow and ``nitro train|resume``."""
    off_policy_async = config.algo == "impact" and config.impact.asynchronous
    round_flow = (asynchronous_round if off_policy_async else training_round).with_options(
        task_runner=ThreadPoolTaskRunner(max_workers=max(config.scaler.i_max, config.scaler.fixed_actors) + 4))
    with open_run(config, run_id) as ctx:
        attach_mlflow(run_id)
        stop = None
        try:
            for k in range(ctx.trainer.next_round, config.rounds):
                started = time.perf_counter()
                await round_flow(run_id, k)
                stop = record_round(run_id, k, time.perf_counter() - started)
                if stop:
                    break
        except BaseException:
            finish_mlflow(run_id, "FAILED")
            raise
        publish_round_table(run_id)
        finish_mlflow(run_id)
        history = ctx.trainer.history
        return {
            "run_id": run_id,
            "mlflow_run_id": ctx.extras["mlflow_run_id"],
            "rounds_done": ctx.trainer.next_round,
            "stop_reason": stop or "round_limit",
            "final_return_mean": ctx.trainer.final_return(),
            "spend_usd": ctx.trainer.ledger.spent_usd,
            "checkpoints": str(run_dir(config.home, run_id)),
        }
