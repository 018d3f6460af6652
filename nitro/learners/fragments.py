"""The gradients of a round's actor fragments at the pre-update parameters: what the goodput
scaler's noise estimate reads (``nitro/scaling/noise.py`` turns these norms into the gradient
noise scale, McCandlish et al. 2018, appendix A).

A fragment is one actor's batch of the round. The learner computes one gradient g_i per fragment
with its own ``compute_gradients`` (the loss it trains on, before any step of the update) and
reports, per part of the network, the mean squared norm of the fragments' gradients and the
squared norm of their mean. The policy part is the policy loss's gradient; the critic part is the
value loss's (scaled by ``vf_coef``, which cancels in the noise scale's ratio).

Each fragment contributes at most ``ROWS_PER_FRAGMENT`` rows, evenly strided over its steps: the
measurement then costs about a fortieth of a 10-epoch update instead of a tenth, and the rows of a
fragment still span its whole segment, so their correlation stays inside the unit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

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


def fragment_norms(compute: Callable[[torch.Tensor], Gradients], rows: Sequence[torch.Tensor]) -> dict[str, float]:
    """The noise diagnostics of the fragments ``rows`` (``compute``: the learner's gradients on
    some rows) and the seconds they took; empty with fewer than two fragments or a loss that is
    not finite."""
    if len(rows) < 2:
        return {}
    started = time.perf_counter()
    frag_sq = dict.fromkeys(PARTS, 0.0)
    sums: dict[str, torch.Tensor] = {}
    for idx in rows:
        g = compute(idx)
        if not g.finite:
            return {}
        for name, t in g.tensors.items():
            t64 = t.detach().double()
            frag_sq[name.split(".", 1)[0]] += float((t64 ** 2).sum())
            sums[name] = sums[name] + t64 if name in sums else t64.clone()
    n = len(rows)
    mean_sq = dict.fromkeys(PARTS, 0.0)
    for name, total in sums.items():
        mean_sq[name.split(".", 1)[0]] += float(((total / n) ** 2).sum())
    out = {FRAGMENTS: float(n), FRAGMENT_SAMPLES: sum(len(r) for r in rows) / n}
    for part, (frag_key, mean_key) in PARTS.items():
        out[frag_key] = frag_sq[part] / n
        out[mean_key] = mean_sq[part]
    out[SECONDS] = time.perf_counter() - started
    return out
