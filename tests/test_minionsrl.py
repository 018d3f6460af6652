"""MinionsRL's scheduler (nitro/scaling/minionsrl/): state, action mask and reward against hand-worked
rounds; the meta-PPO learns a toy task whose best actor count is known; the scheduler file
round-trips; a run with it stays in [I_min, I_max] and within its budget."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from nitro.actors.local import LocalActorPool
from nitro.cache import TrajectoryCache, connect_redis
from nitro.config import ClockConfig, ConfigError, NitroConfig, PriceTable
from nitro.config.minionsrl import PretrainConfig
from nitro.run.engine import TrainingRun
from nitro.scaling.minionsrl.policy import choose, monte_carlo_returns
from nitro.scaling.minionsrl.pretrain import load_scheduler, pretrain, save_scheduler
from nitro.scaling.minionsrl.simulator import TrainingSimulator
from nitro.scaling.minionsrl.state import StateNormaliser, action_mask, actors_for_action, round_reward, state_vector
from nitro.scaling.scalers import RoundSignal, make_scaler, round_signal


def test_the_state_of_a_hand_worked_round():
    """Round 3, after two rounds: the mean return is the last one that had finished episodes
    (12, carried over round 2's NaN); the last round's acting is its billed 7.25 s less its
    learner 2 s and detection 0.25 s = 5 s; this round's update took 1.75 s; $0.3 of $1 spent."""
    history = [{"train_return_mean": 12.0, "round_billed_s": 5.0, "learner_s": 1.5, "detection_s": 0.5},
               {"train_return_mean": math.nan, "round_billed_s": 7.25, "learner_s": 2.0, "detection_s": 0.25}]
    signal = round_signal(None, {"loss": 0.8, "kl": 0.02}, None, 1.75, history, spent_usd=0.3, budget_left_usd=0.7)
    assert (signal.mean_return, signal.actor_s, signal.learner_s) == (12.0, 5.0, 1.75)
    from nitro.scaling.minionsrl.state import SchedulerObservation

    obs = SchedulerObservation(3, signal.loss, signal.mean_return, signal.kl, signal.learner_s, signal.actor_s,
                               signal.learner_s + signal.actor_s, signal.budget_left_usd)
    np.testing.assert_allclose(state_vector(obs), [3, 0.8, 12.0, 0.02, 1.75, 5.0, 6.75, 0.7], rtol=1e-6)
    first = round_signal(None, {}, None, 0.0, [], spent_usd=0.0, budget_left_usd=None)
    assert first.mean_return is None and first.actor_s is None and first.loss is None


def test_the_action_mask_and_the_actor_count():
    """8 logits, I_min 3, I_max 5: the code samples all 8 and clips N = a + 1; the option masks."""
    assert action_mask(8, 3, 5, mask_out_of_range=False).tolist() == [True] * 8
    assert action_mask(8, 3, 5, mask_out_of_range=True).tolist() == [
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert [actors_for_action(a, 3, 5) for a in (0, 2, 3, 7)] == [3, 3, 4, 5]
    assert action_mask(4, 6, 9, mask_out_of_range=True).tolist() == [False, False, False, True]  # beyond the net


def test_the_reward_of_hand_worked_rounds():
    """-0.1 x 12 s = -1.2 per round; a run ending at 450 < R* = 600 with a best of 500 adds -100."""
    kw = {"final_return": 450.0, "best_return": 500.0, "target_return": 600.0}
    assert round_reward(12.0, 0.1, last=False, **kw) == pytest.approx(-1.2)
    assert round_reward(12.0, 0.1, last=True, **kw) == pytest.approx(-101.2)
    assert round_reward(12.0, 0.1, last=True, final_return=650.0, best_return=650.0, target_return=600.0) == \
        pytest.approx(-1.2)
    np.testing.assert_allclose(monte_carlo_returns([-1.0, -1.0, -101.0], 0.5), [-1 - 0.5 - 25.25, -1 - 50.5, -101])


def test_the_state_normaliser_is_a_running_mean_and_variance():
    rows = np.random.default_rng(0).normal(3.0, 2.0, size=(50, 8))
    norm = StateNormaliser.empty()
    for row in rows:
        norm.update(row)
    np.testing.assert_allclose(norm.mean, rows.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(norm.var, rows.var(axis=0), rtol=1e-9)


def _toy(peak: int, normalize: bool, episodes: int = 300) -> PretrainConfig:
    """5 rounds, N in 1..8; a round gains 2 x exp(-((N - peak) / 1.5)^2) return and takes no time,
    so every round's best count is ``peak``; R* just above the best run makes the last reward the
    whole run's gain (less R*)."""
    return PretrainConfig(episodes=episodes, n_actions=8, i_min=1, i_max=8, beta=0.0, target_return=10.01,
                          budget_usd=100.0, normalize_state=normalize, seed=0,
                          simulator={"rounds": 5, "peak_actors": peak, "peak_gain": 2.0, "width": 1.5, "noise": 0.0,
                                     "learner_fixed_s": 0.0, "learner_s_per_sample": 0.0, "actor_s_per_step": 0.0})


def _greedy_run(scheduler, cfg: PretrainConfig) -> list[int]:
    sim = TrainingSimulator(cfg.simulator, PriceTable(), ClockConfig(kind="lambda"), cfg.budget_usd, seed=1)
    picks = []
    while not sim.done:
        state = scheduler.state(state_vector(sim.observation()))
        choice = choose(scheduler.net, state, action_mask(8, 1, 8, False), greedy=True)
        picks.append(actors_for_action(choice.action, 1, 8))
        sim.step(picks[-1])
    return picks


@pytest.mark.parametrize(("peak", "normalize"), [(7, False), (3, True)])
def test_the_meta_ppo_learns_the_best_actor_count_of_a_toy_task(peak, normalize):
    cfg = _toy(peak, normalize)
    scheduler, rows = pretrain(cfg)
    assert abs(np.mean([r["mean_actors"] for r in rows[:20]]) - peak) > 0.5  # it did not start there
    assert _greedy_run(scheduler, cfg) == [peak] * 5
    assert scheduler.record.episodes == 300 and scheduler.record.env_steps == sum(
        r["mean_actors"] * 5 * 256 for r in rows)


def test_the_scheduler_file_round_trips(tmp_path):
    cfg = _toy(4, normalize=True, episodes=5)
    scheduler, _ = pretrain(cfg)
    loaded = load_scheduler(save_scheduler(tmp_path / "s.safetensors", scheduler))
    assert loaded.record == scheduler.record and loaded.budget_usd == 100.0
    for name, tensor in scheduler.net.state_dict().items():
        assert torch.equal(tensor, loaded.net.state_dict()[name]), name
    np.testing.assert_array_equal(loaded.normaliser.mean, scheduler.normaliser.mean)
    assert loaded.normaliser.count == scheduler.normaliser.count
    states = np.random.default_rng(0).normal(size=(10, 8)).astype(np.float32)
    mask = action_mask(8, 1, 8, False)
    assert [choose(loaded.net, loaded.state(s), mask, greedy=True) for s in states] == \
        [choose(scheduler.net, scheduler.state(s), mask, greedy=True) for s in states]
    with pytest.raises(ValueError, match="not a MinionsRL scheduler"):
        (tmp_path / "bad.safetensors").write_bytes(b"\0" * 16)
        load_scheduler(tmp_path / "bad.safetensors")


def test_minionsrl_needs_a_scheduler_file():
    with pytest.raises(ConfigError, match=r"minionsrl.path: scaler minionsrl needs a scheduler file"):
        NitroConfig.load({}, ["scaler.name=minionsrl"])


@pytest.fixture(scope="module")
def pool():
    with LocalActorPool(workers=2, timeout_s=30, memory_mb=1024) as p:
        yield p


@pytest.mark.slow
def test_a_run_with_it_respects_i_min_i_max_and_the_budget(redis_url, pool, tmp_path):
    """A scheduler pre-trained (3 episodes) for N in 1..8 deployed in a run
    whose range is [2, 4]: every round's wish is clipped there, sampled as the code does; a budget
    that pays for about one actor's worst case caps it and is never passed; the run's tags carry
    the pre-training cost."""
    scheduler, _ = pretrain(PretrainConfig(episodes=3, n_actions=8, i_min=1, i_max=8, simulator={"rounds": 4}))
    path = save_scheduler(tmp_path / "minionsrl.safetensors", scheduler)
    cfg = NitroConfig.load({"steps_per_actor": 64, "rounds": 12, "budget_usd": 0.00215, "eval": {"every_rounds": 0},
                            "backend": {"timeout_s": 3.0},
                            "scaler": {"name": "minionsrl", "i_min": 2, "i_max": 4, "minionsrl": {"path": str(path)}}})
    training = TrainingRun(cfg, "minionsrl-run", TrajectoryCache(connect_redis(redis_url), "minionsrl-run", ttl_s=600),
                           actor_cache_url=redis_url)
    assert training.scaler.tags()["minionsrl.pretrain_episodes"] == "3"
    assert float(training.scaler.tags()["minionsrl.pretrain_usd"]) == pytest.approx(scheduler.record.usd, rel=1e-6)
    wanted, launched, stop = [], [], None
    for k in range(cfg.rounds):
        started = time.perf_counter()
        update = training.mode.update(k)
        decision = training.decide_actors(k, None, update, started)
        wanted.append(decision.wanted)
        events = training.plan_invocations(k, decision, training.publish_weights(k))
        report = training.end_round(k, update, None, decision, pool.invoke_many(events), actor_s=0.0,
                                    elapsed_s=time.perf_counter() - started)
        launched.append(decision.n_actors)
        stop = report.stop_reason
        if stop:
            break
    assert all(2 <= n <= 4 for n in wanted), wanted
    assert all(n <= w for n, w in zip(launched, wanted)) and any(n < w for n, w in zip(launched, wanted)), \
        (launched, wanted)  # the budget cap cut some rounds below the scheduler's wish
    assert stop in ("budget_spent", "round_limit") and training.ledger.spent <= cfg.budget_usd


def test_the_scaler_samples_reproducibly_and_greedy_is_deterministic(tmp_path):
    scheduler, _ = pretrain(_toy(4, normalize=False, episodes=2))
    path = save_scheduler(tmp_path / "s.safetensors", scheduler)
    cfg = NitroConfig.load({}, ["scaler.name=minionsrl", f"scaler.minionsrl.path={path}", "scaler.i_min=1",
                                "scaler.i_max=8"]).scaler
    a, b = make_scaler(cfg, seed=3), make_scaler(cfg, seed=3)
    signal = RoundSignal(loss=0.5, kl=0.01, mean_return=20.0, learner_s=1.0, actor_s=0.5)
    assert [a.decide(k, signal) for k in range(8)] == [b.decide(k, signal) for k in range(8)]
    greedy = make_scaler(cfg.model_copy(update={"minionsrl": cfg.minionsrl.model_copy(update={"greedy": True})}), 3)
    assert len({greedy.decide(4, signal) for _ in range(5)}) == 1


def test_nitro_minionsrl_pretrain_saves_a_scheduler_with_its_record(tmp_path):
    from cli.main import main

    out = tmp_path / "scheduler.safetensors"
    assert main(["minionsrl", "pretrain", "--out", str(out), "episodes=2", "simulator.rounds=3"]) == 0
    record = load_scheduler(out).record
    assert record.episodes == 2 and record.env_steps > 0 and record.usd > 0
    assert main(["minionsrl", "pretrain", "--out", str(out), "episodes=0"]) == 2  # one line naming the field


def _bump_rows(runs: int = 6, rounds: int = 30, noise: float = 0.1, peak: float = 20.0, gain: float = 30.0,
               width: float = 8.0) -> list[dict[str, str]]:
    """rounds.csv rows of runs whose rounds gain a known bump; every fourth round logs no return
    (NaN, as a round where no episode ended); a round's seconds are 0.5 + 1e-3 per sample."""
    rng, rows = np.random.default_rng(1), []
    for run in range(runs):
        ret, steps = 0.0, 0
        for k in range(rounds):
            n = int(rng.integers(1, 65))
            steps += 256 * n
            rows.append({"run_name": f"run{run}", "round": str(k), "return_mean": "nan" if k % 4 == 3 else str(ret),
                         "actors_launched": f"{n}.0", "env_steps_total": str(steps),
                         "round_s": str(0.5 + 1e-3 * 256 * n)})
            ret += gain * math.exp(-(((n - peak) / width) ** 2)) * (1 + noise * rng.standard_normal())
    return rows


def test_the_simulator_fit_recovers_a_known_gain_curve_and_learner_line():
    from nitro.config.minionsrl import SimulatorConfig
    from nitro.scaling.minionsrl.fit import fit_simulator

    base = SimulatorConfig(rounds=7)
    sim, report = fit_simulator(_bump_rows(), base)
    assert abs(sim.peak_actors - 20) <= 2 and sim.width == pytest.approx(8, rel=0.25)
    assert sim.peak_gain == pytest.approx(30, rel=0.15) and 0 < sim.noise < 0.3
    assert sim.learner_fixed_s == pytest.approx(0.5, abs=1e-6) and sim.learner_s_per_sample == pytest.approx(1e-3)
    assert sim.rounds == 7 and report.runs == 6 and report.pairs == 6 * 15  # NaN on either side drops a pair
    assert report.timed_rounds == 180 and report.peak_actors == sim.peak_actors


def test_the_simulator_fit_reads_the_training_return_of_current_reports_not_the_evaluation():
    from nitro.config.minionsrl import SimulatorConfig
    from nitro.scaling.minionsrl.fit import fit_simulator

    old = _bump_rows()
    # Today's rounds.csv: the training return under its own name, beside an evaluation column.
    current = [{**{k: v for k, v in r.items() if k != "return_mean"}, "train_return_mean": r["return_mean"],
                "eval_return_mean": "1000.0"} for r in old]
    assert fit_simulator(current, SimulatorConfig()) == fit_simulator(old, SimulatorConfig())


@pytest.mark.parametrize("report", ["hopper-study", "hopper-lambda"])  # before and after the eval/train split
def test_the_simulator_fit_on_a_hopper_report_peaks_inside_its_actor_range(report):
    from nitro.config.minionsrl import SimulatorConfig
    from nitro.scaling.minionsrl.fit import fit_simulator, read_rounds

    rows = read_rounds(f"docs/results/{report}/rounds.csv")
    sim, report = fit_simulator(rows, SimulatorConfig())
    actors = [float(r["actors_launched"]) for r in rows if float(r["actors_launched"]) >= 1]
    assert min(actors) <= sim.peak_actors <= max(actors) and sim.peak_gain > 0 and sim.width > 0
    assert report.pairs >= 100 and report.runs >= 2 and sim.learner_s_per_sample >= 0 and sim.learner_fixed_s >= 0


@pytest.mark.parametrize("rows, reason", [(_bump_rows(runs=1, rounds=4), "too few round gains"),
                                          (_bump_rows(gain=-5.0), "no round of the")])
def test_the_simulator_fit_refuses_rows_it_cannot_fit(rows, reason):
    from nitro.config.minionsrl import SimulatorConfig
    from nitro.scaling.minionsrl.fit import fit_simulator

    with pytest.raises(ValueError, match=reason) as err:
        fit_simulator(rows, SimulatorConfig())
    assert "\n" not in str(err.value)


def test_pretrain_fit_from_names_the_fit_in_the_record_and_overrides_win(tmp_path, capsys):
    import argparse

    from cli.minionsrl import cmd_minionsrl_pretrain

    out, csv_path = tmp_path / "scheduler.safetensors", "docs/results/hopper-study/rounds.csv"
    args = argparse.Namespace(out=str(out), fit_from=csv_path, overrides=["episodes=2", "simulator.rounds=4",
                                                                          "simulator.noise=0.05"])
    assert cmd_minionsrl_pretrain(args) == 0
    assert "fitted on" in capsys.readouterr().out
    scheduler = load_scheduler(out)
    assert scheduler.record.simulator == f"nitro.scaling.minionsrl.simulator fitted from {csv_path}"
    sim = scheduler.config["simulator"]
    assert sim["rounds"] == 4 and sim["noise"] == 0.05 and sim["fitted_from"] == csv_path and sim["width"] != 16.0
    bad = argparse.Namespace(out=str(out), fit_from=str(tmp_path / "none.csv"), overrides=["episodes=2"])
    with pytest.raises(ConfigError, match="no rounds file"):
        cmd_minionsrl_pretrain(bad)
