"""What an actor steps with, built from the published weights (a ``Policy``'s state dict as arrays).

An MLP policy's forward pass runs in numpy (``NumpyMLPPolicy``), and this module imports no
PyTorch: an actor of a vector-observation env starts without it. A CNN policy's forward runs in
PyTorch (``nitro.models.networks.CNNActor``), which only an image env's actor imports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from nitro.envs import EnvSpec
from nitro.models import OBS_CLIP, Action, Architecture, layer_of

if TYPE_CHECKING:
    from nitro.models.networks import CNNActor


class NumpyMLPPolicy:
    """An MLP policy's forward pass in numpy, for actors.

    One step of an actor runs the policy on one observation. Through torch that costs about
    365 us (dispatch, distribution argument checks, a float64 normaliser), more than
    ``env.step`` itself; the same arithmetic in numpy costs about 50 us. The numbers it computes
    are those of ``nitro.models.networks.Policy`` to float32 rounding, and it samples from ``rng``
    exactly as ``Policy.sample`` does, so the two are interchangeable in a rollout.
    """

    def __init__(self, weights: Mapping[str, np.ndarray], arch: Architecture, continuous: bool):
        """From an MLP ``Policy``'s state dict: ``obs_norm.*``, the Linear layers ``body.<i>``
        (the activations between them hold no weights), and ``log_std`` if ``continuous``."""
        self.continuous = continuous
        if "obs_norm.mean" not in weights or "obs_norm.var" not in weights:
            raise ValueError("the weights have no observation normaliser: they are not an MLP policy's")
        self.mean = np.array(weights["obs_norm.mean"], dtype=np.float64)
        self.inv_std = 1.0 / np.sqrt(np.asarray(weights["obs_norm.var"], dtype=np.float64) + 1e-8)
        indices = sorted(int(m.group(1)) for k in weights if (m := re.fullmatch(r"body\.(\d+)\.weight", k)))
        n_hidden = len(arch.hidden) if arch.hidden else 2  # None: the paper's two layers
        if len(indices) != n_hidden + 1:
            raise ValueError(f"the weights have {len(indices)} layers, their architecture {n_hidden + 1}")
        self.layers = [(np.ascontiguousarray(w.T, dtype=np.float32), np.asarray(b, dtype=np.float32))
                       for w, b in (layer_of(weights, f"body.{i}") for i in indices)]
        self.activation = np.tanh if arch.activation == "tanh" else _relu
        if self.continuous:
            if "log_std" not in weights:
                raise ValueError("the weights have no log_std: they are not a continuous policy's")
            self.log_std = np.asarray(weights["log_std"], dtype=np.float64)
            self.std = np.exp(self.log_std).astype(np.float32)
            self._logp_const = -float(self.log_std.sum()) - 0.5 * len(self.log_std) * math.log(2 * math.pi)

    def _out(self, obs: np.ndarray) -> np.ndarray:
        x = np.clip((np.asarray(obs, dtype=np.float64) - self.mean) * self.inv_std, -OBS_CLIP, OBS_CLIP)
        x = x.astype(np.float32)
        last = len(self.layers) - 1
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if i < last:
                x = self.activation(x)
        return x

    def act(self, obs: np.ndarray) -> Action:
        out = self._out(obs)
        return out if self.continuous else np.int64(int(out.argmax()))

    def sample(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[Action, float]:
        out = self._out(obs)
        if self.continuous:
            noise = rng.standard_normal(len(out)).astype(np.float32)
            action = out + self.std * noise
            z = (action.astype(np.float64) - out) / self.std  # the noise as float32 rounding left it
            return action, float(self._logp_const - 0.5 * float(z @ z))
        logits = out.astype(np.float64)
        logp_all = logits - logits.max()
        logp_all -= np.log(np.exp(logp_all).sum())
        gumbel = -np.log(-np.log(rng.uniform(1e-12, 1.0, size=logp_all.shape)))
        a = int(np.argmax(logp_all + gumbel))
        return np.int64(a), float(logp_all[a])


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def acting_policy(spec: EnvSpec, arch: Architecture, weights: Mapping[str, np.ndarray]) -> CNNActor | NumpyMLPPolicy:
    """What an actor of ``spec``'s env steps with, holding ``weights``: the numpy MLP of a vector
    observation's policy, the batched CNN forward of an image's (which imports PyTorch)."""
    if spec.is_image:
        from nitro.models.networks import CNNActor

        return CNNActor(weights, arch)
    return NumpyMLPPolicy(weights, arch, spec.continuous)
