"""The cost ledger against hand-worked invoices, to the cent (and exactly)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from nitro.config import ClockConfig, NitroConfig, PriceTable
from nitro.pricing.cost import CostLedger, ledger_from_config, to_cents
from nitro.scaling.budget import largest_affordable

PRICES = PriceTable()  # the paper's defaults: c5.4xlarge $0.68/h, x86 $0.0000166667/GB-s, ...


def cents(x: Decimal) -> str:
    return str(to_cents(x))


def test_hand_worked_invoice_three_rounds_with_provisioned_concurrency():
    """2,048 MB x86 actors (2 GB), 8 provisioned, learner on a c5.4xlarge at $0.68/h.

    Round 0: learner 1,800 s; 16 actors x 60,000 ms; provisioned concurrency on for 1,800 s.
      learner      0.68 x 1800/3600                                   = 0.34
      provisioned-duration GB-s: first 8 actors: 8 x 60 s x 2 GB = 960  x 0.0000097222 = 0.0093333120
      on-demand GB-s:            other 8 actors:                   960  x 0.0000166667 = 0.0160000320
      lambda_compute                                              = 0.0253333440
      requests     16 x 0.20 / 1e6                                = 0.0000032
      provisioned  8 x 2 GB x 1800 s (a multiple of 300) x 0.0000041667 = 28,800 x 0.0000041667 = 0.1200009600
      round total  0.4853375040  -> $0.49
    Round 1: learner 2,000 s; 64 actors x 45,250 ms; provisioned on for 2,000 s more.
      learner      0.68 x 2000/3600                               = 0.37777...
      provisioned-duration: 8 x 45.25 x 2 = 724 GB-s x 0.0000097222 = 0.0070388728
      on-demand:          56 x 45.25 x 2 = 5,068 GB-s x 0.0000166667 = 0.0844668356
      lambda_compute                                              = 0.0915057084
      requests     64 x 0.20 / 1e6                                = 0.0000128
      provisioned  enabled 3,800 s in all, billed rounded up to 5 min: 3,900 s; 1,800 s were billed,
                   so 2,100 s now: 8 x 2 x 2100 x 0.0000041667 = 33,600 x 0.0000041667 = 0.1400011200
      round total  0.60929740617...  -> $0.61
    Round 2: learner 600 s only (no actors: the run stops); provisioned on 100 s more -> 3,900 s,
      already billed, so 0.
      learner      0.68 x 600/3600 = 0.11333...  -> $0.11
    Whole run: learner 0.8311... ($0.83), compute 0.1168390524 ($0.12), requests 0.000016 ($0.00),
      provisioned 0.2600020800 ($0.26); total 1.2079682435... -> $1.21
    """
    ledger = CostLedger(PRICES, memory_mb=2048, architecture="x86_64", provisioned_concurrency=8, local_actors=False)

    r0 = ledger.charge_round(0, learner_seconds=1800, actor_billed_ms=[60_000] * 16, provisioned_seconds=1800)
    assert r0.learner == Decimal("0.34")
    assert r0.lambda_compute == Decimal("0.0253333440")
    assert r0.requests == Decimal("0.0000032")
    assert r0.provisioned == Decimal("0.1200009600")
    assert r0.gb_s == Decimal(1920) and r0.n_requests == 16 and r0.billed_ms == 960_000
    assert cents(r0.total) == "0.49" and cents(r0.cumulative) == "0.49"

    r1 = ledger.charge_round(1, learner_seconds=2000, actor_billed_ms=[45_250] * 64, n_requests=64,
                             provisioned_seconds=2000)
    assert cents(r1.learner) == "0.38"
    assert r1.lambda_compute == Decimal("0.0915057084")
    assert r1.requests == Decimal("0.0000128")
    assert r1.provisioned == Decimal("0.1400011200")
    assert cents(r1.total) == "0.61" and cents(r1.cumulative) == "1.09"

    r2 = ledger.charge_round(2, learner_seconds=600, actor_billed_ms=[], provisioned_seconds=100)
    assert cents(r2.learner) == "0.11" and r2.lambda_compute == 0 and r2.requests == 0 and r2.provisioned == 0
    assert cents(r2.cumulative) == "1.21"

    totals = ledger.totals()
    assert cents(totals["learner"]) == "0.83"
    assert totals["lambda_compute"] == Decimal("0.1168390524")
    assert cents(totals["requests"]) == "0.00"
    assert totals["provisioned"] == Decimal("0.2600020800")
    assert cents(totals["total"]) == "1.21"
    assert sum(totals[c] for c in ("learner", "lambda_compute", "requests", "provisioned")) == totals["total"]

    # MLflow metrics: one float per component
    m = r1.metrics()
    assert m["cost_provisioned_usd"] == pytest.approx(0.14000112)
    assert m["cost_cumulative_usd"] == pytest.approx(1.0946349101777778)


def test_hand_worked_invoice_at_scale_arm_and_x86():
    """AWS's own pricing example, without the free tier: 512 MB, 3,000,000 s of duration.
    Here as 30,000 invocations of 100,000 ms over 3 rounds (10,000 each) and 1 h of learner per round.
      GB-s: 3,000,000 s x 0.5 GB = 1,500,000; x86: x 0.0000166667 = 25.00005 -> $25.00
      requests: 30,000 x 0.20/1e6 = 0.006 -> $0.01
      learner: 3 h x 0.68 = 2.04
      total 27.04605 -> $27.05
    The same on arm64: 1,500,000 x 0.0000133334 = 20.0001 -> $20.00; total 22.0461 -> $22.05.
    """
    x86 = CostLedger(PRICES, memory_mb=512, architecture="x86_64")
    arm = CostLedger(PRICES, memory_mb=512, architecture="arm64")
    for k in range(3):
        x86.charge_round(k, 3600, [100_000] * 10_000)
        arm.charge_round(k, 3600, [100_000] * 10_000)
    assert x86.totals()["lambda_compute"] == Decimal("25.00005")
    assert cents(x86.totals()["requests"]) == "0.01"
    assert cents(x86.totals()["learner"]) == "2.04"
    assert cents(x86.spent) == "27.05"
    assert arm.totals()["lambda_compute"] == Decimal("20.0001")
    assert cents(arm.spent) == "22.05"


def test_billing_rules():
    ledger = CostLedger(PRICES, memory_mb=1024, max_billed_ms=300_000, local_actors=True)
    # a measured float duration is billed per started ms
    r = ledger.charge_round(0, 0, [1000.2])
    assert r.billed_ms == 1001
    # never billed past the timeout
    r = ledger.charge_round(1, 0, [400_000])
    assert r.billed_ms == 300_000
    assert ledger.max_actor_cost() == Decimal("300") * Decimal("0.0000166667") + Decimal("0.0000002")
    # estimate: 512 steps at 0.25 ms = 128 ms at 1 GB, plus a request
    assert ledger.estimate_actor_cost(512, 0.25) == Decimal("0.128") * Decimal("0.0000166667") + Decimal("0.0000002")
    with pytest.raises(ValueError):
        ledger.charge_round(2, -1, [])
    with pytest.raises(ValueError):
        CostLedger(PRICES, architecture="sparc")
    with pytest.raises(ValueError):
        CostLedger(PRICES).max_actor_cost()


def test_tags_say_local_actors_priced_as_lambda():
    local = CostLedger(PRICES, memory_mb=1024, local_actors=True)
    tags = local.tags()
    assert tags["cost.actors_backend"] == "local"
    assert "priced as if they were Lambda" in tags["cost.note"]
    assert tags["cost.actor_pricing"] == "aws-lambda x86_64 1024MB"
    assert "cost.note" not in CostLedger(PRICES, local_actors=False).tags()


def test_state_dict_round_trip_is_exact_and_json():
    ledger = CostLedger(PRICES, memory_mb=2048, provisioned_concurrency=4)
    ledger.charge_round(0, 123.456, [1234, 5678, 91011], provisioned_seconds=123.456)
    ledger.charge_round(1, 99.5, [10, 20], provisioned_seconds=250)
    state = json.loads(json.dumps(ledger.state_dict()))
    again = CostLedger(PRICES, memory_mb=2048, provisioned_concurrency=4)
    again.load_state_dict(state)
    assert again.rounds == ledger.rounds and again.spent == ledger.spent
    # the provisioned running total survives: the next round is charged identically
    a = ledger.charge_round(2, 1, [5], provisioned_seconds=100)
    b = again.charge_round(2, 1, [5], provisioned_seconds=100)
    assert a == b
    with pytest.raises(ValueError):
        CostLedger(PRICES, memory_mb=1024, provisioned_concurrency=4).load_state_dict(state)


def test_ledger_from_config():
    cfg = NitroConfig.load({"backend": {"kind": "lambda", "memory_mb": 2048,
                                        "lambda": {"architecture": "arm64", "provisioned_concurrency": 2,
                                                   "function_timeout_s": 120}}})
    ledger = ledger_from_config(cfg)
    assert (ledger.memory_mb, ledger.architecture, ledger.provisioned_concurrency, ledger.local_actors) == (
        2048, "arm64", 2, False)
    assert ledger.max_billed_ms == 120_000
    local = ledger_from_config(NitroConfig.load({}))
    assert local.local_actors and local.provisioned_concurrency == 0
    assert local.max_billed_ms == int(NitroConfig.load({}).backend.timeout_s * 1000)


def test_budget_cap_against_the_ledger():
    ledger = CostLedger(PRICES, memory_mb=1024, max_billed_ms=1000)
    per_actor = ledger.max_actor_cost()  # 1 s at 1 GB + a request = 0.0000168667
    fixed = ledger.round_fixed_cost(learner_seconds=36)  # 0.0068
    assert fixed == Decimal("0.0068")
    # 0.0069 - 0.0068 = 0.0001 pays for 5 actors (5 x 0.0000168667 = 0.0000843335), not 6

    def cost(n: int) -> Decimal:
        return fixed + n * per_actor

    assert largest_affordable(64, Decimal("0.0069"), cost) == 5
    assert largest_affordable(64, Decimal("0.0069"), cost, min_actors=8) == 0  # stop


def test_max_actor_cost_bounds_provisioned_invocations_too():
    # Found by the budget property test: with a provisioned duration rate above the on-demand one
    # (odd prices, but configurable), the bound must use the dearer rate.
    from decimal import Decimal

    from nitro.config import PriceTable
    from nitro.pricing.cost import CostLedger

    prices = PriceTable(lambda_gb_s_x86=0.0, provisioned_duration_gb_s=1e-10, lambda_per_million_requests=0.0)
    ledger = CostLedger(prices, memory_mb=1024, provisioned_concurrency=1, max_billed_ms=1000)
    worst = ledger.max_actor_cost()
    assert worst == ledger.invocation_cost(1000, provisioned=True) == Decimal("1E-10")
    ledger.charge_round(0, 0, [1000])
    assert ledger.spent <= worst


def test_lambda_projected_clock_by_hand():
    from nitro.pricing.clock import RoundClock, lambda_round_s

    # learner-side 12 - 9 = 3 s; 3 requests x 0.01 s on the wire; 0.1 s invoke; slowest actor 4 s; cold start 2 s
    assert lambda_round_s(12.0, 9.0, [1.0, 4.0, 2.0], True, 0.01, 0.1, 2.0) == pytest.approx(9.13)
    assert lambda_round_s(12.0, 9.0, [1.0, 4.0, 2.0], False, 0.01, 0.1, 2.0) == pytest.approx(7.13)
    assert lambda_round_s(12.0, 0.0, [], True, 0.01, 0.1, 2.0) == 12.0  # no actors: nothing to wait for
    allowances = {"dispatch_s_per_invocation": 0.01, "invoke_s": 0.1, "cold_start_s": 2.0}
    clock = RoundClock(ClockConfig(kind="lambda", **allowances), warm_instances=2)  # 2 provisioned: never cold
    billed = [clock.round(12.0, 9.0, [4.0] * n)[0] for n in (2, 3, 3, 1, 5)]
    assert billed == pytest.approx([7.12, 9.13, 7.13, 7.11, 9.15])  # cold only past the warm peak (2, 3, 5)
    measured = RoundClock(ClockConfig(kind="measured", **allowances))
    assert measured.round(12.0, 9.0, [4.0]) == pytest.approx((12.0, 9.11))
    assert measured.startup_s(10) == 0.0 and clock.startup_s(10) == pytest.approx(2.2)


def test_hand_worked_invoice_of_a_stellaris_round():
    """A Stellaris round on the Lambda-projected clock: 8 actors of 500 ms, 80 learner functions of
    40 ms, 1,024 MB x86, the parameter server on a c5.large at $0.085/h.

      projected round: learner-side 10 - 8 = 2 s, plus the later of the actors' answer
        (8 x 0.01 s on the wire + 0.1 s invoke + 0.5 s slowest + 2 s cold = 2.68 s) and the
        learning (the schedule replayed: 3.5 s)                                 = 5.5 s
      parameter server   0.085 x 5.5 / 3600                                     = 0.000129861...
      GB-s: actors 8 x 0.5 s x 1 GB = 4; functions 80 x 0.04 s x 1 GB = 3.2    = 7.2
      compute            7.2 x 0.0000166667                                     = 0.00012000024
      requests           (8 + 80) x 0.20 / 1e6                                  = 0.0000176
      round total        0.000267461...
    The same round billed by the measured clock: 10 s of the server = 0.000236111...; compute and
    requests unchanged: total 0.000373711...
    """
    from nitro.pricing.clock import RoundClock

    for kind, seconds, total in (("lambda", 5.5, "0.0002674613511"), ("measured", 10.0, "0.0003737113511")):
        cfg = NitroConfig.load({"learner": {"mode": "stellaris"}, "clock": {
            "kind": kind, "dispatch_s_per_invocation": 0.01, "invoke_s": 0.1, "cold_start_s": 2.0}})
        ledger, clock = ledger_from_config(cfg), RoundClock(cfg.clock)
        billed, projected = clock.round(10.0, 8.0, [0.5] * 8, learning_s=3.5)
        assert projected == pytest.approx(5.5) and billed == pytest.approx(seconds)
        rc = ledger.charge_round(0, learner_seconds=billed, actor_billed_ms=[500] * 8 + [40] * 80, n_requests=88)
        assert rc.learner == Decimal("0.085") * Decimal(str(seconds)) / 3600
        assert rc.gb_s == Decimal("7.2") and rc.lambda_compute == Decimal("0.00012000024")
        assert rc.requests == Decimal("0.0000176")
        assert rc.total.quantize(Decimal("1e-13")) == Decimal(total)
    # the learning that ends before the actors' answer adds nothing
    assert RoundClock(cfg.clock).round(10.0, 8.0, [0.5] * 8, learning_s=1.0)[1] == pytest.approx(2 + 2.68)
