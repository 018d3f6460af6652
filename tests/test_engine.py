"""The round steps of nitro.engine.Trainer, driven by a plain loop (no Prefect) over real parts:
a real Redis, warm local actor processes, Hopper-v5."""

from __future__ import annotations

import math

import pytest

from nitro.actors.local import LocalActorPool
from nitro.cache import TrajectoryCache, connect_redis
from nitro.checkpoint import load_checkpoint, save_checkpoint
from nitro.config import NitroConfig
from nitro.engine import STOP_BUDGET, Trainer


def drive(trainer: Trainer, pool: LocalActorPool, rounds: int) -> list[dict]:
    reports = []
    for k in range(trainer.next_round, rounds):
        trainer.update_policy(k)
        trainer.detect(k)
        n = trainer.decide(k).n_actors
        events = trainer.actor_events(k, n, trainer.publish_weights(k))
        summaries = pool.invoke_many(events)
        report = trainer.end_round(k, summaries, actor_s=0.0)
        reports.append(report)
        if report.stop_reason:
            break
    return reports


@pytest.fixture(scope="module")
def pool():
    with LocalActorPool(workers=2, timeout_s=60, memory_mb=1024) as p:
        yield p


def _trainer(redis_url, run_id, **overrides) -> Trainer:
    base = {"steps_per_actor": 128, "detector": {"subset_size": 128}, "scaler": {"i_min": 2, "i_max": 6, "window": 3}}
    cfg = NitroConfig.load({**base, **overrides})
    cache = TrajectoryCache(connect_redis(redis_url), run_id, ttl_s=600)
    return Trainer(cfg, run_id, cache, actor_cache_url=redis_url)


def test_nitro_scaler_rounds_vary_within_bounds(redis_url, pool):
    trainer = _trainer(redis_url, "eng-nitro", rounds=6)
    reports = drive(trainer, pool, 6)
    actors = [int(r.metrics["actors_launched"]) for r in reports]
    assert all(2 <= a <= 6 for a in actors), actors
    assert len(set(actors)) > 1, f"actor counts never varied: {actors}"
    scored = [r.metrics for r in reports[1:]]
    assert all(not math.isnan(m["hessian_R"]) for m in scored)
    assert all(m["lambda_min"] < 0 < m["lambda_max"] for m in scored)
    assert reports[-1].metrics["env_steps_total"] == sum(a * 128 for a in actors)
    assert reports[-1].stop_reason == "round_limit"


def test_budget_is_never_exceeded_and_the_run_stops_cleanly(redis_url, pool):
    # Worst-case pricing: each actor may bill its 5 s timeout, the learner twice the last round.
    budget = 0.004
    trainer = _trainer(redis_url, "eng-budget", rounds=200, budget_usd=budget, backend={"timeout_s": 5},
                       scaler={"name": "always", "i_min": 2, "i_max": 6})
    reports = drive(trainer, pool, 200)
    spent = [r.metrics["spend_total_usd"] for r in reports]
    assert reports[-1].stop_reason == STOP_BUDGET
    assert len(reports) < 200
    assert max(spent) <= budget
    assert spent == sorted(spent)
    assert float(trainer.ledger.spent) == pytest.approx(sum(r.metrics["spend_round_usd"] for r in reports))


def test_checkpoint_resume_reproduces_the_next_round(redis_url, pool, tmp_path):
    kw = dict(rounds=3, round_deadline_s=30.0, scaler={"name": "fixed", "fixed_actors": 2})
    a = _trainer(redis_url, "eng-ckpt", **kw)
    drive(a, pool, 2)
    save_checkpoint(tmp_path, "eng-ckpt", 1, a.state_dict())
    b = _trainer(redis_url, "eng-ckpt", **kw)
    _, state = load_checkpoint(tmp_path, "eng-ckpt")
    b.load_state_dict(state)
    assert b.next_round == 2 and b.pending == a.pending
    # Round 2's update on the same batches from the restored state is the same update.
    ua, ub = a.update_policy(2), b.update_policy(2)
    assert ua.samples == ub.samples == 256
    assert ua.metrics["policy_loss"] == pytest.approx(ub.metrics["policy_loss"], rel=1e-6)
    assert ua.metrics["kl"] == pytest.approx(ub.metrics["kl"], rel=1e-6)
    assert a.decide(2).n_actors == b.decide(2).n_actors == 2
    assert [e.seed for e in a.actor_events(2, 2, "k")] == [e.seed for e in b.actor_events(2, 2, "k")]


def test_missing_actor_batches_are_recorded_not_waited_for_forever(redis_url, pool):
    trainer = _trainer(redis_url, "eng-missing", rounds=2, round_deadline_s=1.0, scaler={"name": "fixed", "fixed_actors": 2})
    drive(trainer, pool, 1)
    trainer.pending.append("eng-missing-r00000-0099")  # an actor whose batch never comes
    report = trainer.update_policy(1)
    assert report.missing == ["eng-missing-r00000-0099"]
    assert report.batches == 2 and report.samples == 256
