"""Boosting on VMs (paper §2.3, Fig. 3): vm-pause bills the learner's wait for new instances,
vm-replay trains on replayed batches during it, and only then."""

from __future__ import annotations

import time

import pytest

from nitro.actors.events import ActorSummary
from nitro.actors.local import LocalActorPool
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import ConfigError, NitroConfig
from nitro.run.engine import TrainingRun, UpdateReport
from nitro.run.vm_replay import replay_while_instances_start


def _training(redis_url, run_id, scaler: str, **overrides) -> TrainingRun:
    base = {"steps_per_actor": 64, "eval": {"every_rounds": 0}, "detector": {"subset_size": 64},
            "scaler": {"name": scaler, "i_min": 2, "i_max": 6, "window": 3, "actors_at": {1: 6}},
            "backend": {"pricing": "vm", "vm": {"instance_type": "c5.large", "startup_s": 40,
                                                "replay_max_updates": 2}},
            "clock": {"kind": "lambda"}}
    cfg = NitroConfig.load({**base, **overrides})
    cache = TrajectoryCache(connect_redis(redis_url), run_id, ttl_s=600)
    return TrainingRun(cfg, run_id, cache, actor_cache_url=redis_url)


def test_vm_scalers_need_vm_pricing():
    with pytest.raises(ConfigError, match=r"^invalid config: .*backend\.pricing: scaler vm-pause boosts on VMs"):
        NitroConfig.load({}, ["scaler.name=vm-pause"])


def test_vm_pause_bills_the_learner_waiting_for_its_boost(redis_url):
    """I_min 2 actors on one c5.large (2 vCPUs, $0.085/h); round 1 boosts to 6 (three instances),
    so it starts two and waits their 40 s start-up, idle; round 2 is back at 2 and stops them.
    Learner-side 2 s (10 s less 8 s of acting), the slowest actor 2.5 s:
      round 0: 2 + 40 + 2.5 = 44.5 s (the first instance starts too)
      round 1: 2 + 40 + 2.5 = 44.5 s, all billed to the $0.68/h learner
      round 2: 2 + 2.5 = 4.5 s."""
    training = _training(redis_url, "vm-pause", "vm-pause")
    for k, (actors, started, round_s) in enumerate([(2, 1, 44.5), (6, 2, 44.5), (2, 0, 4.5)]):
        decision = training.decide_actors(k, None, UpdateReport(), started=time.perf_counter())
        assert (decision.n_actors, decision.instances_started) == (actors, started)
        assert replay_while_instances_start(training, k).updates == 0  # pause: the learner only waits
        events = training.plan_invocations(k, decision, training.publish_weights(k))
        summaries = [ActorSummary(invocation_id=e.invocation_id, ok=True, duration_s=2.5 if i == 0 else 1.0,
                                  billed_ms=1000) for i, e in enumerate(events)]
        m = training.end_round(k, UpdateReport(), None, decision, summaries, actor_s=8.0, elapsed_s=10.0).metrics
        assert m["round_billed_s"] == pytest.approx(round_s)
        assert m["vm/wait_s"] == (40.0 if started else 0.0)
        assert m["spend_learner_usd"] == pytest.approx(0.68 * round_s / 3600, rel=1e-12)
    assert training.ledger.vm.running == 1 and len(training.ledger.vm.sessions) == 3


def drive(training: TrainingRun, pool: LocalActorPool, rounds: int) -> list[dict]:
    """Rounds as flows/round.py runs them, replay step included; each row: the round's metrics
    and the learner's updates counted around the replay step."""
    rows = []
    for k in range(rounds):
        started = time.perf_counter()
        update = training.mode.update(k)
        detection = training.detect_boosting(k, update)
        decision = training.decide_actors(k, detection, update, started)
        before = training.learner.n_updates
        replay = replay_while_instances_start(training, k)
        replayed = training.learner.n_updates - before
        events = training.plan_invocations(k, decision, training.publish_weights(k))
        acting = time.perf_counter()
        summaries = pool.invoke_many(events)
        report = training.end_round(k, update, detection, decision, summaries, actor_s=time.perf_counter() - acting,
                                    elapsed_s=time.perf_counter() - started)
        rows.append({**report.metrics, "replayed": replayed, "replay_updates": replay.updates,
                     "started": decision.instances_started})
    return rows


@pytest.fixture(scope="module")
def pool():
    with LocalActorPool(workers=2, timeout_s=60, memory_mb=1024) as p:
        yield p


@pytest.mark.slow
def test_vm_replay_trains_on_replayed_batches_only_while_instances_start(redis_url, pool):
    """Round 1 boosts to 6 (actors_at), so it starts instances; Nitro's own decisions start more
    in some later rounds. The learner takes its replay updates (at most 2, each a full update on
    round k-1's batches) in exactly the rounds that start instances and have something to replay,
    and the round waits only for what the replay left of the 40 s start-up."""
    training = _training(redis_url, "vm-replay", "vm-replay")
    rows = drive(training, pool, 5)
    assert rows[1]["started"] == 2
    for k, row in enumerate(rows):
        replays = 2 if row["started"] and k >= 1 else 0  # round 0 has nothing to replay: it waits
        assert row["replay_updates"] == replays and row["replayed"] == replays, (k, row["started"])
        if row["started"]:
            assert row["vm/replay_updates"] == replays
            assert row["vm/wait_s"] == pytest.approx(max(0.0, 40.0 - row["vm/replay_s"]))
            assert row["round_billed_s"] >= 40.0  # replay and wait together fill the start-up
        else:
            assert "vm/wait_s" not in row or row["vm/wait_s"] == 0.0
