"""Nothing that crosses a process boundary is ever unpickled: weights, trajectories and summaries travel as data."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["nitro", "flows", "tasks", "actor_lambda", "deployments"]
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
FORBIDDEN_CALLS = {"torch.load", "np.load", "numpy.load", "pickle.loads", "pickle.load"}


def _sources():
    for pkg in PACKAGES:
        yield from (ROOT / pkg).rglob("*.py")


def test_no_module_imports_a_pickle_library_or_calls_a_pickle_loader():
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Call):
                names = []
                func = ast.unparse(node.func)
                if func in FORBIDDEN_CALLS:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {func}")
            else:
                continue
            for name in names:
                if name in FORBIDDEN_MODULES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_learner_side_never_unpickles_a_round(redis_url, monkeypatch):
    """Collect a real actor's batch from Redis, decode it and update the policy with every pickle
    loader in this process booby-trapped."""
    from nitro.actors.events import ActorEvent
    from nitro.actors.worker import ActorState, run_actor
    from nitro.cache import TrajectoryCache, connect_redis
    from nitro.config import PPOConfig
    from nitro.envs import env_spec
    from nitro.learners import PPOLearner
    from nitro.serialization import dumps_tensors, loads_tensors

    def trap(*_a, **_k):
        raise AssertionError("something unpickled data")

    client = connect_redis(redis_url)
    cache = TrajectoryCache(client, "nopickle", ttl_s=600)
    learner = PPOLearner(env_spec("Hopper-v5"), PPOConfig(epochs=1), seed=0)
    key = cache.publish_weights(
        0, dumps_tensors(learner.weights(), {"format": "nitro.policy/1", "env_id": "Hopper-v5", "version": 0})
    )
    event = ActorEvent(
        run_id="nopickle",
        round=0,
        invocation_id="nopickle-r00000-0000",
        weights_key=key,
        env_id="Hopper-v5",
        seed=1,
        n_steps=128,
        cache_url=redis_url,
    )
    monkeypatch.setattr(pickle, "loads", trap)
    monkeypatch.setattr(pickle, "load", trap)
    monkeypatch.setattr(pickle, "Unpickler", trap)
    summary = run_actor(event, ActorState())
    assert summary.ok, summary.error
    got = cache.collect(0, {event.invocation_id}, deadline_s=10)
    batch, meta = loads_tensors(got.batches[event.invocation_id], expect_format="nitro.batch/1")
    assert meta["invocation_id"] == event.invocation_id
    learner.update([batch])


def test_a_pickle_payload_is_rejected_not_executed():
    from nitro.serialization import SerializationError, loads_tensors

    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(SerializationError):
        loads_tensors(pickle.dumps(Boom()))
    with pytest.raises(SerializationError):
        loads_tensors(pickle.dumps({"obs": np.zeros(3)}))
