"""Whole runs through the real pipeline (the nitro-train flow on a real Prefect API, a real Redis,
local actor processes, a real MLflow store, Hopper-v5):

* bad batches planted in the cache in the middle of a run (after a round's actors wrote theirs,
  before the next update reads them) are dropped and counted as corrupt, with their reasons in the
  log and MLflow, while the run finishes and the policy and its normaliser stay finite;
* finite but absurd batches (an observation of 1e30, a log-probability of -1e30, actions of 1e30,
  rewards of 1e30) planted beside the good ones are refused with their reasons, the round trains on
  the rest without skipping a minibatch, and the normaliser ends exactly as in the same run without them;
* a clean run trains on every batch its actors wrote (none missing or corrupt, every sample counted);
* the target-reward stop ends a run after the round that reached it.
"""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from nitro.run.rundir import RunDir
from nitro.run.runtime import ROUND_OBSERVERS, get_run
from nitro.serialization import dumps_tensors, loads_tensors

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, ACTORS = 64, 8


def _overrides(tmp_path, redis_url, *extra: str) -> list[str]:
    return ["steps_per_actor=64", "scaler.name=fixed", f"scaler.fixed_actors={ACTORS}", "backend.workers=2",
            "detector.subset_size=64", "eval.every_rounds=0", "round_deadline_s=30", f"home={tmp_path}",
            f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlflow.db", f"redis.url={redis_url}", *extra]


def _train(overrides: list[str], run_id: str) -> dict:
    from flows.training import train

    return asyncio.run(train(overrides=overrides, run_id=run_id))


def _history(tmp_path, result: dict, name: str) -> list[float]:
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    return [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, name), key=lambda m: m.step)]


# Each bad batch is a real batch of this run with one thing wrong: (what is wrong, how, the reason).
def _nan_reward(b):
    b["rewards"][5] = np.nan


def _inf_obs(b):
    b["obs"][7, 2] = np.inf


def _wide_obs(b):
    b["obs"] = np.zeros((STEPS, 13), np.float32)


def _no_rewards(b):
    del b["rewards"]


def _bad_index(b):
    b["bootstrap_idx"][-1] = STEPS + 100


def _oversize(b):
    for key in ("obs", "actions", "logp", "rewards", "terminated"):
        b[key] = np.concatenate([b[key]] * 50)


PLANTS = [(_nan_reward, "rewards has 1 non-finite"), (_inf_obs, "obs has 1 non-finite"),
          (_wide_obs, "obs has shape (64, 13), expected (64, 11)"), (_no_rewards, "missing key(s) rewards"),
          (_bad_index, "bootstrap_idx out of range"), (_oversize, "exceeds")]


def _plant_after_round(k: int, planted: dict[str, str]):
    """A round observer (called once round k is checkpointed, before round k+1 starts) that
    overwrites the batches of the first len(PLANTS) actors of round k with broken ones."""

    def plant(run_id: str, report) -> None:
        if report.round != k:
            return
        trainer = get_run(run_id).training
        for inv, (breaks, reason) in zip(sorted(trainer.mode.pending), PLANTS):
            arrays, meta = loads_tensors(trainer.cache.get_batch(k, inv))
            arrays = {key: v.copy() for key, v in arrays.items()}
            breaks(arrays)
            trainer.cache.client.set(trainer.cache.batch_key(k, inv), dumps_tensors(arrays, meta), ex=600)
            planted[inv] = reason

    return plant


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_bad_batches_planted_mid_run_are_dropped_and_the_run_finishes(prefect_api, tmp_path, redis_url):
    planted: dict[str, str] = {}
    observer, lines = _plant_after_round(0, planted), _Lines()
    ROUND_OBSERVERS.append(observer)
    logging.getLogger("nitro").addHandler(lines)
    try:
        result = _train(_overrides(tmp_path, redis_url, "rounds=3"), "bad-batches")
    finally:
        ROUND_OBSERVERS.remove(observer)
        logging.getLogger("nitro").removeHandler(lines)

    assert result.rounds_done == 3 and len(planted) == len(PLANTS)
    assert _history(tmp_path, result, "actors_corrupt") == [0.0, len(PLANTS), 0.0]
    assert _history(tmp_path, result, "batches_missing") == [0.0, 0.0, 0.0]
    # round 1 trained on the good batches only, round 2 on all of round 1's (round 0 has no update)
    assert _history(tmp_path, result, "ppo/n_samples") == [(ACTORS - len(PLANTS)) * STEPS, ACTORS * STEPS]
    # the reasons: one line each in the log, and a tag per dropped batch on the MLflow run
    tags = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db").get_run(result.mlflow_run_id).data.tags
    for inv, reason in planted.items():
        assert reason in tags[f"nitro.corrupt.{inv}"], (inv, tags.get(f"nitro.corrupt.{inv}"))
        assert any(inv in line and reason in line and "\n" not in line for line in lines.lines), inv
    # the policy, its normaliser and the critic stay finite
    _, state = RunDir(tmp_path, "bad-batches").load()
    tensors = state["learner"]["tensors"]
    assert "policy.obs_norm.mean" in tensors
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in tensors.values())


@pytest.fixture(scope="module")
def clean_run(prefect_api, redis_server, tmp_path_factory):
    """A clean 3-round run (its home, its result), shared by the tests that compare with it."""
    home = tmp_path_factory.mktemp("clean")
    return home, _train(_overrides(home, redis_server.url, "rounds=3"), "every-batch")


def test_a_clean_run_trains_on_every_batch_its_actors_wrote(clean_run):
    tmp_path, result = clean_run
    assert result.rounds_done == 3
    launched = _history(tmp_path, result, "actors_launched")
    assert launched == [ACTORS] * 3 and _history(tmp_path, result, "actors_failed") == [0.0] * 3
    assert _history(tmp_path, result, "batches_missing") == [0.0] * 3
    assert _history(tmp_path, result, "actors_corrupt") == [0.0] * 3
    # each update trained on exactly the steps the previous round's actors took
    steps = _history(tmp_path, result, "env_steps")
    assert steps == [ACTORS * STEPS] * 3
    assert _history(tmp_path, result, "ppo/n_samples") == steps[:2]


def test_the_target_reward_stops_the_run(prefect_api, tmp_path, redis_url):
    # Any evaluation return of an untrained Hopper policy (a few dozen) clears a target of -1000.
    result = _train(_overrides(tmp_path, redis_url, "rounds=5", "eval.every_rounds=2", "eval.episodes=1",
                               "target_reward=-1000"), "target")
    assert result.stop_reason == "target_reward" and result.rounds_done == 1
    evaluated = _history(tmp_path, result, "eval_return_mean")
    assert len(evaluated) == 1 and not math.isnan(evaluated[0]) and evaluated[0] >= -1000


# Finite but absurd: each a copy of a real batch of the run with one value replaced, planted
# beside the real ones under an invocation id of its own (what is wrong, how, the reason).
def _huge_obs(b):
    b["obs"][7, 2] = 1e30


def _huge_negative_logp(b):
    b["logp"][3] = -1e30


def _huge_actions(b):
    b["actions"][:] = 1e30


def _huge_rewards(b):
    b["rewards"][:] = 1e30


ABSURD = [
    (_huge_obs, "obs[7, 2] = 1e+30 is outside its stated bound"),
    (_huge_negative_logp, "logp disagrees with policy version 0"),
    (_huge_actions, "actions[0, 0] = 1e+30 is outside its stated bound"),
    (_huge_rewards, "rewards[0] = 1e+30 is outside its stated bound"),
]


def _plant_beside(k: int, planted: dict[str, str]):
    """A round observer that adds, after round k, one absurd batch per ABSURD entry to the batches
    round k+1's update collects (stored and announced as an actor stores its own)."""

    def plant(run_id: str, report) -> None:
        if report.round != k:
            return
        trainer = get_run(run_id).training
        source = sorted(trainer.mode.pending)[0]
        for i, (breaks, reason) in enumerate(ABSURD):
            arrays, meta = loads_tensors(trainer.cache.get_batch(k, source))
            arrays = {key: v.copy() for key, v in arrays.items()}
            breaks(arrays)
            inv = f"{run_id}-r{k:05d}-absurd{i}"
            trainer.cache.put_batch(k, inv, dumps_tensors(arrays, {**meta, "invocation_id": inv}))
            trainer.mode.pending.append(inv)
            planted[inv] = reason

    return plant


def test_absurd_batches_are_refused_and_the_normaliser_ends_as_without_them(clean_run, tmp_path, redis_url):
    planted: dict[str, str] = {}
    observer = _plant_beside(0, planted)
    ROUND_OBSERVERS.append(observer)
    try:
        result = _train(_overrides(tmp_path, redis_url, "rounds=3"), "absurd")
    finally:
        ROUND_OBSERVERS.remove(observer)

    assert result.rounds_done == 3 and len(planted) == len(ABSURD)
    assert _history(tmp_path, result, "actors_corrupt") == [0.0, len(ABSURD), 0.0]
    assert _history(tmp_path, result, "ppo/n_samples") == [ACTORS * STEPS, ACTORS * STEPS]
    assert _history(tmp_path, result, "ppo/skipped_minibatches") == [0.0, 0.0]
    tags = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db").get_run(result.mlflow_run_id).data.tags
    for inv, reason in planted.items():
        assert reason in tags[f"nitro.corrupt.{inv}"], (inv, tags.get(f"nitro.corrupt.{inv}"))
    # the statistics, and the policy they normalise for, are those of the same run without the absurd batches
    clean_home, _ = clean_run
    absurd = RunDir(tmp_path, "absurd").load()[1]["learner"]["tensors"]
    clean = RunDir(clean_home, "every-batch").load()[1]["learner"]["tensors"]
    for name in ("policy.obs_norm.mean", "policy.obs_norm.var", "policy.obs_norm.count"):
        assert torch.allclose(torch.as_tensor(absurd[name]), torch.as_tensor(clean[name]), rtol=1e-6, atol=1e-9), name
    assert float(torch.as_tensor(absurd["policy.obs_norm.var"]).max()) < 1e3
