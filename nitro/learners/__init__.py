"""Learners: what the engine needs of an RL algorithm, and the two Nitro ships.

``Learner`` (``contract.py``) is everything the engine may ask; ``PPOLearner`` (on-policy) and
``ImpactLearner`` (off-policy, which also replays) implement it, and ``make_learner`` picks one
from the run's configuration. The engine holds a ``Learner`` and never looks inside it.
"""

from __future__ import annotations

from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.learners.contract import Batch, Learner, OffPolicyLearner, Progress, UpdateResult
from nitro.learners.impact import ImpactLearner
from nitro.learners.ppo import PPOLearner


def make_learner(config: NitroConfig) -> Learner:
    """The learner of ``config.algo`` for ``config.env_id``, with its section of the config."""
    spec = env_spec(config.env_id)
    common = {"seed": config.seed, "device": config.device, "arch": config.model.architecture(),
              "noise_scale": config.scaler.name == "kungfu"}
    if config.algo == "impact":
        return ImpactLearner(spec, config.impact, **common)
    return PPOLearner(spec, config.ppo, **common)


__all__ = ["Batch", "ImpactLearner", "Learner", "OffPolicyLearner", "PPOLearner", "Progress", "UpdateResult",
           "make_learner"]
