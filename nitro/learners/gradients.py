"""Gradients as values: what a learner's ``compute_gradients`` returns and its ``apply_gradients``
takes (RLlib's Learner has the same seam).

A synchronous update computes and applies one minibatch's gradients in turn; under Stellaris
learner functions compute them against a snapshot elsewhere and the parameter server applies a
group of them at once. A gradient is one tensor per trainable parameter, named as it travels
(``policy.<name>``, ``critic.<name>``); a parameter the loss did not reach has no entry, so that
the optimiser leaves it (and its moments) alone, as ``loss.backward()`` would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class Gradients:
    """One loss evaluation's gradients: ``samples`` rows, the ``loss`` they are the gradient of
    (not finite: there are no tensors, and applying them takes no step) and its detached terms."""

    tensors: Mapping[str, torch.Tensor]
    samples: int
    loss: float
    terms: Mapping[str, float] = field(default_factory=dict)

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


def parameter_names(policy: nn.Module, critic: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable parameters a gradient carries, by the name it travels under (the policy's
    first, in their order; the normaliser's statistics are buffers, not among them)."""
    named = {f"policy.{k}": p for k, p in policy.named_parameters() if p.requires_grad}
    named.update({f"critic.{k}": p for k, p in critic.named_parameters()})
    return named


def gradients_of(total: torch.Tensor, terms: Mapping[str, torch.Tensor], named: Mapping[str, nn.Parameter],
                 samples: int) -> Gradients:
    """The gradient of ``total`` with respect to ``named``; no backward when ``total`` is not finite."""
    loss = float(total.detach())
    values = {k: float(v) for k, v in terms.items()}
    if not math.isfinite(loss):
        return Gradients({}, samples, loss, values)
    grads = torch.autograd.grad(total, list(named.values()), allow_unused=True)
    return Gradients({name: g for name, g in zip(named, grads) if g is not None}, samples, loss, values)


def weighted_mean(gradients: Sequence[Gradients], weights: Sequence[float]) -> tuple[dict[str, torch.Tensor], float]:
    """(sum_i n_i w_i g_i / sum_i n_i w_i, sum_i n_i w_i / sum_i n_i): the mean of the gradients
    weighted by their samples n_i and factors w_i, and the learning-rate factor that keeps w_i a
    factor on the step (Adam all but undoes a scale on the gradient itself). One gradient at
    weight 1 comes back as it is, factor 1. A parameter some gradient lacks counts as 0 there."""
    if len(gradients) != len(weights) or not gradients:
        raise ValueError("weighted_mean needs one weight per gradient, and at least one gradient")
    if len(gradients) == 1 and weights[0] == 1.0:
        return dict(gradients[0].tensors), 1.0
    mass = [g.samples * w for g, w in zip(gradients, weights)]
    total, samples = sum(mass), sum(g.samples for g in gradients)
    if total <= 0:
        raise ValueError("weighted_mean: the gradients' weights sum to 0")
    names = list(dict.fromkeys(name for g in gradients for name in g.tensors))
    mean = {}
    for name in names:
        acc: torch.Tensor | None = None
        for g, m in zip(gradients, mass):
            if name in g.tensors:
                term = g.tensors[name] * (m / total)
                acc = term if acc is None else acc + term
        assert acc is not None  # the name came from some gradient
        mean[name] = acc
    return mean, total / samples


def clipped(tensors: Sequence[torch.Tensor], max_norm: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the tensors scaled to a joint L2 norm of at most ``max_norm``, their joint norm before): the
    scaling ``nn.utils.clip_grad_norm_`` applies to ``.grad`` in place, made into new tensors, so
    that a gradient a caller still holds is never rescaled under it (and none is copied first)."""
    norm = nn.utils.get_total_norm(tensors)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return [t * scale for t in tensors], norm
