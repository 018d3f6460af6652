"""The networks: an MLP Gaussian (or categorical) policy with a separate critic of the same shape
for vector observations, and a CNN for stacked frames (Atari and other image envs): RLlib's 84x84
filters (the paper's), or DQN's Nature CNN (SB3's and CleanRL's).

Two sides, one set of weights:

- ``nitro.models.networks`` (PyTorch): the modules the learner trains, and the batched CNN
  forward that Atari actors step with.
- ``nitro.models.acting`` (numpy only): what an actor steps with, built from the published weights
  themselves. An actor of a vector-observation env never imports PyTorch, which costs a second or
  more of every fresh actor process (a local worker, a Ray worker, a Lambda cold start).

This package itself holds what both sides share and imports no PyTorch either: the MLP's shape is
an ``Architecture`` (widths, activation, initial log-std): the paper's is 2x256 tanh
(docs/decisions.md); the tuned default is in ``nitro/config/algorithms.py``. It travels with the
weights (``Architecture.to_meta``) so that an actor builds the same network the learner trains.

The policy carries its observation normaliser as buffers, so ``policy.state_dict()`` is the whole
thing an actor needs: the statistics ship with the weights. The critic stays on the learner and
reads the policy's normalised features (``networks.evaluate``), so both see one set of statistics;
on an image env with ``Architecture.shared_trunk`` it is a value head on the policy's CNN trunk,
as SB3's and CleanRL's Atari PPO, and ``Architecture.cnn`` says which CNN (docs/tuning.md says
which the presets use).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

HIDDEN = 256  # the CNN's dense layer, and the paper's MLP width
OBS_CLIP = 10.0  # normalised observations are clipped to +-OBS_CLIP

# A continuous action's vector, or a discrete action's index.
Action = np.ndarray | np.int64


@dataclass(frozen=True)
class Architecture:
    """The MLP's shape; for image envs, which CNN and whether the critic reads the policy's trunk."""

    hidden: tuple[int, ...] | None = None  # None: the paper's two layers of HIDDEN
    activation: str = "tanh"  # "tanh" | "relu"
    log_std_init: float = 0.0  # initial log standard deviation of the Gaussian policy
    shared_trunk: bool = False  # image envs: a value head on the policy's trunk, not a critic of its own
    cnn: str = "paper"  # image envs: "paper" (RLlib's 84x84 filters, 256 features) | "nature" (DQN's, 512)

    def to_meta(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_meta(cls, text: str | None) -> Architecture:
        """From ``to_meta``'s text; None (weights published without one) is the paper's shape."""
        if not text:
            return cls()
        d = json.loads(text)
        hidden = None if d["hidden"] is None else tuple(int(h) for h in d["hidden"])
        return cls(hidden=hidden, activation=str(d["activation"]),
                   log_std_init=float(d["log_std_init"]), shared_trunk=bool(d.get("shared_trunk", False)),
                   cnn=str(d.get("cnn", "paper")))


def layer_of(weights: Mapping[str, np.ndarray], name: str) -> tuple[np.ndarray, np.ndarray]:
    """The (weight, bias) of the layer ``name`` in a state dict, or a one-line error."""
    try:
        return np.asarray(weights[f"{name}.weight"]), np.asarray(weights[f"{name}.bias"])
    except KeyError:
        raise ValueError(f"the weights have no layer {name!r}: they are not this env's policy") from None
