"""The round steps of nitro.run.engine.TrainingRun, driven by a plain loop (no Prefect) over real parts:
a real Redis, warm local actor processes, Hopper-v5."""

from __future__ import annotations

import math
import time

import pytest

from nitro.actors.events import ActorSummary
from nitro.actors.local import LocalActorPool
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import NitroConfig
from nitro.learners import UpdateResult
from nitro.run.engine import APPEND_ONLY, Decision, TrainingRun
from nitro.run.interrupted import bill_interrupted_round
from nitro.run.rundir import RunDir
from nitro.run.stopping import STOP_BUDGET
from nitro.run.updates import UpdateReport


def drive(training: TrainingRun, pool: LocalActorPool, rounds: int) -> list[dict]:
    reports = []
    for k in range(training.next_round, rounds):
        started = time.perf_counter()
        update = training.mode.update(k)
        detection = training.detect_boosting(k, update)
        decision = training.decide_actors(k, detection, update, started)
        events = training.plan_invocations(k, decision, training.publish_weights(k))
        summaries = pool.invoke_many(events)
        report = training.end_round(k, update, detection, decision, summaries, actor_s=0.0,
                                    elapsed_s=time.perf_counter() - started)
        report = training.record_round(report, time.perf_counter() - started)
        reports.append(report)
        if report.stop_reason:
            break
    return reports


@pytest.fixture(scope="module")
def pool():
    with LocalActorPool(workers=2, timeout_s=60, memory_mb=1024) as p:
        yield p


def _training(redis_url, run_id, **overrides) -> TrainingRun:
    base = {"steps_per_actor": 128, "detector": {"subset_size": 128}, "scaler": {"i_min": 2, "i_max": 6, "window": 3}}
    cfg = NitroConfig.load({**base, **overrides})
    cache = TrajectoryCache(connect_redis(redis_url), run_id, ttl_s=600)
    return TrainingRun(cfg, run_id, cache, actor_cache_url=redis_url)


def test_nitro_scaler_rounds_vary_within_bounds(redis_url, pool):
    training = _training(redis_url, "eng-nitro", rounds=6)
    reports = drive(training, pool, 6)
    actors = [int(r.metrics["actors_launched"]) for r in reports]
    assert all(2 <= a <= 6 for a in actors), actors
    assert len(set(actors)) > 1, f"actor counts never varied: {actors}"
    scored = [r.metrics for r in reports[1:]]
    assert all(not math.isnan(m["hessian_R"]) for m in scored)
    assert all(m["lambda_min"] < 0 < m["lambda_max"] for m in scored)
    assert reports[-1].metrics["env_steps_total"] == sum(a * 128 for a in actors)
    assert reports[-1].stop_reason == "round_limit"


@pytest.mark.parametrize("clock", ["measured", "lambda"])
def test_budget_is_never_exceeded_and_the_run_stops_cleanly(redis_url, pool, clock):
    # Worst-case pricing: each actor may bill its 5 s timeout, the learner its bound (nitro/scaling/budget.py).
    # On the Lambda clock the round is billed as if its actors ran at once, cold starts included.
    budget = 0.008
    training = _training(redis_url, f"eng-budget-{clock}", rounds=200, budget_usd=budget, backend={"timeout_s": 5},
                       scaler={"name": "always", "i_min": 2, "i_max": 6}, clock={"kind": clock}, eval={"episodes": 2})
    reports = drive(training, pool, 200)
    spent = [r.metrics["spend_total_usd"] for r in reports]
    assert reports[-1].stop_reason == STOP_BUDGET
    assert len(reports) < 200
    assert max(spent) <= budget
    assert spent == sorted(spent)
    # The run ends on an evaluation of its last policy, paid from the reserve it kept for it.
    last = reports[-1].metrics
    assert last["actors_launched"] == 0 and last["eval_invocations"] == 2 * training.config.eval.episodes
    # Each round records what the scaler wanted beside what the budget let it launch.
    assert all(r.metrics["actors_wanted"] >= r.metrics["actors_launched"] for r in reports)
    assert last["actors_wanted"] >= 2
    assert last["eval_episodes"] == training.config.eval.episodes and not math.isnan(last["eval_return_mean"])
    assert training.final_return()[0] == reports[-1].round
    assert float(training.ledger.spent) == pytest.approx(sum(r.metrics["spend_round_usd"] for r in reports))


def test_checkpoint_resume_reproduces_the_next_round(redis_url, pool, tmp_path, monkeypatch):
    monkeypatch.setattr("nitro.run.rowblocks.ROWS_PER_BLOCK", 1)  # every row of the history in a block
    kw = dict(rounds=3, round_deadline_s=30.0, scaler={"name": "fixed", "fixed_actors": 2})
    a = _training(redis_url, "eng-ckpt", **kw)
    drive(a, pool, 2)
    RunDir(tmp_path, "eng-ckpt").save(1, a.state_dict(), append_only=APPEND_ONLY)
    b = _training(redis_url, "eng-ckpt", **kw)
    _, state = RunDir(tmp_path, "eng-ckpt").load()
    b.load_state_dict(state)
    assert b.next_round == 2 and b.mode.pending == a.mode.pending
    assert len(list((tmp_path / "runs/eng-ckpt/checkpoints/rows").glob("*.copy.json"))) == 4  # 2 rounds, 2 lists
    assert [r.keys() for r in b.history] == [r.keys() for r in a.history] and len(a.history) == 2
    assert all(v == a_row[key] or (math.isnan(v) and math.isnan(a_row[key]))
               for a_row, b_row in zip(a.history, b.history) for key, v in b_row.items())
    assert b.ledger.rounds == a.ledger.rounds
    # Round 2's update on the same batches from the restored state is the same update.
    ua, ub = a.mode.update(2), b.mode.update(2)
    assert ua.samples == ub.samples == 256
    assert ua.diagnostics["policy_loss"] == pytest.approx(ub.diagnostics["policy_loss"], rel=1e-6)
    assert ua.diagnostics["kl"] == pytest.approx(ub.diagnostics["kl"], rel=1e-6)
    da, db = a.decide_actors(2, None, ua, time.perf_counter()), b.decide_actors(2, None, ub, time.perf_counter())
    assert da.n_actors == db.n_actors == 2
    assert [e.seed for e in a.plan_invocations(2, da, "k")] == [e.seed for e in b.plan_invocations(2, db, "k")]


def test_missing_actor_batches_are_recorded_not_waited_for_forever(redis_url, pool):
    training = _training(
        redis_url, "eng-missing", rounds=2, round_deadline_s=1.0, scaler={"name": "fixed", "fixed_actors": 2}
    )
    drive(training, pool, 1)
    training.mode.pending.append("eng-missing-r00000-0099")  # an actor whose batch never comes
    report = training.mode.update(1)
    assert report.missing == ["eng-missing-r00000-0099"]
    assert report.batches == 2 and report.samples == 256


def test_a_slow_first_update_stays_within_the_budget(redis_url, pool):
    """Round 1 holds the run's first update and detection, which round 0 (no update) says nothing
    about: here it takes 4 s, where round 0 took about one. The old reservation (twice the last
    round) could let it pass the budget; the decision now measures what its round has taken and
    reserves the next update's allowance, which the update's deadline enforces (the property test
    in test_scalers.py covers every timing; this runs the real engine)."""
    budget = 0.005  # about 26 s of learner time at the default $0.68/h
    training = _training(redis_url, "eng-slow", rounds=1000, budget_usd=budget, backend={"timeout_s": 2},
                       eval={"every_rounds": 0}, scaler={"name": "fixed", "fixed_actors": 2, "i_min": 2, "i_max": 6})
    update = training.learner.update

    def slow_first(batches, **kwargs):
        if training.learner.n_updates == 0:
            time.sleep(4.0)
        return update(batches, **kwargs)

    training.learner.update = slow_first
    reports = drive(training, pool, 1000)  # the budget stops it long before: a round takes well over 0.03 s
    assert reports[-1].stop_reason == STOP_BUDGET and len(reports) >= 2
    assert float(training.ledger.spent) <= budget
    assert reports[1].metrics["learner_s"] >= 4.0


@pytest.mark.parametrize("enabled", [None, True])
def test_detection_runs_only_where_something_reads_it(redis_url, pool, enabled):
    """The fixed scaler never reads R: by default its rounds skip the Hessian (work nothing uses);
    ``detector.enabled=true`` (what the probe's plain runs set) computes and logs it anyway."""
    training = _training(redis_url, f"eng-detect-{enabled}", rounds=2, scaler={"name": "fixed", "fixed_actors": 2},
                       detector={"subset_size": 128, "enabled": enabled})
    scored = drive(training, pool, 2)[1].metrics
    assert math.isnan(scored["hessian_R"]) is (enabled is None)
    assert (scored["detection_s"] > 0) is (enabled is True)


@pytest.mark.parametrize("anneal", [True, False])
def test_the_learning_rate_anneals_over_the_planned_rounds(redis_url, pool, anneal):
    """``ppo.anneal_lr`` decays PPO's lr linearly over the run (CleanRL's schedule); off (both
    presets' default) it stays constant. Round 3 of 4 makes the third and last update: 1/3 of it."""
    training = _training(redis_url, f"eng-anneal-{anneal}", rounds=4, ppo={"anneal_lr": anneal},
                       scaler={"name": "fixed", "fixed_actors": 2})
    lrs = [r.metrics["ppo/lr"] for r in drive(training, pool, 4)[1:]]
    lr = training.config.ppo.lr
    assert lrs == pytest.approx([lr, 2 * lr / 3, lr / 3] if anneal else [lr] * 3)


def test_an_update_stops_at_its_deadline(redis_url, pool):
    training = _training(redis_url, "eng-deadline", rounds=2, scaler={"name": "fixed", "fixed_actors": 2},
                       detector={"subset_size": 128, "enabled": True})
    drive(training, pool, 1)
    training.deadline.at = time.perf_counter() - 1.0  # what a budget decision sets; already passed
    report = training.mode.update(1)
    assert (
        report.samples == 256 and report.diagnostics["update_cut_short"] == 1.0 and report.diagnostics["sgd_steps"] == 0
    )
    assert training.detect_boosting(1, report) is None  # detection is skipped past the deadline too


def test_updates_that_keep_failing_stop_the_run(redis_url, pool):
    from nitro.run.updates import MAX_FAILED_UPDATES, TrainingError

    training = _training(redis_url, "eng-failing", rounds=2, scaler={"name": "fixed", "fixed_actors": 2})
    drive(training, pool, 1)
    training.learner.update = lambda batches, **kwargs: UpdateResult(sgd_steps=0, skipped_minibatches=4)
    for _ in range(MAX_FAILED_UPDATES - 1):
        training.mode.update(1)
    with pytest.raises(TrainingError, match=f"{MAX_FAILED_UPDATES} policy updates in a row had only non-finite"):
        training.mode.update(1)


def test_a_round_killed_in_flight_is_billed_on_resume(redis_url, pool, tmp_path):
    """The learner dies after its actors were invoked and before the round's checkpoint: on resume
    the invocations are billed from the summaries the actors left in the cache, and at their
    timeout where none is there; once, however often it resumes."""
    kw = dict(rounds=3, home=str(tmp_path), backend={"timeout_s": 7}, scaler={"name": "fixed", "fixed_actors": 3})
    a = _training(redis_url, "eng-inflight", **kw)
    drive(a, pool, 1)
    RunDir(tmp_path, "eng-inflight").save(0, a.state_dict())
    a.mode.update(1)
    events = a.plan_invocations(1, Decision(3, 3, "fixed"), a.publish_weights(1))
    ran = pool.invoke_many(events[:2])  # the third was never answered: the learner died first
    assert all(s.ok for s in ran)

    def bill(t: TrainingRun) -> int:
        return bill_interrupted_round(t.run_dir, t.next_round, t.cache, t.ledger)

    def resume() -> TrainingRun:
        b = _training(redis_url, "eng-inflight", **kw)
        _, state = RunDir(tmp_path, "eng-inflight").load()
        b.load_state_dict(state)
        return b

    b = resume()
    spent_before = b.ledger.spent
    assert bill(b) == 3
    (entry,) = [r for r in b.ledger.rounds if r.interrupted]
    assert entry.round_idx == 1 and entry.n_requests == 3 and entry.learner == 0
    assert entry.billed_ms == sum(s.billed_ms for s in ran) + 7000
    assert b.ledger.spent == spent_before + entry.total
    assert bill(b) == 0  # the same dead attempt is billed once
    RunDir(tmp_path, "eng-inflight").save(0, b.state_dict())
    assert bill(resume()) == 0
    # the re-run of round 1 reports the interrupted spend in its round's metrics
    c = resume()
    report = drive(c, pool, 2)[-1]
    assert report.round == 1 and report.metrics["spend_interrupted_usd"] == pytest.approx(float(entry.total))
    assert float(c.ledger.spent) == pytest.approx(sum(r["spend_round_usd"] for r in c.history))


def test_the_lambda_clock_bills_a_hand_worked_round(redis_url):
    """Two rounds of three actors, billed as if they had run at once on Lambda (nitro.pricing.clock):
    learner-side 10 - 8 = 2 s, 3 x 0.01 s to dispatch, 0.05 s invoke, the slowest actor 2.5 s, and
    a 3 s cold start in the first round only (the second finds the three instances warm)."""
    training = _training(redis_url, "eng-clock", clock={"kind": "lambda", "dispatch_s_per_invocation": 0.01,
                                                      "invoke_s": 0.05, "cold_start_s": 3.0})
    assert training.ledger.tags()["cost.learner_clock"] == "lambda"
    expected = []
    for k, projected in enumerate((2.0 + 0.03 + 0.05 + 2.5 + 3.0, 2.0 + 0.03 + 0.05 + 2.5)):
        events = training.plan_invocations(k, Decision(3, 3, "fixed"), training.publish_weights(k))
        summaries = [
            ActorSummary(invocation_id=e.invocation_id, ok=True, duration_s=d, billed_ms=int(d * 1000))
            for e, d in zip(events, (1.5, 2.5, 2.0))
        ]
        report = training.end_round(
            k, UpdateReport(), None, Decision(3, 3, "fixed"), summaries, actor_s=8.0, elapsed_s=10.0
        )
        m = training.record_round(report, 10.0).metrics
        assert m["round_s"] == 10.0 and m["orchestration_s"] == 2.0  # 10 s less the 8 s of acting
        assert m["round_lambda_s"] == pytest.approx(projected) and m["round_billed_s"] == pytest.approx(projected)
        learner_usd = 0.68 * projected / 3600  # c5.4xlarge at $0.68/h
        assert m["spend_learner_usd"] == pytest.approx(learner_usd, rel=1e-12)
        gb_s = 6.0 * 1024 / 1024  # 1.5 + 2.5 + 2.0 s at 1024 MB
        expected.append(learner_usd + gb_s * 0.0000166667 + 3 * 0.20 / 1e6)
        assert m["spend_round_usd"] == pytest.approx(expected[-1], rel=1e-9)
    assert training.clock.warm_instances == 3

    measured = _training(redis_url, "eng-clock-measured")
    events = measured.plan_invocations(0, Decision(3, 3, "fixed"), measured.publish_weights(0))
    summaries = [
        ActorSummary(invocation_id=e.invocation_id, ok=True, duration_s=2.5, billed_ms=2500) for e in events[:3]
    ]  # the three training actors (round 0 also plans evaluation episodes)
    m = measured.end_round(
        0, UpdateReport(), None, Decision(3, 3, "fixed"), summaries, actor_s=8.0, elapsed_s=10.0
    ).metrics
    # the defaults: 0.3 ms per request, 0.05 s invoke, 3 s cold start
    assert m["round_billed_s"] == 10.0 and m["round_lambda_s"] == pytest.approx(2.0 + 3 * 0.0003 + 0.05 + 2.5 + 3.0)
    assert m["spend_learner_usd"] == pytest.approx(0.68 * 10.0 / 3600, rel=1e-12)


def test_stellaris_counts_a_learner_function_in_flight_at_what_the_ledger_may_bill_it(redis_url):
    """On Lambda an invocation is billed up to the function's own timeout, which may be longer than
    the client's wait (``backend.timeout_s``); the allowance counts an invocation in flight at the
    former, as the ledger and the budget cap do."""
    training = _training(redis_url, "eng-stellaris-billed-cap", learner={"mode": "stellaris"},
                         backend={"kind": "lambda", "timeout_s": 120, "lambda": {"function_timeout_s": 300}})
    assert training.ledger.max_billed_ms == 300_000
    assert training.mode.functions.timeout_ms == 300_000
    local = _training(redis_url, "eng-stellaris-billed-cap-local", learner={"mode": "stellaris"},
                      backend={"timeout_s": 5})
    assert local.mode.functions.timeout_ms == local.ledger.max_billed_ms == 5_000


def test_stellaris_lanes_start_nothing_past_the_budgets_deadline(redis_url):
    """Past the deadline a budget decision set, a lane's invocation is refused before it is marked
    started or reaches the backend (none is given here: reaching it would fail otherwise), so
    what the round's functions run after it is what was already in flight."""
    from nitro.stellaris.jobs import GradientLane

    training = _training(redis_url, "eng-stellaris-deadline", rounds=2, learner={"mode": "stellaris"},
                         scaler={"name": "fixed", "fixed_actors": 2})
    event = GradientLane.model_construct(invocation_id="eng-stellaris-deadline-lane0", round=0, lane=0)
    training.mode.functions.allow(None)
    training.deadline.at = time.perf_counter() - 1.0
    summary = training.mode._invoke(event, backend=None)
    assert not summary.ok and "the budget's deadline for the round's learning passed" in summary.error
    assert training.cache.started(0, [event.invocation_id]) == set()
    training.deadline.at = None  # no deadline: it is started, and the missing backend is its failure
    summary = training.mode._invoke(event, backend=None)
    assert not summary.ok and "AttributeError" in summary.error
    assert training.cache.started(0, [event.invocation_id]) == {event.invocation_id}
