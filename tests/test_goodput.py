"""The goodput scaler's parts: the noise-scale estimator against a problem whose phi is known in
closed form, the price fit against a hand-written ledger, the decision against hand-worked cases."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from decimal import Decimal

import numpy as np
import pytest

from nitro.config import NitroConfig, PriceTable, ScalerConfig
from nitro.learners.fragments import NOISE_DIAGNOSTICS
from nitro.pricing.cost import CostLedger
from nitro.scaling.base import RoundSignal, round_signal
from nitro.scaling.budget import LearnerBound, cap_by_budget, decision_cost
from nitro.scaling.goodput import (
    BEST,
    HELD,
    MIN_MEASUREMENTS,
    NO_MEASUREMENT,
    REASONS,
    SWITCHED,
    WARMING_UP,
    GoodputScaler,
    choose_count,
)
from nitro.scaling.noise import (
    MAX_PHI_SAMPLES,
    BiasCorrectedEMA,
    FragmentNorms,
    NoiseMeasurement,
    NoiseTracker,
    adascale_gain,
    efficiency,
    measurement_from,
    pool_measurements,
    pooled,
)
from nitro.scaling.prices import (
    ADAM_STEP_S,
    MIN_ROUNDS,
    SAMPLE_S,
    Line,
    PricePrior,
    RoundCharge,
    fit_line,
    ledger_rows,
    price_prior,
)
from nitro.scaling.scalers import make_scaler
from tests.test_engine import drive

# -- the estimator --------------------------------------------------------------------------------
#
# Least squares with Gaussian inputs: loss 0.5 (w.x - y)^2 with x ~ N(0, I_d), y = w*.x + eps,
# eps ~ N(0, s2). A sample's gradient is (a.x - eps) x with a = w - w*, so G = a and
# Cov = (|a|^2 + s2) I + a a^T (Isserlis): tr(Sigma) = d (|a|^2 + s2) + |a|^2 and
# phi = d (1 + s2 / |a|^2) + 1 samples.

D, S2 = 5, 1.0
A = np.array([0.6, -0.8, 0.0, 0.0, 0.0])  # |a|^2 = 1
TRACE = D * (1.0 + S2) + 1.0  # 11
PHI = TRACE / 1.0


def fragment_norms(rng: np.random.Generator, fragments: int, samples: int) -> FragmentNorms:
    """One round: ``fragments`` fragments of ``samples`` samples each, as a learner reports them."""
    x = rng.standard_normal((fragments, samples, D))
    eps = rng.normal(0.0, math.sqrt(S2), (fragments, samples))
    per_sample = ((x @ A) - eps)[..., None] * x
    g = per_sample.mean(axis=1)  # one gradient per fragment
    return FragmentNorms(fragments, float(samples), float((g ** 2).sum(axis=1).mean()),
                         float((g.mean(axis=0) ** 2).sum()))


def test_each_part_is_unbiased_within_its_clt_interval():
    rng = np.random.default_rng(12)
    rounds, fragments, samples = 4000, 8, 16
    draws = [fragment_norms(rng, fragments, samples) for _ in range(rounds)]
    grad = np.array([m.grad_sqnorm() for m in draws])
    trace = np.array([m.trace_sigma() * samples for m in draws])  # per sample
    for values, truth in ((grad, 1.0), (trace, TRACE)):
        se = values.std(ddof=1) / math.sqrt(rounds)
        assert abs(values.mean() - truth) < 4 * se, (values.mean(), truth, se)
    # the naive |g|^2 is biased upwards by tr(Sigma) / (fragments x samples): the correction matters
    naive = np.array([m.mean_sqnorm for m in draws])
    assert naive.mean() - 1.0 > 10 * naive.std(ddof=1) / math.sqrt(rounds)
    assert TRACE / (fragments * samples) == pytest.approx(naive.mean() - 1.0, rel=0.2)


def test_the_smoothed_phi_converges_to_the_closed_form():
    rng = np.random.default_rng(3)
    decay, rounds = 0.99, 3000
    tracker = NoiseTracker(decay)
    single = []
    for _ in range(rounds):
        m = fragment_norms(rng, 8, 16)
        tracker.update(m)
        single.append((m.grad_sqnorm(), m.trace_sigma() * 16))
    est = tracker.estimate()
    assert est is not None and not est.clipped and est.measurements == rounds
    # An EMA of decay d averages like (1 + d) / (1 - d) independent rounds; the ratio's relative
    # error is about the root sum of its two parts' (the delta method).
    parts = np.array(single)
    rel = parts.std(axis=0, ddof=1) / np.abs(parts.mean(axis=0))
    tol = 4 * math.sqrt((rel ** 2).sum() / ((1 + decay) / (1 - decay)))
    assert est.phi == pytest.approx(PHI, rel=tol), (est.phi, PHI, tol)
    assert tol < 0.2  # the tolerance says something


def norms_of(fragments: int, samples: float, grad: float, trace: float) -> FragmentNorms:
    """The norms ``fragments`` fragments at one point show for |G|^2 ``grad`` and S ``trace``."""
    return FragmentNorms(fragments, samples, grad + trace, grad + trace / fragments)


def test_groups_pool_by_their_degrees_of_freedom_by_hand():
    a, b = norms_of(3, 10.0, grad=2.0, trace=6.0), norms_of(5, 10.0, grad=4.0, trace=10.0)
    assert (a.grad_sqnorm(), a.trace_sigma()) == pytest.approx((2.0, 6.0))  # the helper says what it means
    lone = FragmentNorms(1, 10.0, 99.0, 99.0)  # one fragment says nothing about the noise: left out
    got = pooled([a, lone, b])
    assert got is not None and got.fragments == 8 and got.fragment_samples == 10.0
    assert got.grad_sqnorm() == pytest.approx((2 * 2.0 + 4 * 4.0) / 6)  # weights n - 1: 2 and 4
    assert got.trace_sigma() == pytest.approx((2 * 6.0 + 4 * 10.0) / 6)
    # fragments of other sizes pool their noise per sample: S = 6 at 10 samples is 60 per sample,
    # S = 10 at 30 samples is 300; weights 2 and 4 give 220 per sample at 70/3 samples a fragment
    c = norms_of(5, 30.0, grad=4.0, trace=10.0)
    got = pooled([a, c])
    assert got is not None and got.fragment_samples == pytest.approx(70 / 3)
    assert got.trace_sigma() * got.fragment_samples == pytest.approx(220.0)
    assert pooled([lone]) is None and pooled([]) is None
    one = pooled([a])  # one group comes back as it was
    assert one is not None and (one.fragments, one.frag_sqnorm, one.mean_sqnorm) == pytest.approx((3, 8.0, 4.0))
    value = pool_measurements([NoiseMeasurement(a, b), NoiseMeasurement(b, None)])
    assert value is not None and value.value is None  # the value loss only where every group has it


def test_pooled_groups_are_unbiased_within_their_clt_interval():
    """A round's eight fragments measured in groups of 4, 2, 1 and 1 (as Stellaris's versions split
    them): the pooled |G|^2 and S are still the closed form's."""
    rng = np.random.default_rng(5)
    rounds, samples = 3000, 16
    draws = [pooled([fragment_norms(rng, n, samples) for n in (4, 2, 1, 1)]) for _ in range(rounds)]
    grad = np.array([m.grad_sqnorm() for m in draws if m is not None])
    trace = np.array([m.trace_sigma() * samples for m in draws if m is not None])
    assert len(grad) == rounds
    for values, truth in ((grad, 1.0), (trace, TRACE)):
        se = values.std(ddof=1) / math.sqrt(rounds)
        assert abs(values.mean() - truth) < 4 * se, (values.mean(), truth, se)


def test_phi_from_expected_norms_is_exact_and_in_samples():
    # With the expected norms the estimator returns G and S exactly: |g_i|^2 = G + S, |g|^2 = G + S/N.
    n, samples, g2, s_frag = 8, 256.0, 2.0, 30.0
    m = FragmentNorms(n, samples, g2 + s_frag, g2 + s_frag / n)
    assert m.grad_sqnorm() == pytest.approx(g2) and m.trace_sigma() == pytest.approx(s_frag)
    tracker = NoiseTracker(0.9)
    tracker.update(m)
    est = tracker.estimate()
    assert est is not None and est.phi == pytest.approx(s_frag * samples / g2)  # 15 fragments = 3840 samples


def test_bias_corrected_ema_starts_at_the_first_value():
    ema = BiasCorrectedEMA(0.5)
    assert ema.value is None
    ema.update(2.0)
    assert ema.value == 2.0  # biased 1.0, weight 0.5
    ema.update(4.0)
    assert ema.value == pytest.approx(2.5 / 0.75)  # biased 0.5 + 2.0, weight 0.25 + 0.5


def test_grad_norm_clipped_away_from_zero_and_negative_noise_floored():
    tracker = NoiseTracker(0.9)
    tracker.update(FragmentNorms(4, 10.0, frag_sqnorm=5.0, mean_sqnorm=1.0))  # G = (4 - 5)/3 < 0, S > 0
    est = tracker.estimate()
    assert est is not None and est.clipped and est.phi == MAX_PHI_SAMPLES
    quiet = NoiseTracker(0.9)
    quiet.update(FragmentNorms(4, 10.0, frag_sqnorm=1.0, mean_sqnorm=1.1))  # S < 0: no noise
    est = quiet.estimate()
    assert est is not None and est.phi == 0.0 and est.trace_sigma == 0.0


def test_measurement_from_the_learners_diagnostics():
    full = dict(zip(NOISE_DIAGNOSTICS, (8.0, 256.0, 3.0, 1.0, 30.0, 5.0)))
    m = measurement_from({**full, "loss": 0.1})
    assert m == NoiseMeasurement(FragmentNorms(8, 256.0, 3.0, 1.0), FragmentNorms(8, 256.0, 30.0, 5.0))
    policy_only = {k: v for k, v in full.items() if "value" not in k}
    assert measurement_from(policy_only) == NoiseMeasurement(FragmentNorms(8, 256.0, 3.0, 1.0), None)
    assert measurement_from({}) is None
    assert measurement_from({**full, "noise_fragments": 1.0}) is None  # one fragment has no spread
    assert measurement_from({**full, "noise_policy_mean_sqnorm": math.nan}) is None
    signal = round_signal(None, full, None, 1.0, [], 0.0, None)
    assert signal.noise == m and signal.ledger == ()


def test_efficiency_and_adascale_gain_hand_worked():
    assert efficiency(100, 300) == 0.25
    assert efficiency(0, 0) == 0.0
    assert adascale_gain(4 * 256, 256, 256) == pytest.approx(2 * 256 / (5 * 256) * 4)  # 1.6
    assert adascale_gain(1024, 256, 0.0) == pytest.approx(1.0)  # no noise: a bigger batch buys no step
    assert adascale_gain(1024, 256, 1e12) == pytest.approx(4.0)  # all noise: linear scaling


# -- the prices -----------------------------------------------------------------------------------


def history_row(k: int, actors: int, usd: float, seconds: float, evals: int = 0, interrupted: float = 0.0) -> dict:
    return {"round": float(k), "actors_launched": float(actors), "spend_round_usd": usd, "round_billed_s": seconds,
            "eval_invocations": float(evals), "spend_interrupted_usd": interrupted}


def test_ledger_rows_keep_the_rounds_a_fit_can_read():
    history = [history_row(0, 8, 9.0, 1.0, evals=2),  # round 0: nothing before it
               history_row(1, 8, 1.0, 2.0),
               history_row(2, 16, 1.5, 3.0, evals=2),
               history_row(3, 16, 2.0, 4.0, interrupted=0.1),  # also bills a dead attempt
               history_row(4, 0, 0.2, 0.5)]  # a budget run's final evaluation: no training actors
    assert ledger_rows(history) == (RoundCharge(1, 8.0, 8.0, 1.0, 2.0, False),
                                    RoundCharge(2, 16.0, 8.0, 1.5, 3.0, True))


def test_the_fit_is_seeded_until_the_ledger_determines_it():
    prior = Line(1.0, 0.5)
    few = ledger_rows([history_row(k, 8, 10.0, 2.0) for k in range(MIN_ROUNDS)])  # MIN_ROUNDS - 1 usable
    assert fit_line(few, prior, "usd").line == prior and fit_line(few, prior, "usd").source == "prior"
    one_count = ledger_rows([history_row(k, 8, 10.0, 2.0) for k in range(MIN_ROUNDS + 1)])
    fit = fit_line(one_count, prior, "usd")  # the slope stays the prior's, the level is fitted: 10 - 0.5 x 8
    assert (fit.source, fit.rounds) == ("level", MIN_ROUNDS)
    assert fit.line.per_actor == 0.5 and fit.line.fixed == pytest.approx(6.0)
    assert fit_line(one_count, prior, "seconds").line == Line(0.0, 0.5)  # 2 - 0.5 x 8 < 0: the level clipped at 0


def test_the_fit_recovers_a_hand_written_ledger():
    # usd_k = 3 + 0.25 N_k + 0.75 N_{k-1}: c0 = 3, c1 = 1; seconds_k = 0.5 + 0.1 N_k + 0.2 N_{k-1}
    counts = [8] * 7 + [16] * 7 + [8] * 3
    history = [history_row(0, counts[0], 0.0, 0.0)]
    for k in range(1, len(counts)):
        n, before = counts[k], counts[k - 1]
        history.append(history_row(k, n, 3 + 0.25 * n + 0.75 * before, 0.5 + 0.1 * n + 0.2 * before))
    rows = ledger_rows(history)
    usd, seconds = fit_line(rows, Line(0.0, 0.0), "usd"), fit_line(rows, Line(0.0, 0.0), "seconds")
    assert usd.source == "fit" and usd.rounds == len(counts) - 1
    assert usd.line.fixed == pytest.approx(3.0, abs=1e-9) and usd.line.per_actor == pytest.approx(1.0, abs=1e-9)
    assert seconds.line.fixed == pytest.approx(0.5, abs=1e-9) and seconds.line.per_actor == pytest.approx(0.3)
    # two evaluation rounds, each 2.0 dearer than the line: 4.0 spread over the 18 rounds into c0
    evaluated = [*history, history_row(17, 8, 3 + 8 + 2.0, 0.0, evals=2), history_row(18, 8, 3 + 8 + 2.0, 0.0, evals=2)]
    with_eval = fit_line(ledger_rows(evaluated), Line(0.0, 0.0), "usd")
    assert with_eval.line.fixed == pytest.approx(3.0 + 4.0 / 18) and with_eval.line.per_actor == pytest.approx(1.0)


def test_the_prior_follows_the_learner_and_the_actor_pricing():
    base = ["clock.kind=lambda", "backend.timeout_s=5"]
    tuned = price_prior(NitroConfig.load(overrides=base))
    constant = price_prior(NitroConfig.load(overrides=[*base, "ppo.minibatches=32"]))
    vm = price_prior(NitroConfig.load(overrides=[*base, "backend.pricing=vm"]))
    # the tuned learner: 256 samples an actor, 10 epochs of 64-sample minibatches = 40 Adam steps,
    # plus one invocation's dispatch on the projected clock
    assert tuned.seconds.per_actor == pytest.approx(0.0003 + 40 * ADAM_STEP_S + 10 * 256 * SAMPLE_S)
    # constant steps: the 320 Adam steps do not grow with the actors, so they land in the fixed cost
    assert constant.seconds.fixed - tuned.seconds.fixed == pytest.approx(320 * ADAM_STEP_S)
    assert constant.usd.fixed > 2 * tuned.usd.fixed and constant.usd.per_actor < tuned.usd.per_actor
    assert vm.usd != tuned.usd and vm.seconds == tuned.seconds
    # the tuned learner's prior sits in the range fitted from docs/results/boost-equal-money
    assert 2.0e-5 < tuned.usd.per_actor < 3.5e-5 and 3e-5 < tuned.usd.fixed < 1e-4


# -- the decision ---------------------------------------------------------------------------------
#
# One sample per actor, c0 = 4, c1 = 1, phi = 16: progress per dollar n / ((n + 16)(n + 4)) is
# largest at B* = sqrt(16 x 4 / 1) = 8, where it is 8/288 = 1/36; at n = 2 it is 2/108 = 1/54
# (8 gains 50% over 2) and at n = 6 it is 6/220 (8 gains 220/216 - 1 = 1.85% over 6).


def test_the_best_count_and_its_predicted_gain_hand_worked():
    line = Line(4.0, 1.0)
    c = choose_count(2, 16.0, 1, line, 2, 32, 0.05)
    assert (c.actors, c.best, c.reason) == (8, 8, SWITCHED)
    assert c.gain_over_current == pytest.approx(0.5) and c.gain_over_min == pytest.approx(0.5)
    held = choose_count(6, 16.0, 1, line, 2, 32, 0.05)  # 1.85% under the 5% threshold: stay
    assert (held.actors, held.best, held.reason) == (6, 8, HELD)
    assert held.gain_over_current == pytest.approx(220 / 216 - 1)
    assert held.gain_over_min == pytest.approx((6 / 220) / (2 / 108) - 1)
    assert choose_count(6, 16.0, 1, line, 2, 32, 0.01).actors == 8  # a lower threshold switches
    assert choose_count(8, 16.0, 1, line, 2, 32, 0.05).reason == BEST
    # no fixed cost: more samples never pay per dollar, whatever phi (goodput.md's c0 -> 0 case)
    assert choose_count(20, 16.0, 1, Line(0.0, 1.0), 2, 32, 0.05).actors == 2  # 1/(n + 16): 1/18 vs 1/36
    # per second with a flat clock, more actors always pay: up to I_max once the gain is worth it
    assert choose_count(2, 16.0, 1, Line(10.0, 0.0), 2, 32, 0.05).actors == 32


def expected_norms(phi_fragments: float, fragments: int = 8, samples: float = 1.0) -> dict[str, float]:
    """Diagnostics whose estimate is exactly phi_fragments x samples: |G|^2 = 1, S = phi_fragments."""
    return {
        "noise_fragments": float(fragments),
        "noise_fragment_samples": samples,
        "noise_policy_frag_sqnorm": 1.0 + phi_fragments,
        "noise_policy_mean_sqnorm": 1.0 + phi_fragments / fragments,
        "noise_value_frag_sqnorm": 1.0 + 10 * phi_fragments,
        "noise_value_mean_sqnorm": 1.0 + 10 * phi_fragments / fragments,
    }


def goodput(**fields) -> GoodputScaler:
    cfg = ScalerConfig(name="goodput", i_min=2, i_max=32, **fields)
    scaler = GoodputScaler(cfg, 0, steps_per_actor=1, prior=PricePrior(Line(4.0, 1.0), Line(10.0, 0.0)))
    return scaler


def signal(phi: float | None, history=()) -> RoundSignal:
    return round_signal(None, expected_norms(phi) if phi is not None else {}, None, 1.0, list(history), 0.0, None)


def warmed(s: GoodputScaler, phi: float) -> int:
    """Feed ``s`` the rounds of measurement it takes before acting (each keeps I_min and says
    so); returns the next round's index."""
    for k in range(MIN_MEASUREMENTS - 1):
        assert s.decide(k, signal(phi)) == s.cfg.i_min and s.last["reason"] == WARMING_UP
        assert s.last["phi"] == pytest.approx(phi)  # logged while warming up, not yet acted on
    return MIN_MEASUREMENTS - 1


def test_goodput_keeps_i_min_and_says_why_until_the_learner_measures():
    s = goodput()
    assert [s.decide(k, signal(None)) for k in range(3)] == [2, 2, 2]
    assert s.last["reason"] == NO_MEASUREMENT and s.last["measured"] is False
    m = s.round_metrics(2)
    assert m["goodput/reason"] == REASONS.index(NO_MEASUREMENT) and math.isnan(m["goodput/phi"])
    assert m["goodput/c0_usd"] == 4.0 and m["goodput/c1_usd"] == 1.0 and m["goodput/prices"] == 0.0
    assert s.round_metrics(1) == {} and s.round_tags(2) == {}


def test_goodput_decides_on_the_smoothed_phi_with_hysteresis():
    s = goodput()
    k = warmed(s, 16.0)
    assert s.decide(k, signal(16.0)) == 8  # phi = 16 samples: B* = 8, 50% over I_min
    assert s.last["reason"] == SWITCHED and s.last["gain_over_min"] == pytest.approx(0.5)
    assert s.last["phi"] == pytest.approx(16.0) and s.last["phi_value"] == pytest.approx(160.0)
    tags = s.round_tags(k)
    assert list(tags) == [f"goodput.switch.round-{k:05d}"] and tags[f"goodput.switch.round-{k:05d}"].startswith(
        "2 -> 8 actors: predicted +50.0% progress per dollar at phi 16 samples (c0 $4, c1 $1 per actor, prior")
    metrics = s.round_metrics(k)
    assert metrics["goodput/best_actors"] == 8 and metrics["goodput/reason"] == REASONS.index(SWITCHED)
    # phi drifts to 12 (smoothed: the EMA moves part of the way): best 7 or so, under 5% better: held
    assert s.decide(k + 1, signal(12.0)) == 8 and s.last["reason"] in (HELD, BEST)
    # a large phi (B* = sqrt(400 x 4) = 40, beyond I_max) wins over the smoothing within rounds
    counts = [s.decide(j, signal(400.0)) for j in range(k + 2, k + 30)]
    assert counts == sorted(counts) and counts[-1] > 16
    assert s.last["reason"] in (HELD, BEST) and s.last["gain_over_current"] <= 0.05  # near the best: no flapping
    assert sum(a != b for a, b in itertools.pairwise(counts)) <= 3


def test_goodput_state_dict_round_trip_continues_identically():
    a, b = goodput(), goodput()
    phis = [16.0, 30.0, None, 100.0, 400.0, 8.0, 250.0, 64.0]
    for k in range(4):
        a.decide(k, signal(phis[k]))
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.decide(k, signal(phis[k])) for k in range(4, 8)] == [b.decide(k, signal(phis[k])) for k in range(4, 8)]


def test_goodput_refits_its_prices_each_round_from_the_ledger():
    s = goodput()
    # a ledger with no fixed cost at all: then no count beats I_min per dollar, whatever phi
    counts = [2] * 7 + [4] * 7
    history = [history_row(k, n, 1.0 * n, 1.0) for k, n in enumerate(counts)]
    k = warmed(s, 16.0)
    assert s.decide(k, signal(16.0)) == 8  # on the prior (c0 = 4)
    assert s.decide(k + 1, signal(16.0, history)) == 2
    assert s.last["prices"] == "fit" and s.last["c0_usd"] == pytest.approx(0.0, abs=1e-9)


def test_goodput_objective_time_uses_the_seconds_line():
    s = goodput(objective="time")  # the prior's clock is flat (10 s a round): the largest count
    k = warmed(s, 16.0)
    assert s.decide(k, signal(16.0)) == 32
    assert "progress per second" in s.round_tags(k)[f"goodput.switch.round-{k:05d}"]


def test_step_gain_offered_only_when_asked():
    plain, scaled = goodput(), goodput(scale_step=True)
    for s in (plain, scaled):
        s.decide(warmed(s, 16.0), signal(16.0))
    assert plain.step_gain(8) == 1.0 and plain.last["step_gain"] == 1.0
    assert scaled.step_gain(8) == pytest.approx((16 + 2) / (16 + 8) * 4)  # AdaScale's r against I_min = 2
    assert scaled.last["step_gain"] == pytest.approx(3.0)
    assert goodput(scale_step=True).step_gain(8) == 1.0  # no measurement yet


def test_step_gain_is_the_minibatchs_gain_hand_worked():
    """AdaScale's gain is per step, so per minibatch: at phi = 1000 samples, 256 steps an actor and
    I_min = 8, the constant-steps learner (32 minibatches) steps on 64 samples at 8 actors and on
    512 at 64, r = (1000 + 64) / (1000 + 512) x 8 = 5.63; 64-sample minibatches never grow, r = 1."""
    cfg = ScalerConfig(name="goodput", i_min=8, i_max=64, scale_step=True)
    prior = PricePrior(Line(4.0, 1.0), Line(10.0, 0.0))
    constant = GoodputScaler(cfg, 0, steps_per_actor=256, prior=prior, minibatches=lambda n: 32)
    sized = GoodputScaler(cfg, 0, steps_per_actor=256, prior=prior, minibatches=lambda n: max(1, round(n / 64)))
    for s in (constant, sized):
        for k in range(MIN_MEASUREMENTS):
            s.decide(k, signal(1000.0))
    assert constant.step_gain(64) == pytest.approx(1064 / 1512 * 8) and constant.step_gain(8) == pytest.approx(1.0)
    assert sized.step_gain(64) == pytest.approx(1.0)
    # the run's config says which learner it is
    run = NitroConfig.load(overrides=["scaler.name=goodput", "scaler.scale_step=true", "ppo.minibatches=32"])
    made = make_scaler(run.scaler, 0, steps_per_actor=run.steps_per_actor, run=run)
    assert isinstance(made, GoodputScaler) and made.minibatches(16384) == 32 and made.minibatches(2048) == 32


def test_scale_step_is_refused_where_nothing_would_scale():
    with pytest.raises(ValueError, match="scale_step: AdaScale's gain comes from goodput's noise estimate; "
                                         "scaler 'nitro' has none"):
        NitroConfig.load(overrides=["scaler.scale_step=true"])
    with pytest.raises(ValueError, match=r"scaler\.scale_step scales the sync learner's minibatch steps"):
        NitroConfig.load(overrides=["scaler.name=goodput", "scaler.scale_step=true", "learner.mode=stellaris"])


def test_the_engines_budget_cap_binds_what_goodput_wants():
    """The scaler asks; the engine's cap (nitro.scaling.budget.cap_by_budget) decides what the
    budget pays for, as for every scaler: here 8 wanted, 5 affordable."""
    s = goodput()
    wanted = s.decide(warmed(s, 16.0), signal(16.0))
    assert wanted == 8
    ledger = CostLedger(PriceTable(), memory_mb=1024, local_actors=True, max_billed_ms=5000)
    bound = LearnerBound(parallel=64, timeout_s=5.0)
    affordable = decision_cost(ledger, bound, 0.0, 5, 5 * 256, 5)
    cap = cap_by_budget(ledger, bound, wanted=wanted, affordable=affordable, elapsed_s=0.0, eval_invocations=0,
                        steps_per_actor=256)
    assert cap.n_actors == 5
    assert cap_by_budget(ledger, bound, wanted=wanted, affordable=affordable * 10, elapsed_s=0.0, eval_invocations=0,
                         steps_per_actor=256).n_actors == 8
    assert cap_by_budget(ledger, bound, wanted=wanted, affordable=Decimal(0), elapsed_s=0.0, eval_invocations=0,
                         steps_per_actor=256).n_actors == 0


def test_make_scaler_seeds_goodput_from_the_runs_config():
    run = NitroConfig.load(overrides=["scaler.name=goodput", "ppo.minibatches=32", "clock.kind=lambda"])
    s = make_scaler(run.scaler, 0, steps_per_actor=run.steps_per_actor, run=run)
    assert isinstance(s, GoodputScaler) and s.prior == price_prior(run) and s.steps_per_actor == 256
    alone = make_scaler(ScalerConfig(name="goodput"), 0, steps_per_actor=128)
    assert isinstance(alone, GoodputScaler) and alone.steps_per_actor == 128
    assert run.scaler.measures_noise and not NitroConfig.load().scaler.measures_noise
    assert NitroConfig.load(overrides=["scaler.measure_noise=true"]).scaler.measures_noise


# -- a tiny run -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    from nitro.actors.local import LocalActorPool

    with LocalActorPool(workers=2, timeout_s=60, memory_mb=1024) as p:
        yield p


def tiny_run(redis_url: str, run_id: str, tmp_path, rounds: int = 3, ppo: dict | None = None,
             scaler: dict | None = None):
    from nitro.cache import TrajectoryCache, connect_redis
    from nitro.run.engine import TrainingRun

    cfg = NitroConfig.load({"steps_per_actor": 64, "rounds": rounds, "home": str(tmp_path), "eval": {"every_rounds": 0},
                            "ppo": ppo or {}, "scaler": {"name": "goodput", "i_min": 2, "i_max": 6, **(scaler or {})}})
    return TrainingRun(cfg, run_id, TrajectoryCache(connect_redis(redis_url), run_id, ttl_s=600), redis_url)


def report_noise(training, monkeypatch, phi_fragments: float) -> None:
    """Make the run's learner report, beside its own diagnostics, a noise measurement whose
    estimate is ``phi_fragments`` fragments of 64 samples (two fragments a round)."""
    update = training.learner.update

    def measured(*args, **kwargs):
        result = update(*args, **kwargs)
        return dataclasses.replace(result, diagnostics={**result.diagnostics,
                                                        **expected_norms(phi_fragments, fragments=2, samples=64.0)})

    monkeypatch.setattr(training.learner, "update", measured)


def test_a_tiny_run_measures_from_its_first_update(redis_url, pool, tmp_path):
    """Round 0 makes no update, so goodput keeps I_min and says why; from round 1 the PPO learner
    measures the fragments (one per actor) and every decision reads a finite phi."""
    training = tiny_run(redis_url, "goodput-measured-by-ppo", tmp_path)
    reports = drive(training, pool, 3)
    first = reports[0].metrics
    assert int(first["actors_launched"]) == 2 and first["goodput/reason"] == REASONS.index(NO_MEASUREMENT)
    assert first["goodput/measured"] == 0 and math.isnan(first["goodput/phi"]) and first["goodput/c1_usd"] > 0
    for r in reports[1:]:
        assert r.metrics["goodput/measured"] == 1 and math.isfinite(r.metrics["goodput/phi"])
        assert r.metrics["goodput/reason"] != REASONS.index(NO_MEASUREMENT)
        assert r.metrics["ppo/noise_fragments"] >= 2  # one fragment per actor of the round before
        assert 2 <= r.metrics["actors_launched"] <= 6


def test_a_tiny_run_follows_the_noise_the_learner_reports(redis_url, pool, tmp_path, monkeypatch):
    """The learner's side of the interface fed by hand: its update reports a large noise scale
    (10^4 fragments of 64 samples), so once MIN_MEASUREMENTS rounds have measured it (rounds 1-3)
    goodput asks for I_max."""
    training = tiny_run(redis_url, "goodput-measured", tmp_path, rounds=5)
    report_noise(training, monkeypatch, 1e4)
    reports = drive(training, pool, 5)
    k = MIN_MEASUREMENTS  # round 0 makes no update; rounds 1..k measure
    assert [int(r.metrics["actors_launched"]) for r in reports] == [2] * k + [6] * (5 - k)
    assert [r.metrics["goodput/reason"] for r in reports[1:k]] == [REASONS.index(WARMING_UP)] * (k - 1)
    assert reports[k].metrics["goodput/phi"] == pytest.approx(64e4)
    assert (
        reports[k].metrics["goodput/reason"] == REASONS.index(SWITCHED)
        and reports[k].metrics["goodput/gain_over_min"] > 0.05
    )
    assert list(reports[k].tags) == [f"goodput.switch.round-{k:05d}"] and reports[k + 1].tags == {}
    assert reports[1].metrics["ppo/noise_fragments"] == 2.0  # the learner's diagnostics are logged as ever


def test_a_scaled_step_reaches_the_update_after_a_boost(redis_url, pool, tmp_path, monkeypatch):
    """With ``scale_step`` and the constant-steps learner, the update after goodput's switch trains
    the new count's batches at the learning rate times AdaScale's gain of its minibatches; every
    update before it at the gain of I_min's, 1."""
    training = tiny_run(redis_url, "goodput-scaled", tmp_path, rounds=5, ppo={"minibatches": 4},
                        scaler={"scale_step": True})
    report_noise(training, monkeypatch, 10.0)
    reports = drive(training, pool, 5)
    k = MIN_MEASUREMENTS
    actors = [int(r.metrics["actors_launched"]) for r in reports]
    n = actors[k]
    assert actors[:k] == [2] * k and n > 2  # the switch
    gains = [r.metrics["ppo/lr_gain"] for r in reports[1:]]
    # phi = 640 samples; minibatches of 2 x 64 / 4 = 32 samples at I_min, n x 16 at n actors
    assert gains == pytest.approx([1.0] * k + [(640 + 32) / (640 + n * 16) * n / 2])
    assert gains[-1] > 1.5
    assert [r.metrics["ppo/lr"] for r in reports[1:]] == pytest.approx([3e-4 * g for g in gains])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_goodput_decisions_reach_mlflow_through_the_flow(prefect_api, tmp_path, redis_url):
    """A tiny run through the `nitro-train` flow: every round's decision is an MLflow metric
    (goodput/*) and the scaler's settings are params."""
    import asyncio

    from mlflow.tracking import MlflowClient

    from flows.training import train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = ["rounds=2", "steps_per_actor=64", "scaler.name=goodput", "scaler.i_min=2", "scaler.i_max=4",
                 "backend.workers=2", "eval.every_rounds=0", f"home={tmp_path / 'home'}", f"tracking.mlflow_uri={uri}",
                 f"redis.url={redis_url}"]
    result = asyncio.run(train(overrides=overrides, run_id="goodput-flow"))
    assert result.rounds_done == 2
    client = MlflowClient(tracking_uri=uri)
    for name in ("goodput/reason", "goodput/c0_usd", "goodput/c1_usd", "goodput/phi", "goodput/gain_over_min"):
        assert sorted(m.step for m in client.get_metric_history(result.mlflow_run_id, name)) == [0, 1], name
    measured = sorted((m.step, m.value) for m in client.get_metric_history(result.mlflow_run_id, "goodput/measured"))
    assert measured == [(0, 0.0), (1, 1.0)]  # round 0 makes no update; round 1's learner measures
    params = client.get_run(result.mlflow_run_id).data.params
    assert params["scaler.name"] == "goodput" and params["scaler.switch_gain"] == "0.05"
