"""The behaviour policies the learner published, kept to check a batch's log-probabilities.

An actor writes, for each step, the log-probability of its action under the policy version it
acted with (the batch's ``weights_version``). PPO's ratio and IMPACT's V-trace divide by it, so a
batch whose log-probabilities are not the policy's (-1e30, say) makes every minibatch of the
update non-finite and voids the round's update, good batches included. The learner published
those weights itself: ``BehaviourPolicies`` keeps the last ``KEEP_VERSIONS`` of them, recomputes
the log-probabilities with one forward pass over the batch and refuses (``BatchError``, one line)
a batch whose values disagree beyond a float tolerance, or that names a version it does not keep.

The tolerance is ``atol + rtol * |recomputed|``: actors compute in numpy (float32 network,
float64 Gaussian term) and the learner in torch, whose float32 sums differ in the last digits.
An action of 1e30 is refused here too: its recomputed log-probability is -inf.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch

from nitro.envs import EnvSpec
from nitro.learners.distributions import FORWARD_CHUNK
from nitro.models import Architecture
from nitro.models.networks import Policy
from nitro.validation import BatchError

KEEP_VERSIONS = 3  # the version being acted with, and two before it (IMPACT's late batches)


class BehaviourPolicies:
    """Weights by policy version (a small bounded dict, oldest dropped first) and the check."""

    def __init__(self, spec: EnvSpec, arch: Architecture, *, atol: float, rtol: float, keep: int = KEEP_VERSIONS):
        self.atol, self.rtol, self.keep = float(atol), float(rtol), int(keep)
        self.weights: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._policy = Policy(spec, arch)
        self._loaded: int | None = None

    def remember(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Keep ``weights`` (detached copies) as policy ``version``."""
        self.weights[int(version)] = {k: v.detach().cpu().clone() for k, v in weights.items()}
        self.weights.move_to_end(int(version))
        while len(self.weights) > self.keep:
            self.weights.popitem(last=False)
        if self._loaded == int(version):
            self._loaded = None

    def versions(self) -> list[int]:
        return list(self.weights)

    def recompute(self, batch: Mapping[str, np.ndarray], version: int) -> np.ndarray:
        """log pi_version(actions | obs) for every step of ``batch``, float64."""
        if self._loaded != version:
            self._policy.load_state_dict(self.weights[version])
            self._loaded = version
        obs, actions = torch.as_tensor(batch["obs"]), torch.as_tensor(batch["actions"])
        with torch.no_grad():
            parts = [self._policy.distribution(o).log_prob(a)
                     for o, a in zip(torch.split(obs, FORWARD_CHUNK), torch.split(actions, FORWARD_CHUNK))]
        return torch.cat(parts).double().numpy()

    def check(self, batch: Mapping[str, np.ndarray], version: int | None) -> None:
        """Raise ``BatchError`` unless the batch's log-probabilities are those of policy ``version``."""
        if version is None or version not in self.weights:
            kept = ", ".join(map(str, self.weights)) or "none"
            raise BatchError(f"weights_version {version} is not a policy version the learner keeps (kept: {kept})")
        expected = self.recompute(batch, version)
        given = np.asarray(batch["logp"], np.float64)
        off = np.abs(given - expected)
        bad = ~np.isfinite(expected) | ~(off <= self.atol + self.rtol * np.abs(expected))
        if bad.any():
            worst = int(np.argmax(np.where(bad, np.nan_to_num(off, nan=np.inf), -1.0)))
            raise BatchError(f"logp disagrees with policy version {version} at {int(bad.sum())} of {len(given)} "
                             f"steps (step {worst}: {given[worst]:.4g} given, {expected[worst]:.4g} recomputed; "
                             f"tolerance {self.atol:g} + {self.rtol:g}*|logp|)")
