"""The gradient noise scale of a round, from its actor fragments (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training", appendix A; smoothed as AdaptDL's
``adaptdl/torch/gradient_noise_scale.py`` does).

The learner computes, at the pre-update parameters, one gradient g_i per actor fragment (the
batch one actor brought; N equal fragments) and reports two numbers per loss: the mean squared
norm of the fragments' gradients, mean_i |g_i|^2, and the squared norm of their mean g,
|g|^2. With g_i = G + e_i, E e_i = 0 and tr Cov(e_i) = S (the noise of one fragment's gradient):

    E mean_i |g_i|^2 = |G|^2 + S,    E |g|^2 = |G|^2 + S / N

so the unbiased estimates are

    |G|^2 ~ (N |g|^2 - mean_i |g_i|^2) / (N - 1)
    S     ~ (mean_i |g_i|^2 - |g|^2) N / (N - 1)

and the noise scale is phi = S / |G|^2 in fragments, phi x (samples per fragment) in samples
(S per sample is S x samples per fragment: the fragment's steps average into its gradient). A
whole fragment as the unit absorbs the correlation between the steps of one trajectory.

One round's ratio is mostly estimator noise: |G|^2 and S are each smoothed with a bias-corrected
exponential moving average, and the ratio is taken of the smoothed values, with |G|^2 clipped away
from zero (``MAX_PHI_SAMPLES``). The policy loss's phi drives the scaler; the value loss's is a
diagnostic beside it (it differs by about an order of magnitude).

What the learner reports (``UpdateResult.diagnostics``, read by ``measurement_from``; the
learner side is ``nitro/learners/fragments.py``):
``noise_fragments`` (N), ``noise_fragment_samples`` (mean samples per fragment),
``noise_policy_frag_sqnorm`` and ``noise_policy_mean_sqnorm`` (the policy loss's mean_i |g_i|^2 and
|g|^2), ``noise_value_frag_sqnorm`` and ``noise_value_mean_sqnorm`` (the value loss's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from nitro.learners.fragments import (
    FRAGMENT_SAMPLES,
    FRAGMENTS,
    POLICY_FRAG_SQNORM,
    POLICY_MEAN_SQNORM,
    VALUE_FRAG_SQNORM,
    VALUE_MEAN_SQNORM,
)

# The largest phi the smoothed estimate reports, in samples: |G|^2 is clipped to at least
# tr(Sigma) / MAX_PHI_SAMPLES. A million samples is some 60 rounds of 64 actors x 256 steps: every
# actor count in range is then deep in the noise-dominated regime, where progress grows with the
# batch, so the clip changes no decision and keeps the ratio finite.
MAX_PHI_SAMPLES = 1e6


@dataclass(frozen=True)
class FragmentNorms:
    """One loss's gradients over one round's N fragments, as the learner reports them."""

    fragments: int  # N
    fragment_samples: float  # mean samples per fragment
    frag_sqnorm: float  # mean_i |g_i|^2
    mean_sqnorm: float  # |mean_i g_i|^2

    def grad_sqnorm(self) -> float:
        """The unbiased estimate of |G|^2 (may be negative: it is a difference of noisy terms)."""
        n = self.fragments
        return (n * self.mean_sqnorm - self.frag_sqnorm) / (n - 1)

    def trace_sigma(self) -> float:
        """The unbiased estimate of tr(Sigma) of one fragment's gradient (may be negative)."""
        n = self.fragments
        return (self.frag_sqnorm - self.mean_sqnorm) * n / (n - 1)


@dataclass(frozen=True)
class NoiseMeasurement:
    """One round's measurement: the policy loss's fragments, and the value loss's where reported."""

    policy: FragmentNorms
    value: FragmentNorms | None = None


def _finite(x: float | None) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and math.isfinite(x)


def measurement_from(diagnostics: Mapping[str, float]) -> NoiseMeasurement | None:
    """The round's measurement from the learner's diagnostics; None where it reported none, or one
    that cannot be used (fewer than two fragments, a value that is not finite)."""
    n, samples = diagnostics.get(FRAGMENTS), diagnostics.get(FRAGMENT_SAMPLES)
    if not (_finite(n) and _finite(samples)) or n < 2 or samples <= 0:
        return None
    fragments, fragment_samples = int(n), float(samples)

    def norms(frag_key: str, mean_key: str) -> FragmentNorms | None:
        frag, mean = diagnostics.get(frag_key), diagnostics.get(mean_key)
        if not (_finite(frag) and _finite(mean)):
            return None
        return FragmentNorms(fragments, fragment_samples, float(frag), float(mean))

    policy = norms(POLICY_FRAG_SQNORM, POLICY_MEAN_SQNORM)
    if policy is None:
        return None
    return NoiseMeasurement(policy, norms(VALUE_FRAG_SQNORM, VALUE_MEAN_SQNORM))


def pooled(groups: Sequence[FragmentNorms]) -> FragmentNorms | None:
    """Fragments measured in groups, each group at its own parameters (Stellaris: the first pass's
    gradients, grouped by the snapshot version they were computed at), as one measurement. Each
    group of at least two fragments gives unbiased |G|^2 and S; they are pooled with weights
    n_g - 1 (the degrees of freedom, as a pooled variance weighs its groups; S per sample, as the
    groups' fragment sizes may differ) and returned as the norms N fragments at one point would
    show, N the groups' fragments together: mean_i |g_i|^2 = |G|^2 + S and |g|^2 = |G|^2 + S / N,
    from which ``grad_sqnorm`` and ``trace_sigma`` give the pooled values back. None when no group
    has two fragments."""
    usable = [g for g in groups if g.fragments >= 2]
    if not usable:
        return None
    weights = [g.fragments - 1 for g in usable]
    total = sum(weights)
    grad = sum(w * g.grad_sqnorm() for w, g in zip(weights, usable)) / total
    samples = sum(w * g.fragment_samples for w, g in zip(weights, usable)) / total
    trace = sum(w * g.trace_sigma() * g.fragment_samples for w, g in zip(weights, usable)) / total / samples
    n = sum(g.fragments for g in usable)
    return FragmentNorms(n, samples, frag_sqnorm=grad + trace, mean_sqnorm=grad + trace / n)


def pool_measurements(measurements: Sequence[NoiseMeasurement]) -> NoiseMeasurement | None:
    """Rounds' worth of groups measured at different parameters as one measurement (``pooled`` for
    each loss; the value loss's only where every group reports it)."""
    policy = pooled([m.policy for m in measurements])
    if policy is None:
        return None
    values = [m.value for m in measurements if m.value is not None]
    return NoiseMeasurement(policy, pooled(values) if len(values) == len(measurements) else None)


def diagnostics_of(m: NoiseMeasurement) -> dict[str, float]:
    """The learner's diagnostics that ``measurement_from`` reads ``m`` back from."""
    out = {FRAGMENTS: float(m.policy.fragments), FRAGMENT_SAMPLES: m.policy.fragment_samples,
           POLICY_FRAG_SQNORM: m.policy.frag_sqnorm, POLICY_MEAN_SQNORM: m.policy.mean_sqnorm}
    if m.value is not None:
        out |= {VALUE_FRAG_SQNORM: m.value.frag_sqnorm, VALUE_MEAN_SQNORM: m.value.mean_sqnorm}
    return out


@dataclass
class BiasCorrectedEMA:
    """An exponential moving average whose start is not pulled towards zero: the biased average
    divided by the weight its terms carry (Adam's correction; AdaptDL's ``_update_avg``)."""

    decay: float
    biased: float = 0.0
    weight: float = 0.0

    def update(self, x: float) -> None:
        self.biased = self.decay * self.biased + (1.0 - self.decay) * x
        self.weight = self.decay * self.weight + (1.0 - self.decay)

    @property
    def value(self) -> float | None:
        return self.biased / self.weight if self.weight > 0 else None


@dataclass(frozen=True)
class NoiseScale:
    """The smoothed estimate: |G|^2, tr(Sigma) per sample, and phi in samples."""

    grad_sqnorm: float  # |G|^2 as smoothed, before the clip
    trace_sigma: float  # tr(Sigma) of one sample's gradient, smoothed, at least 0
    phi: float  # tr(Sigma) / |G|^2 in samples, |G|^2 clipped (MAX_PHI_SAMPLES)
    clipped: bool  # |G|^2 was at or below the clip
    measurements: int  # rounds smoothed into it


class NoiseTracker:
    """One loss's noise scale, smoothed over rounds (see the module docstring)."""

    def __init__(self, decay: float):
        self.grad = BiasCorrectedEMA(decay)
        self.trace = BiasCorrectedEMA(decay)
        self.measurements = 0

    def update(self, m: FragmentNorms) -> None:
        """Smooth in one round: |G|^2 as estimated, tr(Sigma) scaled to one sample's gradient."""
        self.grad.update(m.grad_sqnorm())
        self.trace.update(m.trace_sigma() * m.fragment_samples)
        self.measurements += 1

    def estimate(self) -> NoiseScale | None:
        """The smoothed noise scale; None before the first measurement."""
        g, s = self.grad.value, self.trace.value
        if g is None or s is None:
            return None
        trace = max(0.0, s)
        floor = trace / MAX_PHI_SAMPLES
        clipped = g <= floor
        phi = trace / g if not clipped else (MAX_PHI_SAMPLES if trace > 0 else 0.0)
        return NoiseScale(g, trace, phi, clipped, self.measurements)

    def state_dict(self) -> dict[str, float]:
        return {"grad_biased": self.grad.biased, "grad_weight": self.grad.weight,
                "trace_biased": self.trace.biased, "trace_weight": self.trace.weight,
                "measurements": self.measurements}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.grad.biased, self.grad.weight = float(state["grad_biased"]), float(state["grad_weight"])
        self.trace.biased, self.trace.weight = float(state["trace_biased"]), float(state["trace_weight"])
        self.measurements = int(state["measurements"])


def efficiency(batch: float, phi: float) -> float:
    """The share of an infinite batch's progress a step on ``batch`` samples makes: B / (B + phi)
    (McCandlish et al. 2018)."""
    return batch / (batch + phi) if batch + phi > 0 else 0.0


def adascale_gain(batch: float, base_batch: float, phi: float) -> float:
    """AdaScale's gain r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2) for S = batch / base_batch
    (Johnson et al. 2020), with sigma^2 / mu^2 = phi / base_batch: the learning-rate factor that
    makes one step on ``batch`` samples worth r steps on ``base_batch``. Between 1 and S."""
    scale = batch / base_batch
    return (phi + base_batch) / (phi + batch) * scale
