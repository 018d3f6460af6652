"""Learners: what the engine needs of an RL algorithm, and the two Nitro ships.

``Learner`` is the contract; ``PPOLearner`` (on-policy) and ``ImpactLearner`` (off-policy, which
also replays) implement it. The engine holds a ``Learner`` and never looks inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from nitro.config import NitroConfig
from nitro.envs import EnvSpec, env_spec

Batch = Mapping[str, np.ndarray]  # one actor's trajectory batch (docs/ARCHITECTURE.md)


@runtime_checkable
class Learner(Protocol):
    """An algorithm's learner side: it trains on actor batches and publishes policy weights."""

    spec: EnvSpec

    def update(self, batches: Sequence[Batch]) -> dict[str, float]:
        """Train on a round's batches; returns the update's metrics."""

    def set_learning_rate(self, lr: float) -> None:
        """The optimiser's learning rate from the next update on (a schedule sets it per round)."""

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (normaliser included) on the CPU: what actors run."""

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON-able meta): everything needed to resume, for a checkpoint."""

    def load_state_dict(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Inverse of ``state_dict``."""

    def policy_parameters(self) -> list[nn.Parameter]:
        """The trainable policy parameters (what the detector differentiates)."""

    def trained_samples(self) -> int:
        """Samples in the last update's batch; 0 before the first update."""

    def objective(self, indices: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The policy loss on ``indices`` of the last update's batch, as a differentiable
        function of ``policy_parameters()``: the boosting detector's objective."""


@runtime_checkable
class OffPolicyLearner(Learner, Protocol):
    def replay_update(self) -> dict[str, float] | None:
        """One update from replayed batches only; None when nothing is left to replay."""


def make_learner(config: NitroConfig) -> Learner:
    """The learner of ``config.algo`` for ``config.env_id``."""
    spec = env_spec(config.env_id)
    common = {"seed": config.seed, "device": config.device, "arch": config.model.architecture(),
              "noise_scale": config.scaler.name == "kungfu"}
    if config.algo == "impact":
        return ImpactLearner(spec, config.impact, **common)
    return PPOLearner(spec, config.ppo, **common)


# The two learners, imported after the contract they implement (their modules import nothing
# from this one at run time, so the order only matters to a reader).
from nitro.learners.impact import ImpactLearner  # noqa: E402
from nitro.learners.ppo import PPOLearner  # noqa: E402

__all__ = ["Batch", "ImpactLearner", "Learner", "OffPolicyLearner", "PPOLearner", "make_learner"]
