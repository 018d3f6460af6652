"""The learner contract: everything the engine and the boosting detector may ask of an algorithm.

The engine holds a ``Learner`` and calls only what is written here; an algorithm's settings, its
learning-rate schedule and the names of its diagnostics stay inside it. A new kind of learner
implements this protocol (``docs/ARCHITECTURE.md`` says where it plugs in).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from nitro.envs import EnvSpec
from nitro.learners.gradients import Gradients
from nitro.models.networks import Policy

Batch = Mapping[str, np.ndarray]  # one actor's trajectory batch (docs/ARCHITECTURE.md lists its arrays)


@dataclass(frozen=True)
class Progress:
    """Where the run stands when an update starts: the round that makes it and the rounds the run
    plans. Rounds count from 0 and round 0 makes no update, so the first update is round 1's. A
    schedule (e.g. PPO's annealed learning rate) reads it."""

    round: int
    rounds: int
    # The factor on the round's learning rate: AdaScale's gain for this update's minibatches (the
    # goodput scaler's ``scale_step``, ``GoodputScaler.step_gain``); 1 for every other run.
    lr_gain: float = 1.0


@dataclass(frozen=True)
class UpdateResult:
    """What one update did. The engine reads the typed fields; ``diagnostics`` holds every value
    the update measured (the counts below included) under the name it is logged with, prefixed
    by the learner's ``name`` in MLflow."""

    sgd_steps: int = 0
    skipped_minibatches: int = 0  # minibatches whose loss or gradient was not finite (no step taken)
    cut_short: bool = False  # the deadline stopped the update before its last minibatch
    grad_noise_scale: float = math.nan  # B_simple at the pre-update parameters; NaN unless measured
    diagnostics: Mapping[str, float] = field(default_factory=dict)

    @property
    def took_no_step(self) -> bool:
        """Every minibatch was skipped: the learner could not learn from what it was given."""
        return self.skipped_minibatches > 0 and self.sgd_steps == 0


@runtime_checkable
class Learner(Protocol):
    """An algorithm's learner side: it trains on actor batches and publishes policy weights."""

    name: str  # the algorithm, as config.algo names it; the prefix of its diagnostics in MLflow
    spec: EnvSpec

    def update(self, batches: Sequence[Batch], *, progress: Progress | None = None,
               deadline: float | None = None) -> UpdateResult:
        """Train on a round's batches. ``progress``: where the run stands (None outside a run: no
        schedule moves). ``deadline``: a ``time.perf_counter()`` value after which no further
        minibatch step starts (None: none)."""

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
    """A learner that can also train on what it has stored, while no new batch has landed."""

    def replay_update(self, *, deadline: float | None = None) -> UpdateResult | None:
        """One update from replayed batches only; None when nothing is left to replay."""


@runtime_checkable
class GradientLearner(Learner, Protocol):
    """A learner whose update splits where RLlib's Learner splits it: ``compute_gradients`` on a
    minibatch, ``apply_gradients`` of one or more of them in one optimiser step. Its synchronous
    ``update`` is the two in a loop; Stellaris computes the gradients in learner functions (at a
    snapshot of the networks, ``ppo_loss.ppo_gradients``) and its parameter server applies them. The
    learner keeps its optimiser, its schedule and its statistics: nothing outside writes them."""

    def parameter_names(self) -> dict[str, nn.Parameter]:
        """Every trainable parameter by the name its gradient carries."""

    def prepare(self, batches: Sequence[Batch]) -> Any:
        """The batches as the training tensors ``compute_gradients`` reads."""

    def compute_gradients(self, data: Any, rows: torch.Tensor) -> Gradients:
        """The loss's gradients on ``rows`` of prepared ``data`` at the current networks."""

    def apply_gradients(self, gradients: Sequence[Gradients], *, weights: Sequence[float] | None = None,
                        progress: Progress | None = None) -> bool:
        """One optimiser step on their mean weighted by samples x ``weights``, at the schedule's rate
        for ``progress``; False (no step) when a loss or gradient is not finite."""

    def close_update(self, batches: Sequence[Batch], behaviour: Policy) -> dict[str, float]:
        """End an update made of ``apply_gradients`` calls on ``batches``, acted by ``behaviour``:
        the KL coefficient adapts, the statistics merge, the update counts."""
