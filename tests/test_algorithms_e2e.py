"""Short end-to-end runs of the other algorithm/env combinations through the real pipeline:
IMPACT (asynchronous, off-policy) on Hopper, and PPO and IMPACT on an Atari game with the CNN."""

from __future__ import annotations

import asyncio

import pytest
from mlflow.tracking import MlflowClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(tmp_path, redis_url, run_id, **params):
    from flows.training import train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = params.pop("overrides")
    result = asyncio.run(train(overrides=[
        "scaler.name=fixed", "scaler.fixed_actors=2", "backend.workers=2", "detector.subset_size=64",
        f"home={tmp_path}", f"tracking.mlflow_uri={uri}", f"redis.url={redis_url}", *overrides,
    ], run_id=run_id, **params))
    client = MlflowClient(tracking_uri=uri)
    history = {
        name: [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, name), key=lambda m: m.step)]
        for name in ("env_steps", "actors_failed", "learner_s", "actor_s", "hessian_R")
    }
    return result, history


def test_impact_asynchronous_on_hopper(prefect_api, tmp_path, redis_url):
    result, h = _run(tmp_path, redis_url, "impact-hopper", algo="impact", rounds=3,
                     overrides=["steps_per_actor=256", "detector.enabled=true"])
    assert result.rounds_done == 3
    assert h["env_steps"] == [512.0] * 3 and h["actors_failed"] == [0.0] * 3
    assert all(s > 0 for s in h["learner_s"])  # it learned during every round, round 0 included
    assert h["hessian_R"][1] == h["hessian_R"][1]  # detection ran on the updates so far (not NaN)


@pytest.mark.parametrize("algo", ["ppo", "impact"])
def test_atari_trains_with_the_cnn(prefect_api, tmp_path, redis_url, algo):
    # Both rounds evaluate (the first and the last); one short episode per mode is enough to run the
    # CNN through evaluation, where the default's ten whole Atari episodes per evaluation take minutes.
    result, h = _run(tmp_path, redis_url, f"atari-{algo}", algo=algo, env_id="ALE/SpaceInvaders-v5", rounds=2,
                     overrides=["steps_per_actor=64", "ppo.minibatch_size=64", "impact.minibatch_size=64",
                                "eval.episodes=1", "eval.max_steps=200"])
    assert result.rounds_done == 2
    assert h["env_steps"] == [128.0, 128.0] and h["actors_failed"] == [0.0, 0.0]
