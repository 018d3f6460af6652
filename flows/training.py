"""A training run: rounds until the round limit, the target reward or the budget is reached.

Resume: retrying a failed flow run (the UI's Retry button, or ``prefect flow-run retry <id>``)
re-runs this flow with the same flow-run id, hence the same Nitro run id, and ``open_run``
restores the last completed round's checkpoint; completed rounds are neither re-run nor
re-charged. ``nitro resume <run>`` does the same from the command line.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from prefect import flow, runtime
from prefect.context import SyncClientContext
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from flows.round import asynchronous_round, stellaris_round, training_round
from nitro.config import NitroConfig, ScalerName
from nitro.envs import PAPER_ENVS
from nitro.run.failures import describe_failure
from nitro.run.result import RunResult
from nitro.run.rundir import RunDir
from nitro.run.runtime import RunContext, open_run
from nitro.run.stopping import STOP_ROUNDS
from nitro.tracking.tracker import default_tracking_uri
from tasks.bookkeeping import record_round, tidy_previous_attempts
from tasks.tracking import attach_mlflow, finish_mlflow, flow_run_url

log = logging.getLogger("nitro")

# the round flow that drives each update mode (nitro.run.updates)
ROUND_FLOWS = {"sync": training_round, "learn-while-acting": asynchronous_round, "stellaris": stellaris_round}
# the run form's choices: the paper's six (the config accepts any known env); one list, in nitro.envs
EnvId = Literal[PAPER_ENVS]  # type: ignore[valid-type]  # mypy wants the values written out; Prefect reads them at run time


def default_run_id() -> str:
    flow_run_id = runtime.flow_run.id
    return f"run-{str(flow_run_id).replace('-', '')[:12]}" if flow_run_id else f"run-{os.getpid()}-{int(time.time())}"


# The flow's parameters are what the Prefect UI's run form shows: each has a type, a default (the
# built-in config's; tests/test_cockpit.py keeps them equal) and a description, parsed by
# Prefect from the Args section below.
@flow(name="nitro-train", persist_result=False, log_prints=True)
async def train(
    env_id: EnvId = "Hopper-v5",
    algo: Literal["ppo", "impact"] = "ppo",
    scaler: ScalerName = "nitro",
    rounds: Annotated[int, Field(ge=1)] = 50,
    seed: Annotated[int, Field(ge=0)] = 0,
    budget_usd: Annotated[float, Field(ge=0)] = 0.0,
    steps_per_actor: Annotated[int, Field(ge=0)] = 0,
    backend: Literal["local", "lambda"] = "local",
    overrides: Sequence[str] = (),
    config_path: str = "",
    run_id: str = "",
) -> RunResult:
    """Train one agent with Nitro: rounds of policy update, boosting detection, scaling decision
    and actors, tracked in MLflow.

    A field left at its default keeps the value from ``config_path`` if one is given.

    Args:
        env_id: Gymnasium environment to train on (MuJoCo or Atari; the paper's six).
        algo: Learning algorithm: ppo (on-policy) or impact (off-policy, learns while actors act).
        scaler: How many actors each round gets: nitro (Hessian-guided boosting), fixed, always
            (the maximum), hydrozoa, kungfu or random (baselines).
        rounds: How many training rounds to run at most (numbered 0 to rounds-1).
        seed: Random seed; a run is reproducible from its config and seed.
        budget_usd: Stop once this much money is spent (learner plus actors); 0 means no limit.
        steps_per_actor: Environment steps each actor collects per round; 0 means the preset's
            (256 on MuJoCo and 128 on Atari; the paper's preset: 512 and 32).
        backend: Where actors run: local processes on the worker, or AWS Lambda.
        overrides: Any other config field as key=value, one per item, e.g. ppo.lr=1e-4,
            scaler.fixed_actors=16, eval.every_rounds=5 (`nitro config` lists them all).
        config_path: Optional YAML config file on the worker's machine; a field above that differs
            from its default overrides the file.
        run_id: Optional Nitro run id: names the run, or resumes that run from its last checkpoint.
            Empty: derived from this flow run's id.
    """
    parameters = dict(locals())  # the first statement: exactly the flow's parameters
    _send_round_lines_to_prefect()
    config = config_from_parameters(parameters)
    return await run_training(config, run_id or default_run_id())


# train's fields and the config keys they set
_FIELDS = {"env_id": "env_id", "algo": "algo", "scaler": "scaler.name", "rounds": "rounds", "seed": "seed",
           "budget_usd": "budget_usd", "steps_per_actor": "steps_per_actor", "backend": "backend.kind"}


def config_from_parameters(parameters: Mapping[str, Any]) -> NitroConfig:
    """The run's config from ``train``'s parameters: the YAML at ``config_path`` (if any), then
    each field that differs from its default, then ``overrides``. A field left at its default
    thus keeps the file's value, which is what a form with prefilled defaults needs."""
    defaults = {name: p.default for name, p in inspect.signature(train.fn).parameters.items()}
    base = [f"{key}={parameters[name]}" for name, key in _FIELDS.items() if parameters[name] != defaults[name]]
    return NitroConfig.from_yaml(parameters["config_path"] or None, base + list(parameters["overrides"]))


def _close_failed(ctx: RunContext) -> None:
    """Mark the MLflow run FAILED, if it was attached; a store that is itself the failure must
    not hide the original error."""
    if ctx.tracker is None:
        return
    try:
        finish_mlflow(ctx.run_id, "FAILED")
    except Exception as exc:
        log.warning("run %s: could not mark the MLflow run failed: %s", ctx.run_id, exc)


def _send_round_lines_to_prefect() -> None:
    """Let the ``nitro`` logger's INFO lines (one per round) through. Under a worker,
    ``PREFECT_LOGGING_EXTRA_LOGGERS=nitro`` gives the logger Prefect's API handler but no level;
    without one it inherits the root's WARNING and the run's Logs tab shows no round."""
    logger = logging.getLogger("nitro")
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


async def run_training(config: NitroConfig, run_id: str) -> RunResult:
    """The loop over rounds, shared by the deployment's flow and ``nitro train|resume``."""
    round_flow = ROUND_FLOWS[config.update_mode]
    actors = max(config.scaler.i_max, config.scaler.fixed_actors)
    # Stellaris: a gradient job's task waits for its batch and snapshot, so the learner functions
    # get threads of their own beside the actors'
    functions = config.learner.functions_for(actors) if config.update_mode == "stellaris" else 0
    runner: ThreadPoolTaskRunner[Any] = ThreadPoolTaskRunner(max_workers=actors + functions + 4)
    # Prefect types task_runner as TaskRunner[PrefectFuture]; its own thread runner is generic in a
    # subclass of that future, which an invariant generic does not accept
    round_flow = round_flow.with_options(task_runner=runner)  # type: ignore[arg-type]
    # One Prefect API client for every task of the run: without it, each task run builds its own
    # client, SSL context included (~20 ms of CPU each; bench/orchestration_overhead.py).
    with open_run(config, run_id) as ctx, SyncClientContext.get_or_create():
        if ctx.resumed_from is not None or (runtime.flow_run.run_count or 1) > 1:
            tidy_previous_attempts(run_id)  # a killed attempt's round subflow would stay "Running"
        stop = None
        try:
            attach_mlflow(run_id)
            for k in range(ctx.training.next_round, config.rounds):
                started = time.perf_counter()
                report = await round_flow(run_id, k)
                report = record_round(run_id, report, time.perf_counter() - started)
                stop = report.stop_reason
                if stop:
                    break
        except BaseException as exc:
            _close_failed(ctx)
            urls = {"Redis": ctx.redis_url, "MLflow store": default_tracking_uri(config)}
            failure = describe_failure(exc, run_id, config.home, urls)  # one line, with the resume command
            if failure is None:
                raise
            raise failure from exc
        finish_mlflow(run_id)
        final = ctx.training.final_return()
        return RunResult(
            run_id=run_id,
            mlflow_run_id=ctx.mlflow_run_id,
            mlflow_url=ctx.tracker.run_url(ctx.mlflow_run_id) if ctx.tracker and ctx.mlflow_run_id else None,
            prefect_url=flow_run_url(),
            rounds_done=ctx.training.next_round,
            stop_reason=stop or STOP_ROUNDS,
            final_eval_return=final[1] if final else None,
            final_eval_round=final[0] if final else None,
            spend_usd=ctx.training.ledger.spent_usd,
            checkpoints=str(RunDir(config.home, run_id).path),
        )
