"""The trained policy as an MLflow pyfunc model: a batch of observations in, actions out.

Why a model *from code*: a ``PythonModel`` object handed to MLflow is cloudpickled, and loading a
pickle runs whatever it holds, and Nitro never unpickles (docs/decisions.md). Here the model directory holds the code
file ``policy_model_entry.py`` (which names ``PolicyModel``), the policy's safetensors payload
(``TrainingRun.policy_payload``: weights, observation normaliser, architecture) and the env's
``EnvSpec`` as JSON; ``load_context`` rebuilds the network from those two data files. Loading
needs this package installed (``pip install -e .``), because the network is ``nitro.models.networks.Policy``.

``predict`` returns the deterministic action of each observation (``Policy.act``: the Gaussian's
mean, or the likeliest discrete action), the same action Nitro's evaluation scores. Continuous
actions are not clipped; the env clips them to its bounds, as it does for the actors.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
from mlflow.pyfunc import PythonModel

__all__ = ["POLICY_FORMAT", "PolicyModel", "policy_signature", "save_policy_model"]

POLICY_FORMAT = "nitro.policy/1"
ENTRY_FILE = Path(__file__).with_name("policy_model_entry.py")
REQUIREMENTS = ("nitro-rl", "torch", "numpy", "safetensors", "gymnasium")


class PolicyModel(PythonModel):
    """``predict(obs[N, *obs_shape]) -> actions[N, act_dim]`` (continuous) or ``[N]`` (discrete)."""

    def load_context(self, context: Any) -> None:
        import torch

        from nitro.envs import EnvSpec
        from nitro.models import Architecture
        from nitro.models.networks import Policy, holding
        from nitro.serialization import loads_tensors

        payload = Path(context.artifacts["policy"]).read_bytes()
        spec_fields = json.loads(Path(context.artifacts["env_spec"]).read_text())
        spec_fields["obs_shape"] = tuple(spec_fields["obs_shape"])
        self.spec = EnvSpec(**spec_fields)
        arrays, meta = loads_tensors(payload, expect_format=POLICY_FORMAT)
        arch = Architecture.from_meta(meta.get("arch"))
        state = {name: torch.from_numpy(array.copy()) for name, array in arrays.items()}
        self.policy = holding(lambda: Policy(self.spec, arch), state).eval()

    def predict(self, context: Any, model_input: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
        obs = np.asarray(model_input)
        if obs.shape[1:] != self.spec.obs_shape:
            shape = ", ".join(map(str, self.spec.obs_shape))
            raise ValueError(f"observations of {self.spec.env_id} have shape (N, {shape}); "
                             f"got {obs.shape}")
        obs = obs.astype(np.uint8 if self.spec.obs_dtype == "uint8" else np.float32, copy=False)
        actions = [self.policy.act(o) for o in obs]
        return np.asarray(actions, dtype=np.float32 if self.spec.continuous else np.int64)


def policy_signature(spec: Any, obs_dtype: np.dtype) -> mlflow.models.ModelSignature:
    """Input: a batch of raw observations in the env's own dtype (MLflow refuses any other, even
    a widening one); output: one action per observation."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    out = (TensorSpec(np.dtype(np.float32), (-1, spec.action_dim)) if spec.continuous
           else TensorSpec(np.dtype(np.int64), (-1,)))
    obs = TensorSpec(np.dtype(obs_dtype), (-1, *spec.obs_shape))
    return ModelSignature(inputs=Schema([obs]), outputs=Schema([out]))


def save_policy_model(path: str | Path, payload: bytes, *, mlflow_model: Any = None, n_examples: int = 2) -> None:
    """Write the pyfunc model of ``payload`` (``TrainingRun.policy_payload``) to the new directory
    ``path``; the input example is ``n_examples`` observations from the env's first reset."""
    from nitro.envs import env_spec, make_env
    from nitro.serialization import loads_tensors

    _, meta = loads_tensors(payload, expect_format=POLICY_FORMAT)
    env_id = meta["env_id"]
    spec = env_spec(env_id)
    env = make_env(env_id, seed=0)
    try:
        example = np.stack([env.reset(seed=i)[0] for i in range(n_examples)])
    finally:
        env.close()
    with tempfile.TemporaryDirectory(prefix="nitro-policy-") as tmp:
        weights, spec_json = Path(tmp) / "policy.safetensors", Path(tmp) / "env_spec.json"
        weights.write_bytes(bytes(payload))
        spec_json.write_text(json.dumps(dataclasses.asdict(spec)))
        mlflow.pyfunc.save_model(
            path=str(path),
            python_model=str(ENTRY_FILE),
            artifacts={"policy": str(weights), "env_spec": str(spec_json)},
            signature=policy_signature(spec, example.dtype),
            input_example=example,
            pip_requirements=list(REQUIREMENTS),  # given: inferring them loads the model in a subprocess
            mlflow_model=mlflow_model,
            metadata={"env_id": env_id, "round": str(meta.get("version")), "format": POLICY_FORMAT},
        )
