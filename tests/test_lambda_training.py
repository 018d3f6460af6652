"""A short training run end to end with ``backend=lambda``: the real pipeline, the real boto3
invoke path, and a local server speaking Lambda's Invoke API that runs the real handler."""

from __future__ import annotations

import asyncio

import pytest
from mlflow.tracking import MlflowClient

from tests.support.lambda_invoke_server import FunctionSpec, InvokeServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture()
def lambda_endpoint(monkeypatch):
    # botocore signs requests, so it needs credentials; none of them reach AWS.
    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(var, value)
    with InvokeServer([FunctionSpec("nitro-actor", concurrency=2, timeout_s=60)]) as server:
        yield server.url


def test_training_with_lambda_actors(prefect_api, lambda_endpoint, redis_url, tmp_path):
    from flows.training import train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = asyncio.run(train(backend="lambda", rounds=2, overrides=[
        "steps_per_actor=128", "scaler.name=fixed", "scaler.fixed_actors=3", "detector.subset_size=64",
        f"home={tmp_path}", f"tracking.mlflow_uri={uri}", f"redis.url={redis_url}",
        f"backend.lambda.endpoint_url={lambda_endpoint}", "backend.lambda.concurrency=4",
        "backend.lambda.function_timeout_s=60", "eval.episodes=1",
    ], run_id="lambda-e2e"))
    assert result.rounds_done == 2
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.data.tags["backend"] == "lambda"
    launched = client.get_metric_history(run.info.run_id, "actors_launched")
    failed = client.get_metric_history(run.info.run_id, "actors_failed")
    steps = client.get_metric_history(run.info.run_id, "env_steps")
    assert [m.value for m in launched] == [3.0, 3.0]
    assert [m.value for m in failed] == [0.0, 0.0]
    assert [m.value for m in steps] == [384.0, 384.0]
    # Lambda pricing from billed durations: compute and requests are both charged
    compute = client.get_metric_history(run.info.run_id, "spend_lambda_compute_usd")
    requests = client.get_metric_history(run.info.run_id, "spend_requests_usd")
    assert all(m.value > 0 for m in compute)
    # 3 actors and 2 evaluation episodes (one with the mean action, one sampled) in both rounds,
    # each an invocation Lambda bills
    assert [m.value for m in requests] == pytest.approx([(3 + 2) * 0.2e-6] * 2)
