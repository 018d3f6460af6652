"""The minibatches of an update, the learning-rate schedule, and the gradient noise scale.

The gradient noise scale (McCandlish et al. 2018's B_simple) is what the kungfu scaler reads. An
SGD step itself is ``ActorCriticLearner.apply_gradients`` (nitro/learners/base.py), which refuses a
non-finite loss or gradient: once Adam has taken a NaN its weights and moments are NaN for good."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


def normalise_advantages(adv: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit std (population std, so a 1-sample minibatch gives 0, not NaN)."""
    return (adv - adv.mean()) / (adv.std(correction=0) + 1e-8)


def minibatch_count(n: int, minibatch_size: int, minibatches: int | None = None) -> int:
    """How many minibatches an epoch over ``n`` samples has: ``minibatches`` when given (capped at
    ``n``: every minibatch holds a sample), else ``n / minibatch_size`` rounded, at least one."""
    if minibatches is not None:
        return max(1, min(int(minibatches), n))
    return max(1, round(n / minibatch_size))


def minibatch_indices(n: int, n_minibatches: int, rng: np.random.Generator,
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """A fresh permutation split into ``n_minibatches`` near-equal minibatches (sizes differ by at
    most one, so no runt minibatch of 1 sample, whose advantage normalisation would be meaningless)."""
    perm = torch.as_tensor(rng.permutation(n), device=device)
    return list(torch.tensor_split(perm, n_minibatches))


def noise_scale_from_norms(
    small_sq_norm: float, big_sq_norm: float, b_small: float, b_big: float
) -> tuple[float, float, float]:
    """Gradient noise scale B_simple = tr(Sigma) / |G|^2 from two batch sizes (McCandlish et al.
    2018, appendix A). ``small_sq_norm``: mean |g|^2 of gradients over ``b_small`` samples;
    ``big_sq_norm``: |g|^2 of a gradient over ``b_big`` samples. Unbiased estimates:

        |G|^2     = (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
        tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1/b_small - 1/b_big)

    Returns (tr_sigma, g_sq, b_simple); b_simple is NaN when either estimate is <= 0 (too noisy to
    say). The two parts are returned too so that a consumer can average them over rounds before
    dividing, as the paper advises.
    """
    if b_big <= b_small:
        return float("nan"), float("nan"), float("nan")
    g_sq = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    tr_sigma = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    b_simple = tr_sigma / g_sq if (g_sq > 0 and tr_sigma > 0) else float("nan")
    return float(tr_sigma), float(g_sq), float(b_simple)


def gradient_noise_scale(policy_loss: Callable[[torch.Tensor], torch.Tensor], params: Sequence[torch.Tensor],
                         minibatches: list[torch.Tensor]) -> dict[str, float]:
    """B_simple from per-minibatch policy gradients, all taken at the current (pre-update)
    parameters, so that parameter drift during the epochs is not mistaken for noise. One extra
    forward/backward per minibatch: about 1/epochs of an update's cost."""
    if len(minibatches) < 2:
        nan = float("nan")
        return {"grad_noise_scale": nan, "grad_noise_tr_sigma": nan, "grad_sq_norm": nan}
    total = [torch.zeros_like(p) for p in params]
    sq_norms = []
    for idx in minibatches:
        raw = torch.autograd.grad(policy_loss(idx), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(raw, params)]
        sq_norms.append(sum(float((g.double() ** 2).sum()) for g in grads))
        for acc, g in zip(total, grads):
            acc.add_(g)
    big_sq = sum(float(((acc / len(minibatches)).double() ** 2).sum()) for acc in total)
    b_small = float(np.mean([len(i) for i in minibatches]))
    b_big = float(sum(len(i) for i in minibatches))
    tr_sigma, g_sq, b_simple = noise_scale_from_norms(float(np.mean(sq_norms)), big_sq, b_small, b_big)
    return {"grad_noise_scale": b_simple, "grad_noise_tr_sigma": tr_sigma, "grad_sq_norm": g_sq}


def annealed_lr(lr: float, k: int, rounds: int) -> float:
    """The learning rate of round k's update, decayed linearly over the run as CleanRL's PPO does.

    Round k (k >= 1) updates on round k-1's data, so a run of ``rounds`` rounds makes
    ``rounds - 1`` updates: the first (k = 1) at the full ``lr``, the last at ``lr / (rounds - 1)``,
    never 0 (a round past the planned end, in a resumed run, keeps that floor)."""
    updates = max(rounds - 1, 1)
    return lr * max(1.0 - (k - 1) / updates, 1.0 / updates)
