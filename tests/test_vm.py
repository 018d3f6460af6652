"""Actors billed as EC2 instances (nitro/pricing/vm.py): the invoice of short runs worked by hand."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest

from nitro.actors.events import ActorSummary
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import ConfigError, NitroConfig, PriceTable
from nitro.config.vm import VmConfig
from nitro.pricing.cost import CostLedger
from nitro.pricing.vm import VmFleet, billed_instance_s
from nitro.run.engine import TrainingRun, UpdateReport

C5_4XL_PER_S = Decimal("0.68") / 3600  # c5.4xlarge, the paper's $0.68/h


def same_amount(a: Decimal, b: Decimal) -> bool:
    """Equal to 20 decimal places (a division's last digit may differ with the order of operations)."""
    return abs(a - b) < Decimal("1e-20")


def test_aws_bills_whole_seconds_with_a_one_minute_minimum():
    assert billed_instance_s(Decimal("0"), 60) == 0
    assert billed_instance_s(Decimal("0.2"), 60) == 60
    assert billed_instance_s(Decimal("59.99"), 60) == 60
    assert billed_instance_s(Decimal("60.01"), 60) == 61
    assert billed_instance_s(Decimal("107.35"), 60) == 108


def test_a_fleet_invoice_worked_by_hand():
    """c5.4xlarge (16 vCPUs, $0.68/h), 40 s start-up. Instance A starts in round 0 and runs to
    the end; instance B starts at round 2's decision (20 actors need two) and stops at round 3's.
      round 0: A up 45.5 - 0.4 = 45.1 s -> billed 60 (the minimum)      charge 60 s
      round 1: A up 45.1 + 12.25 = 57.35 -> still 60                     charge 0
      round 2: A up 107.35 -> 108 (+48); B up 50 - 2.5 = 47.5 -> 60      charge 48 + 60 s
      round 3: A up 117.35 -> 118 (+10); B stops 1.2 s in: 48.7 -> 60    charge 10 s
    Invoice: A 118 s + B 60 s = 178 s at $0.68/h."""
    fleet = VmFleet(VmConfig(instance_type="c5.4xlarge", startup_s=40))
    rounds = [  # (actors, seconds before the decision, the round's billed seconds, billed instance-seconds)
        (16, 0.4, 45.5, 60), (16, 3.0, 12.25, 0), (20, 2.5, 50.0, 48 + 60), (16, 1.2, 10.0, 10),
    ]
    waits = []
    for k, (actors, decided, seconds, billed_s) in enumerate(rounds):
        waits.append(fleet.scale(k, actors, actors, decided).wait_s)
        assert same_amount(fleet.charge(seconds), C5_4XL_PER_S * billed_s), f"round {k}"
    assert waits == [40.0, 0.0, 40.0, 0.0]  # only rounds that start an instance wait for it
    assert [s.running for s in fleet.sessions] == [True, False]
    total = sum(fleet.instance_cost(s.up_s) for s in fleet.sessions)
    assert same_amount(total, C5_4XL_PER_S * 178)


def test_the_ledger_bills_vm_actors_instead_of_lambda_and_survives_a_checkpoint():
    ledger = CostLedger(prices=PriceTable(), vm=VmFleet(VmConfig(instance_type="c5.large", startup_s=30)))
    ledger.vm.scale(0, 3, 3, 0.5)  # two 2-vCPU instances
    cost = ledger.charge_round(0, learner_seconds=40.5, actor_billed_ms=[1000, 2000, 3000])
    assert cost.lambda_compute == 0 and cost.requests == 0  # no Lambda invoice for VM actors
    assert same_amount(cost.vm, 2 * Decimal("0.085") * 60 / 3600)  # 40 s up each: the one-minute minimum
    assert cost.total == cost.learner + cost.vm and cost.metrics()["cost_vm_usd"] == float(cost.vm)
    restored = CostLedger(prices=PriceTable(), vm=VmFleet(VmConfig(instance_type="c5.large", startup_s=30)))
    restored.load_state_dict(ledger.state_dict())
    assert restored.spent == ledger.spent and restored.vm.running == 2
    assert restored.vm.sessions[0].up_s == Decimal("40.0")
    assert "aws-ec2 c5.large" in ledger.tags()["cost.actor_pricing"]


@pytest.mark.parametrize(("override", "field"), [
    ("backend.vm.instance_type=c9.huge", "backend.vm.instance_type"),
    ("backend.vm.per_hour=-0.5", "backend.vm.per_hour"),
    ("backend.vm.startup_s=-1", "backend.vm.startup_s"),
    ("backend.pricing=ec2", "backend.pricing"),
])
def test_bad_vm_settings_name_their_field(override, field):
    with pytest.raises(ConfigError) as err:
        NitroConfig.load({}, [override])
    message = str(err.value)
    assert "\n" not in message and f"invalid config: {field}:" in message


def test_a_known_type_fills_vcpus_and_price_and_an_override_wins():
    cfg = NitroConfig.load({}, ["backend.pricing=vm", "backend.vm.instance_type=c5.18xlarge"])
    assert (cfg.backend.vm.vcpus, cfg.backend.vm.per_hour) == (72, 3.06)
    cfg = NitroConfig.load({}, ["backend.vm.per_hour=0.7"])
    assert (cfg.backend.vm.vcpus, cfg.backend.vm.per_hour, cfg.backend.vm.price_source) == (16, 0.7, "configured")


def _training(redis_url, run_id, **overrides) -> TrainingRun:
    base = {"steps_per_actor": 64, "eval": {"every_rounds": 0}, "scaler": {"name": "fixed", "fixed_actors": 3},
            "backend": {"pricing": "vm", "vm": {"instance_type": "c5.large", "startup_s": 40}},
            "clock": {"kind": "lambda"}}
    cfg = NitroConfig.load({**base, **overrides})
    cache = TrajectoryCache(connect_redis(redis_url), run_id, ttl_s=600)
    return TrainingRun(cfg, run_id, cache, actor_cache_url=redis_url)


def test_serverful_fixed_actors_a_short_run_invoiced_by_hand(redis_url):
    """Serverful PPO as a config: 3 fixed actors on c5.large (2 vCPUs, $0.085/h), so two
    instances, started at round 0's decision; the learner (c5.4xlarge, $0.68/h) waits their 40 s.
    Each round's actors take 1.5, 2.5 and 2.0 s, the learner-side 2 s (10 s less 8 s of acting):
      round 0: 2 + 40 (wait) + 2.5 = 44.5 s; each instance up 44.5 s -> billed 60 s
      rounds 1-3: 2 + 2.5 = 4.5 s each; up 49, 53.5, 58 s -> still 60 s: no instance charge
      round 4: 4.5 s; up 62.5 s -> 63 s: 3 s more per instance (their idle learner time included)."""
    training = _training(redis_url, "vm-serverful")
    expected_vm_s = [60, 0, 0, 0, 3]
    for k in range(5):
        decision = training.decide_actors(k, None, UpdateReport(), started=time.perf_counter())
        assert decision.n_actors == 3 and decision.instances_started == (2 if k == 0 else 0)
        events = training.plan_invocations(k, decision, training.publish_weights(k))
        summaries = [ActorSummary(invocation_id=e.invocation_id, ok=True, duration_s=d, billed_ms=int(d * 1000))
                     for e, d in zip(events, (1.5, 2.5, 2.0))]
        m = training.end_round(k, UpdateReport(), None, decision, summaries, actor_s=8.0, elapsed_s=10.0).metrics
        round_s = 44.5 if k == 0 else 4.5
        assert m["round_billed_s"] == pytest.approx(round_s)
        assert m["vm/wait_s"] == (40.0 if k == 0 else 0.0) and m["vm/instances"] == 2
        assert m["spend_learner_usd"] == pytest.approx(0.68 * round_s / 3600, rel=1e-12)
        assert m["spend_vm_usd"] == pytest.approx(2 * 0.085 * expected_vm_s[k] / 3600, rel=1e-12)
        assert m["spend_lambda_compute_usd"] == 0 and m["spend_requests_usd"] == 0
    assert same_amount(training.ledger.totals()["vm"], 2 * Decimal("0.085") * 63 / 3600)


def test_a_vm_budget_run_reserves_the_start_up_and_the_instances_minimum(redis_url):
    """The budget cap prices VM actors by their instances (nitro/scaling/budget.py's bound). Until the
    next decision it reserves 40 s start-up + one 120 s timeout wave + 2 s tail + the next
    update's 5 + 2 x 0.005 s x 64n samples: for n = 4 actors (two c5.large) 169.56 s of the
    $0.68/h learner ($0.03203) and two instances up 170 s ($0.00803): $0.04006; for n = 5 (three
    instances) 170.2 s ($0.03215) and 3 x 171 s ($0.01211): $0.04426. A $0.042 budget buys 4."""
    training = _training(redis_url, "vm-budget", scaler={"name": "fixed", "fixed_actors": 6}, budget_usd=0.042)
    decision = training.decide_actors(0, None, UpdateReport(), started=time.perf_counter())
    assert (decision.n_actors, decision.instances_started) == (4, 2)


def test_nitro_without_serverless_keeps_one_vm_for_i_max_on_throughout():
    """examples/nitro_without_serverless.yaml: one c5.18xlarge (72 vCPUs) holds any round of
    8-64 actors, starts once and is billed every second of every round, idle or not."""
    cfg = NitroConfig.from_yaml("examples/nitro_without_serverless.yaml")
    fleet = VmFleet(cfg.backend.vm)
    starts = []
    for k, actors in enumerate((8, 64, 8, 0, 33)):
        starts.append(fleet.scale(k, actors, actors, decided_after_s=1.0).started)
        fleet.charge(30.25)
    assert starts == [1, 0, 0, 0, 0] and fleet.running == 1
    assert same_amount(fleet.instance_cost(fleet.sessions[0].up_s), Decimal("3.06") * 151 / 3600)  # 5 x 30.25 - 1 s
