"""Snapshots and gradients on the wire (safetensors, never pickle), and the door a gradient passes.

A snapshot is a parameter-server version: ``policy.*`` and ``critic.*`` tensors and, in the
metadata, the env, the version, the architecture and the loss's settings. A gradient is one tensor
per trainable parameter under the same names; the parameter server drops one that does not
match its parameters' names and shapes, holds a non-finite value, or names a version or a job
other than the one it was scheduled for (``GradientError``, one line).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from nitro.envs import EnvSpec
from nitro.learners import Gradients
from nitro.models import Architecture
from nitro.models.networks import Critic, Policy, build_critic, build_policy, holding
from nitro.serialization import SerializationError, dumps_tensors, loads_tensors
from nitro.stellaris.gradient import LossSettings
from nitro.stellaris.jobs import GRADIENT_FORMAT, SNAPSHOT_FORMAT


class GradientError(ValueError):
    """A gradient the parameter server will not apply; the message is one line."""


def snapshot_payload(policy: Policy, critic: Critic, *, env_id: str, version: int, arch: Architecture,
                     settings: LossSettings) -> bytes:
    tensors = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    tensors.update({f"critic.{k}": v for k, v in critic.state_dict().items()})
    meta = {"format": SNAPSHOT_FORMAT, "env_id": env_id, "version": version, "arch": arch.to_meta(),
            "settings": settings.to_meta()}
    return dumps_tensors(tensors, meta)


@dataclass
class Snapshot:
    version: int
    policy: Policy
    critic: Critic
    settings: LossSettings


def load_snapshot(payload: bytes, spec: EnvSpec) -> Snapshot:
    """The networks of a snapshot payload (built for ``spec``)."""
    arrays, meta = loads_tensors(payload, expect_format=SNAPSHOT_FORMAT)
    if meta.get("env_id") != spec.env_id:
        raise SerializationError(f"snapshot is for env {meta.get('env_id')!r}, not {spec.env_id!r}")
    arch = Architecture.from_meta(meta.get("arch"))

    def state(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: torch.as_tensor(v) for k, v in arrays.items() if k.startswith(prefix)}

    policy = holding(lambda: build_policy(spec, arch=arch), state("policy."))
    critic = holding(lambda: build_critic(spec, arch=arch), state("critic."))
    settings = LossSettings.from_meta(json.loads(meta["settings"]))
    return Snapshot(int(json.loads(meta["version"])), policy, critic, settings)


def gradient_payload(grads: Mapping[str, torch.Tensor], *, invocation_id: str, snapshot_version: int,
                     metrics: Mapping[str, float]) -> bytes:
    meta = {"format": GRADIENT_FORMAT, "invocation_id": invocation_id, "snapshot_version": snapshot_version,
            "metrics": {k: float(v) for k, v in metrics.items()}}
    return dumps_tensors(dict(grads), meta)


@dataclass(frozen=True)
class Gradient:
    invocation_id: str
    snapshot_version: int
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, float]

    def gradients(self) -> Gradients:
        """As the learner's ``apply_gradients`` takes it: its samples (1 when the metrics do not
        say) weigh it in a group's mean."""
        samples = int(self.metrics.get("samples", 1))
        return Gradients(self.tensors, samples, float(self.metrics.get("loss", 0.0)), self.metrics)


def check_gradient(payload: bytes, *, expected: Mapping[str, torch.Size], invocation_id: str,
                   snapshot_version: int) -> Gradient:
    """The gradient in ``payload`` if it is the one scheduled and fit to apply; else GradientError."""
    try:
        arrays, meta = loads_tensors(payload, expect_format=GRADIENT_FORMAT)
        got_id, got_version = meta.get("invocation_id"), int(json.loads(meta.get("snapshot_version", "null")))
        metrics = {k: float(v) for k, v in json.loads(meta.get("metrics", "{}")).items()}
    except (SerializationError, TypeError, ValueError) as exc:
        raise GradientError(f"not a gradient payload: {exc}") from None
    if got_id != invocation_id:
        raise GradientError(f"gradient says it is {got_id!r}, expected {invocation_id!r}")
    if got_version != snapshot_version:
        raise GradientError(f"gradient computed at version {got_version}, scheduled at {snapshot_version}")
    if set(arrays) != set(expected):
        missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
        raise GradientError(
            f"gradient tensors differ from the parameters: missing {missing[:3]}, unexpected {extra[:3]}")
    tensors = {}
    for name, shape in expected.items():
        arr = arrays[name]
        if tuple(arr.shape) != tuple(shape):
            raise GradientError(f"gradient {name} has shape {tuple(arr.shape)}, the parameter {tuple(shape)}")
        if arr.dtype != np.float32:
            raise GradientError(f"gradient {name} is {arr.dtype}, expected float32")
        if not np.isfinite(arr).all():
            raise GradientError(f"gradient {name} holds non-finite values")
        tensors[name] = torch.from_numpy(arr.copy())
    if not all(math.isfinite(v) for v in metrics.values()):
        raise GradientError("gradient's loss terms are not finite")
    return Gradient(invocation_id, snapshot_version, tensors, metrics)
