"""The gradients of a round's actor fragments at the pre-update parameters: what the goodput
scaler's noise estimate reads (``nitro/scaling/noise.py`` turns these norms into the gradient
noise scale, McCandlish et al. 2018, appendix A).

A fragment is one actor's batch of the round. The learner computes one gradient g_i per fragment
with its own ``compute_gradients`` (the loss it trains on, before any step of the update) and
reports, per part of the network, the mean squared norm of the fragments' gradients and the
squared norm of their mean. The policy part is the policy loss's gradient; the critic part is the
value loss's (scaled by ``vf_coef``, which cancels in the noise scale's ratio). A CNN's shared trunk
is the policy's: its gradient, the value loss's through it included, counts in the policy part.

Each fragment contributes at most ``ROWS_PER_FRAGMENT`` rows, evenly strided over its steps: the
measurement then costs about a fortieth of a 10-epoch update instead of a tenth, and the rows of a
fragment still span its whole segment, so their correlation stays inside the unit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from nitro.learners.gradients import Gradients

FRAGMENTS = "noise_fragments"
FRAGMENT_SAMPLES = "noise_fragment_samples"
POLICY_FRAG_SQNORM = "noise_policy_frag_sqnorm"
POLICY_MEAN_SQNORM = "noise_policy_mean_sqnorm"
VALUE_FRAG_SQNORM = "noise_value_frag_sqnorm"
VALUE_MEAN_SQNORM = "noise_value_mean_sqnorm"
SECONDS = "noise_seconds"
NOISE_DIAGNOSTICS = (FRAGMENTS, FRAGMENT_SAMPLES, POLICY_FRAG_SQNORM, POLICY_MEAN_SQNORM, VALUE_FRAG_SQNORM,
                     VALUE_MEAN_SQNORM)

ROWS_PER_FRAGMENT = 64
PARTS = {"policy": (POLICY_FRAG_SQNORM, POLICY_MEAN_SQNORM), "critic": (VALUE_FRAG_SQNORM, VALUE_MEAN_SQNORM)}


def fragment_rows(lengths: Sequence[int], cap: int = ROWS_PER_FRAGMENT,
                  device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The rows of each non-empty fragment in the concatenated batch (fragments of ``lengths``
    rows, in order, empty ones skipped as ``prepare_batches`` skips them), at most ``cap`` of each,
    evenly strided."""
    rows, start = [], 0
    for n in lengths:
        if n <= 0:
            continue
        step = max(1, math.ceil(n / cap))
        rows.append(torch.arange(start, start + n, step, device=device))
        start += n
    return rows


class FragmentSums:
    """Running sums over fragments' gradients, per part of the network: the sum of |g_i|^2 and, per
    parameter, the sum of g_i (float64), so that no fragment's gradient is kept."""

    def __init__(self) -> None:
        self.fragments = 0
        self.samples = 0.0
        self.frag_sq = dict.fromkeys(PARTS, 0.0)
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, tensors: Mapping[str, torch.Tensor], samples: float) -> None:
        """One fragment's gradient by parameter name (``policy.*``, ``critic.*``) and its samples."""
        for name, t in tensors.items():
            t64 = t.detach().double()
            self.frag_sq[name.split(".", 1)[0]] += float((t64 ** 2).sum())
            self.sums[name] = self.sums[name] + t64 if name in self.sums else t64.clone()
        self.fragments += 1
        self.samples += samples

    def norms(self) -> dict[str, float]:
        """The noise diagnostics of the fragments added (no ``SECONDS``); empty with fewer than two."""
        n = self.fragments
        if n < 2:
            return {}
        mean_sq = dict.fromkeys(PARTS, 0.0)
        for name, total in self.sums.items():
            mean_sq[name.split(".", 1)[0]] += float(((total / n) ** 2).sum())
        out = {FRAGMENTS: float(n), FRAGMENT_SAMPLES: self.samples / n}
        for part, (frag_key, mean_key) in PARTS.items():
            out[frag_key] = self.frag_sq[part] / n
            out[mean_key] = mean_sq[part]
        return out


def fragment_norms(compute: Callable[[torch.Tensor], Gradients], rows: Sequence[torch.Tensor]) -> dict[str, float]:
    """The noise diagnostics of the fragments ``rows`` (``compute``: the learner's gradients on
    some rows) and the seconds they took; empty with fewer than two fragments or a loss that is
    not finite."""
    if len(rows) < 2:
        return {}
    started = time.perf_counter()
    sums = FragmentSums()
    for idx in rows:
        g = compute(idx)
        if not g.finite:
            return {}
        sums.add(g.tensors, len(idx))
    return sums.norms() | {SECONDS: time.perf_counter() - started}
