"""Scalers against hand-worked sequences; checkpoints; the budget property."""

from __future__ import annotations

import json
import math
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from nitro.config import PriceTable, ScalerConfig
from nitro.pricing.cost import CostLedger
from nitro.scaling.budget import LearnerBound, decision_cost, largest_affordable
from nitro.scaling.scalers import (
    SCALERS,
    NitroScaler,
    RandomScaler,
    RoundSignal,
    boost_prob_for_mean,
    make_scaler,
)
from nitro.stellaris.allowance import FunctionAllowance

NAN = float("nan")
_SCHEDULER_FILE: list[str] = []


def scaler_config(name: str, **fields) -> ScalerConfig:
    """``ScalerConfig(name=name, **fields)``; minionsrl gets a (barely) pre-trained scheduler file."""
    if name == "minionsrl":
        if not _SCHEDULER_FILE:
            import tempfile
            from pathlib import Path

            from nitro.config.minionsrl import PretrainConfig
            from nitro.scaling.minionsrl.pretrain import pretrain, save_scheduler

            scheduler, _ = pretrain(PretrainConfig(episodes=1, simulator={"rounds": 2}))
            _SCHEDULER_FILE.append(str(save_scheduler(Path(tempfile.mkdtemp()) / "minionsrl.safetensors", scheduler)))
        fields["minionsrl"] = {"path": _SCHEDULER_FILE[0]}
    if name == "replay":  # another run's counts, within this config's bounds
        lo = fields.get("i_min", 8)
        fields["replay_actors"] = [lo, fields.get("i_max", 64), lo, lo + (fields.get("i_max", 64) - lo) // 2]
    return ScalerConfig(name=name, **fields)


def run(scaler, Rs=None, gns=None):
    n = len(Rs if Rs is not None else gns)
    return [
        scaler.decide(k, RoundSignal(R=None if Rs is None else Rs[k], grad_noise_scale=None if gns is None else gns[k]))
        for k in range(n)
    ]


def test_nitro_hand_worked_sequence():
    """n=3, d=0.9, I_min=2, I_max=20; k is the round index. W holds the last 3 valid raw R.
    k=0 R=None           -> missing: I_min = 2, W=[]
    k=1 R=2.0  W=[2]     -> max == min: 2
    k=2 R=1.0  W=[2,1]   -> S=(2-1)/(2-1)*0.9^2 = 0.81;          20*0.81 = 16.2      -> 16
    k=3 R=3.0  W=[2,1,3] -> S=(3-3)/2 * 0.9^3 = 0;                clip(0)            -> 2
    k=4 R=1.5  W=[1,3,1.5] -> S=(3-1.5)/(3-1)*0.9^4 = 0.75*0.6561 = 0.492075; 9.8415 -> 10
    k=5 R=nan            -> missing: 2, W unchanged
    k=6 R=1.0  W=[3,1.5,1] -> S=(3-1)/(3-1)*0.9^6 = 0.531441;    10.62882           -> 11
    k=7 R=2.0  W=[1.5,1,2] -> S=(2-2)/1 = 0                                          -> 2
    k=8 R=0.5  W=[1,2,0.5] -> S=(2-0.5)/(2-0.5)*0.9^8 = 0.43046721; 8.6093442       -> 9
    k=9 R=inf            -> missing: 2
    """
    cfg = ScalerConfig(name="nitro", window=3, decay=0.9, i_min=2, i_max=20)
    s = make_scaler(cfg, seed=0)
    Rs = [None, 2.0, 1.0, 3.0, 1.5, NAN, 1.0, 2.0, 0.5, math.inf]
    assert run(s, Rs) == [2, 2, 16, 2, 10, 2, 11, 2, 9, 2]
    assert list(s.window) == [1.0, 2.0, 0.5]


def test_nitro_scores_are_the_formula_not_the_official_code():
    cfg = ScalerConfig(name="nitro", window=3, decay=0.9, i_min=2, i_max=20)
    s = NitroScaler(cfg)
    s.decide(0, RoundSignal(R=2.0))
    s.decide(1, RoundSignal(R=1.0))
    assert s.last["score"] == pytest.approx(0.9)  # d^1 once, not d^2; raw values in the window
    assert list(s.window) == [2.0, 1.0]
    s.decide(2, RoundSignal(R=1.5))
    assert s.last["score"] == pytest.approx(0.5 * 0.81)
    assert s.last["window_min"] == 1.0 and s.last["window_max"] == 2.0


def test_nitro_defaults_hand_worked():
    """Defaults n=6, d=0.96, I_min=8, I_max=64.
    k=1 R=1.2 -> 8 (one value); k=2 R=0.8 -> S=1*0.96^2=0.9216, 58.98 -> 59;
    k=3 R=1.0 -> S=(1.2-1.0)/0.4*0.96^3 = 0.5*0.884736 = 0.442368, 28.31 -> 28;
    k=4 R=2.0 -> 0 -> 8; k=5 R=0.8 -> S=(2-0.8)/1.2*0.96^5 = 0.8153727, 52.18 -> 52;
    k=6 R=0.8 -> same window min: S=0.96^6=0.78275779, 50.1 -> 50."""
    s = make_scaler(ScalerConfig(), seed=0)
    assert run(s, [None, 1.2, 0.8, 1.0, 2.0, 0.8, 0.8]) == [8, 8, 59, 28, 8, 52, 50]
    # late rounds: d^k caps the boost; at k=60, 64*0.96^60 = 5.54 -> clipped to I_min
    assert s.decide(60, RoundSignal(R=0.1)) == 8


def test_nitro_flat_window_never_crashes():
    s = make_scaler(ScalerConfig(window=4), seed=0)
    assert run(s, [1.0, 1.0, 1.0, 1.0, 1.0]) == [8] * 5
    assert s.last["reason"] == "window max == min"


def test_baselines_hand_worked():
    cfg = ScalerConfig(i_min=8, i_max=64, fixed_actors=16, hydrozoa_start=8, hydrozoa_every=10)
    fixed = make_scaler(cfg.model_copy(update={"name": "fixed"}), 0)
    assert run(fixed, [None] * 3) == [16, 16, 16]
    always = make_scaler(cfg.model_copy(update={"name": "always"}), 0)
    assert run(always, [0.1, None, 5.0]) == [64, 64, 64]
    hyd = make_scaler(cfg.model_copy(update={"name": "hydrozoa"}), 0)
    assert [hyd.decide(k, RoundSignal()) for k in (0, 9, 10, 19, 20, 30, 49, 10_000)] == [8, 8, 16, 16, 32, 64, 64, 64]
    # kungfu, 512 steps per actor: ceil(B/512) clipped to [8, 64], never down, missing keeps
    kf = make_scaler(cfg.model_copy(update={"name": "kungfu"}), 0, steps_per_actor=512)
    gns = [None, 2048.0, 10_000.0, 5000.0, NAN, -3.0, 20_000.0, 1e9]
    #       8     ceil 4->8   ceil 19.53->20  20 (no down) 20   20    ceil 39.06->40  64
    assert run(kf, gns=gns) == [8, 8, 20, 20, 20, 20, 40, 64]


def test_random_matches_expected_spend():
    assert boost_prob_for_mean(8, 8, 64) == 0.0
    assert boost_prob_for_mean(22, 8, 64) == 0.25  # (22-8)/(64-8)
    assert boost_prob_for_mean(100, 8, 64) == 1.0
    cfg = ScalerConfig(name="random", i_min=8, i_max=64, random_mean_actors=22.0)
    s = make_scaler(cfg, seed=3)
    assert isinstance(s, RandomScaler) and s.p == 0.25 and s.expected_actors() == 22.0
    decisions = [s.decide(k, RoundSignal()) for k in range(4000)]
    assert set(decisions) == {8, 64}
    assert sum(decisions) / len(decisions) == pytest.approx(22.0, rel=0.05)
    # reproducible per (seed, round): a retried round draws the same
    again = make_scaler(cfg, seed=3)
    assert [again.decide(k, RoundSignal()) for k in range(50)] == decisions[:50]
    assert again.decide(7, RoundSignal()) == decisions[7]
    # without a mean to match, the configured share of rounds
    assert make_scaler(ScalerConfig(name="random", random_boost_prob=0.5), 0).p == 0.5


def test_replay_plays_the_recorded_counts_in_a_shuffled_order_block_by_block():
    counts = [8, 8, 8, 16, 24, 32, 64]
    cfg = ScalerConfig(name="replay", replay_actors=counts)
    s = make_scaler(cfg, seed=4)
    played = [s.decide(k, RoundSignal()) for k in range(3 * len(counts))]
    for block in range(3):  # every block of L rounds plays the same counts, each block in its own order
        assert sorted(played[block * len(counts):(block + 1) * len(counts)]) == sorted(counts)
    assert played[:7] != counts and played[:7] != played[7:14]  # shuffled (fixed seed: not by chance equal)
    again = make_scaler(cfg, seed=4)
    assert [again.decide(k, RoundSignal()) for k in range(len(played))] == played  # per (seed, round)
    assert make_scaler(cfg, seed=5).decide(0, RoundSignal()) in counts
    assert s.last["replayed_round"] in range(len(counts))
    with pytest.raises(ValueError, match="replay_actors"):
        make_scaler(ScalerConfig(name="replay"), 0)


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_state_dict_round_trip(name):
    cfg = scaler_config(name, window=3)
    Rs = [None, 1.0, 0.5, 2.0, 0.7, 0.3, 1.1, 0.2, 0.9, 0.4]
    gns = [None, 900.0, 5000.0, 3000.0, 8000.0, NAN, 12_000.0, 1000.0, 40_000.0, 10.0]
    a = make_scaler(cfg, seed=5)
    for k in range(5):
        a.decide(k, RoundSignal(R=Rs[k], grad_noise_scale=gns[k]))
    state = json.loads(json.dumps(a.state_dict()))
    b = make_scaler(cfg, seed=5)
    b.load_state_dict(state)
    for k in range(5, 10):
        sig = RoundSignal(R=Rs[k], grad_noise_scale=gns[k])
        assert a.decide(k, sig) == b.decide(k, sig)
    with pytest.raises(ValueError):
        make_scaler(ScalerConfig(name="always" if name != "always" else "fixed"), 0).load_state_dict(state)


def test_largest_affordable_rules():
    def linear(per_actor: str, fixed: str):  # the round's fixed cost plus n actors, in exact decimals
        return lambda n: Decimal(fixed) + n * Decimal(per_actor)

    assert largest_affordable(64, None, linear("1", "5")) == 64  # no budget
    assert largest_affordable(64, 10.0, linear("0.5", "2")) == 16  # (10-2)/0.5
    assert largest_affordable(64, 10.0, linear("0.5", "2"), min_actors=8) == 16
    assert largest_affordable(64, 5.0, linear("0.5", "2"), min_actors=8) == 0  # 6 fit, fewer than 8: stop
    assert largest_affordable(64, 5.0, linear("0.5", "2")) == 6  # launch fewer
    assert largest_affordable(4, 5.0, linear("0.5", "2"), min_actors=8) == 4  # the scaler asked for fewer than 8
    assert largest_affordable(64, 1.0, linear("0.5", "2")) == 0  # cannot even pay the learner
    assert largest_affordable(64, 0.3, linear("0.1", "0")) == 3  # exact decimals: 0.3/0.1 is 3, not 2.9999
    assert largest_affordable(64, 10.0, linear("0", "2")) == 64
    assert largest_affordable(0, 10.0, linear("1", "0")) == 0
    with pytest.raises(ValueError, match="not a finite amount"):
        largest_affordable(8, NAN, linear("1", "0"))


money = st.decimals(min_value=Decimal("0"), max_value=Decimal("0.0001"), places=10)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    name=st.sampled_from(sorted(SCALERS)),
    learner_per_hour=st.decimals(min_value=Decimal("0"), max_value=Decimal("5"), places=4),
    gb_s=money,
    per_million=st.decimals(min_value=Decimal("0"), max_value=Decimal("1"), places=4),
    prov=money,
    prov_dur=money,
    memory_mb=st.integers(128, 10240),
    arch=st.sampled_from(["x86_64", "arm64"]),
    provisioned=st.integers(0, 16),
    timeout_ms=st.integers(1, 900_000),
    parallel=st.integers(1, 64),
    steps=st.integers(1, 2048),
    eval_invocations=st.sampled_from([0, 2, 20]),
    budget=st.decimals(min_value=Decimal("0"), max_value=Decimal("20"), places=4),
    rounds=st.integers(1, 40),
    i_min=st.integers(1, 16),
    i_span=st.integers(0, 64),
    stop_below_i_min=st.booleans(),
    jobs_per_actor=st.sampled_from([0, 0, 3, 10]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
# No scaler touches the global `random`; a thread an earlier test leaves in this xdist worker (a
# client's retry jitter) can move it during a draw, which Hypothesis reports as a strategy's use.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
def test_budget_is_never_exceeded(data, name, learner_per_hour, gb_s, per_million, prov, prov_dur, memory_mb, arch,
                                  provisioned, timeout_ms, parallel, steps, eval_invocations, budget, rounds, i_min,
                                  i_span, stop_below_i_min, jobs_per_actor, seed):
    """The engine's budget cap, round after round: scaler -> ``largest_affordable`` with the
    engine's own ``decision_cost`` -> actors billed anything up to (and past: the ledger cuts at)
    their timeout -> ledger. The learner's time is drawn as the engine bounds it, not from the
    last round: a round's part before its decision (the update and detection, the first update
    included) anywhere up to what the previous decision allowed for it, measured when the
    decision is made; its actors' part anywhere up to their timeout-bounded waves. Learner times
    far beyond the old reservation (twice the last round) are drawn too. The ledger never passes
    the budget; the run stops exactly when the cap says 0. With Stellaris's learner functions
    (``jobs_per_actor``), the cap prices them at their allowance and the lanes enforce it: each
    job's invocation is taken in a drawn order and billed anything up to twice its timeout."""
    prices = PriceTable(
        learner_per_hour=float(learner_per_hour), lambda_gb_s_x86=float(gb_s), lambda_gb_s_arm=float(gb_s),
        lambda_per_million_requests=float(per_million), provisioned_gb_s=float(prov),
        provisioned_duration_gb_s=float(prov_dur), provisioned_gb_s_arm=float(prov),
        provisioned_duration_gb_s_arm=float(prov_dur),
    )
    ledger = CostLedger(prices, memory_mb=memory_mb, architecture=arch, provisioned_concurrency=provisioned,
                        local_actors=True, max_billed_ms=timeout_ms)
    bound = LearnerBound(parallel=parallel, timeout_s=timeout_ms / 1000)
    cfg = scaler_config(name, i_min=i_min, i_max=i_min + i_span, window=3, fixed_actors=i_min + i_span // 2)
    scaler = make_scaler(cfg, seed)
    min_actors = cfg.i_min if stop_below_i_min else 1
    # Round 0 has no update: its part before the decision is the scaler's call. A budget too small
    # to pay even for that cannot be held by any cap (the run stops at its first decision).
    before_decision = data.draw(st.floats(0, 0.5), label="round 0 before its decision (s)")
    assume(ledger.learner_cost(before_decision) + ledger.provisioned_cost(before_decision) <= budget)
    functions = None
    if jobs_per_actor:
        functions = FunctionAllowance(timeout_ms, jobs_per_actor, lambda n: max(1, n // 2))
        functions.per_job_ms.extend(data.draw(st.lists(st.floats(0, timeout_ms), max_size=3), label="per job (ms)"))
    invocations = lambda n: n * (1 + jobs_per_actor) + eval_invocations if n else 0  # noqa: E731
    for k in range(rounds):
        R = data.draw(st.one_of(st.none(), st.just(NAN), st.floats(-5, 5)), label="R")
        gns = data.draw(st.one_of(st.none(), st.floats(0, 1e6)), label="gns")
        wanted = scaler.decide(k, RoundSignal(R=R, grad_noise_scale=gns))
        if name != "fixed":
            assert cfg.i_min <= wanted <= cfg.i_max

        def cost(n: int, spent_s: float = before_decision) -> Decimal:  # the default binds this round's time
            return decision_cost(ledger, bound, spent_s, invocations(n), n * steps, n, functions)

        remaining = ledger.remaining(budget)
        n = largest_affordable(wanted, remaining, cost, min_actors=min_actors)
        assert 0 <= n <= wanted
        if n == 0:  # clean stop: it really could not pay for the minimum; the round is charged what it took
            assert remaining < cost(min(min_actors, wanted)) or wanted == 0
            ledger.charge_round(k, before_decision, [], provisioned_seconds=before_decision)
            assert ledger.spent <= budget, (ledger.spent, budget)
            break
        acting = data.draw(st.floats(0, bound.acting_s(invocations(n))), label="actors' part (s)")
        actors_invocations = invocations(n) - n * jobs_per_actor
        billed = data.draw(st.lists(st.integers(0, 2 * timeout_ms), min_size=actors_invocations,
                                    max_size=actors_invocations), label="billed ms")
        if functions is not None:  # the lanes: up to n // 2 invocations in flight, each taken first
            functions.allow(functions.limit_ms(n))
            in_flight, jobs = 0, n * jobs_per_actor
            while jobs or in_flight:
                if in_flight and (not jobs or in_flight >= max(1, n // 2) or data.draw(st.booleans(), label="ends")):
                    ms = data.draw(st.one_of(st.just(2 * timeout_ms), st.integers(0, 2 * timeout_ms)),
                                   label="function billed ms")
                    functions.settle(ms)
                    billed.append(ms)
                    in_flight -= 1
                else:
                    jobs -= 1
                    in_flight += functions.take()
            functions.answered(n * jobs_per_actor)
            functions.close()
        round_s = before_decision + acting
        rc = ledger.charge_round(k, round_s, billed, provisioned_seconds=round_s)
        assert rc.total == rc.learner + rc.lambda_compute + rc.requests + rc.provisioned
        assert ledger.spent <= budget, (ledger.spent, budget)
        # The next round's update and detection: enforced by the deadline set at this decision,
        # so anywhere up to the allowance plus what the actors left unused of theirs.
        allowed = bound.acting_s(invocations(n)) - acting + bound.allowance_s(n * steps)
        before_decision = data.draw(st.one_of(st.floats(0, allowed), st.just(allowed)), label="next update (s)")
        bound.observe(before_decision, n * steps)


def test_a_decision_reserves_the_learner_functions_allowance_by_hand():
    """Stellaris at 8 actors, 10 jobs each, 4 lanes, 50 ms billed a job so far: the cap prices the
    80 jobs at the allowance (4 x 5 s + 2 x 50 ms x 80 = 28 s, 2 GB) instead of each at its 5 s
    timeout, and lanes that bill every invocation at its timeout stay within what it reserved."""
    prices = PriceTable(learner_per_hour=0.0, lambda_gb_s_x86=0.00001, lambda_per_million_requests=1.0)
    ledger = CostLedger(prices, memory_mb=2048, local_actors=True, max_billed_ms=5000)
    bound = LearnerBound(parallel=1000, timeout_s=5.0)
    functions = FunctionAllowance(5000, 10, lambda n: math.ceil(n / 2))
    functions.per_job_ms.append(50.0)
    actor = Decimal("5") * 2 * Decimal("0.00001") + Decimal("0.000001")  # 10 GB-s and a request
    assert functions.limit_ms(8) == 28_000
    reserved = decision_cost(ledger, bound, 0.0, 8 * 11, 8 * 256, 8, functions)
    assert reserved == 8 * actor + Decimal("28") * 2 * Decimal("0.00001") + 80 * Decimal("0.000001")
    assert decision_cost(ledger, bound, 0.0, 8 * 11, 8 * 256, 8) == 88 * actor  # each at its timeout
    functions.allow(functions.limit_ms(8))
    billed, in_flight = [], 0
    for _ in range(80):  # each lane's invocation runs to its timeout; a refused job is lost
        while in_flight >= 4:
            functions.settle(5000)
            billed.append(5000)
            in_flight -= 1
        in_flight += functions.take()
    billed += [5000] * in_flight
    assert len(billed) == 5  # 4 at once, then one more while the settled ones leave room
    invoice = ledger.charge_round(0, 0.0, [5000] * 8 + billed)
    assert invoice.total <= reserved
