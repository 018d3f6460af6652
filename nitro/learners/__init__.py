"""Learners: what the engine needs of an RL algorithm, and the two Nitro ships.

``Learner`` (``contract.py``) is everything the engine may ask; ``PPOLearner`` (on-policy) and
``ImpactLearner`` (off-policy, which also replays) implement it, and ``make_learner`` picks one
from the run's configuration. The engine holds a ``Learner`` and never looks inside it.

A learner trains on ``config.device``: ``cuda`` puts its networks, optimiser and prepared batches
(Atari's observations as uint8) on the GPU, and the boosting detector runs its Hessian-vector
products there too; the weights it publishes and its checkpoints are CPU copies, so actors and
resumes never see the device.
"""

from __future__ import annotations

import torch

from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.learners.compiled import when_to_compile
from nitro.learners.contract import Batch, GradientLearner, Learner, OffPolicyLearner, Progress, UpdateResult
from nitro.learners.gradients import Gradients
from nitro.learners.impact import ImpactLearner
from nitro.learners.ppo import PPOLearner


def make_learner(config: NitroConfig) -> Learner:
    """The learner of ``config.algo`` for ``config.env_id``, with its section of the config."""
    spec = env_spec(config.env_id)
    common = {"seed": config.seed, "device": learner_device(config.device), "arch": config.model.architecture(),
              "noise_scale": config.scaler.name == "kungfu", "fragment_noise": config.scaler.measures_noise}
    if config.algo == "impact":
        return ImpactLearner(spec, config.impact, **common)
    return PPOLearner(spec, config.ppo, compile_loss=when_to_compile(config.learner_compile, config.rounds,
                                                                         budgeted=bool(config.budget_usd)), **common)


def learner_device(name: str) -> torch.device:
    """``name`` as a torch device, or ValueError in one line if it names one this machine lacks."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device {name!r} is not a torch device: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA GPU here (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda or 'none'}); set device: cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


__all__ = ["Batch", "GradientLearner", "Gradients", "ImpactLearner", "Learner", "OffPolicyLearner", "PPOLearner",
           "Progress", "UpdateResult", "learner_device", "make_learner"]
