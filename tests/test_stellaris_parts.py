"""Stellaris's parts against independent answers: the truncation against a literal loop over the
versions, the parameter server's group step against Adam by hand (one step and one version per
group), the door a gradient passes, a gradient computed in a learner function (a real worker
process, through Redis) against the same gradient computed here, and a killed round's bill (only
the gradient jobs that ran)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from nitro.actors.rollout import rollout
from nitro.config import NitroConfig, PriceTable
from nitro.envs import env_spec
from nitro.learners.gradients import parameter_names
from nitro.learners.ppo import PPOLearner
from nitro.learners.truncation import truncated_ratio
from nitro.models import Architecture
from nitro.models.networks import build_critic, build_policy, holding
from nitro.serialization import dumps_tensors, loads_tensors
from nitro.stellaris.gradient import LossSettings, slice_gradient, slice_rows
from nitro.stellaris.wire import GradientError, check_gradient, gradient_payload, load_snapshot, snapshot_payload

ARCH = Architecture(hidden=(16, 16))
SETTINGS = LossSettings(gamma=0.99, gae_lambda=0.95, reward_scale=0.5, clip=0.2, kl_coef=0.1, entropy_coef=0.01,
                        vf_clip=10.0, vf_coef=0.5, is_truncation=True, is_ratio=1.0)


def test_truncation_matches_a_literal_loop_over_versions():
    g = torch.Generator().manual_seed(0)
    logp_b = torch.randn(40, generator=g) * 0.3
    logp_new = (logp_b + torch.randn(40, generator=g) * 0.3).requires_grad_()
    live = [logp_b + torch.randn(40, generator=g) * 0.3 for _ in range(3)]
    for c in (1.0, 0.8):
        got = truncated_ratio(logp_new, logp_b, live, c)
        for i in range(40):
            rho = float(torch.exp(logp_new.detach()[i] - logp_b[i]))
            smallest = rho  # the set includes rho itself
            for logp_j in live:
                smallest = min(smallest, float(torch.exp(logp_j[i] - logp_b[i])))
            assert float(got.detach()[i]) == pytest.approx(min(rho, max(c, smallest)), rel=1e-6)
    # The gradient: rho < 1 trains as usual, rho >= 1 with a smaller live ratio is a constant,
    # rho >= 1 as its own minimum gets half (torch.minimum splits a tie).
    lb = torch.zeros(3)
    ln = torch.tensor([-0.5, 0.5, 0.5], requires_grad=True)
    lives = [torch.tensor([0.0, 0.1, 0.9])]
    truncated_ratio(ln, lb, lives, 1.0).sum().backward()
    expected = [np.exp(-0.5), 0.0, 0.5 * np.exp(0.5)]
    assert ln.grad.tolist() == pytest.approx(expected, rel=1e-6)


def test_slices_cover_each_epoch_once():
    rows = [slice_rows(100, 32, seed=3, epoch=1, index=i) for i in range(4)]
    assert sorted(np.concatenate(rows).tolist()) == list(range(100))
    assert len(slice_rows(100, 32, seed=3, epoch=1, index=4)) == 0
    assert not np.array_equal(slice_rows(100, 32, 3, 0, 0), slice_rows(100, 32, 3, 1, 0))


def _batch(spec, policy, seed=0, steps=64):
    weights = {k: v.numpy() for k, v in policy.state_dict().items()}
    return rollout(weights, spec.env_id, seed, steps, arch=policy.arch).batch


def test_gradient_door_drops_each_kind_of_bad_gradient():
    spec = env_spec("Pendulum-v1")
    policy, critic = build_policy(spec, 0, ARCH), build_critic(spec, 0, ARCH)
    expected = {n: p.shape for n, p in parameter_names(policy, critic).items()}
    good = {n: torch.ones(s) for n, s in expected.items()}
    ok = check_gradient(gradient_payload(good, invocation_id="g1", snapshot_version=3, metrics={"loss": 1.0}),
                        expected=expected, invocation_id="g1", snapshot_version=3)
    assert ok.metrics == {"loss": 1.0}
    name = next(iter(expected))
    cases = {
        "non-finite": ({**good, name: good[name] * float("nan")}, "g1", 3),
        "shape": ({**good, name: torch.ones(2, 2)}, "g1", 3),
        "tensors differ": ({k: v for k, v in good.items() if k != name}, "g1", 3),
        "version": (good, "g1", 4),
        "expected 'g1'": (good, "g2", 3),
    }
    for words, (tensors, inv, version) in cases.items():
        payload = gradient_payload(tensors, invocation_id=inv, snapshot_version=version, metrics={})
        with pytest.raises(GradientError, match=words) as err:
            check_gradient(payload, expected=expected, invocation_id="g1", snapshot_version=3)
        assert "\n" not in str(err.value)
    with pytest.raises(GradientError, match="not a gradient payload"):
        check_gradient(b"\x00garbage" * 4, expected=expected, invocation_id="g1", snapshot_version=3)


def test_snapshot_round_trip_keeps_networks_and_settings():
    spec = env_spec("Pendulum-v1")
    policy, critic = build_policy(spec, 1, ARCH), build_critic(spec, 1, ARCH)
    payload = snapshot_payload(policy, critic, env_id=spec.env_id, version=7, arch=ARCH, settings=SETTINGS)
    snap = load_snapshot(payload, spec)
    assert snap.version == 7 and snap.settings == SETTINGS
    obs = torch.randn(5, *spec.obs_shape)
    assert torch.equal(snap.policy.distribution(obs).mean, policy.distribution(obs).mean)
    assert torch.equal(snap.critic(snap.policy.features(obs)), critic(policy.features(obs)))
    # decoded without an initialisation to overwrite (nitro.models.networks.holding): every parameter trains
    dist = snap.policy.distribution(obs)
    (dist.log_prob(dist.mean.detach()).sum() + snap.critic(snap.policy.features(obs)).sum()).backward()
    assert all(p.grad is not None for p in (*snap.policy.parameters(), *snap.critic.parameters()))


def test_a_snapshot_missing_a_tensor_is_refused_by_name():
    spec = env_spec("Pendulum-v1")
    policy, critic = build_policy(spec, 1, ARCH), build_critic(spec, 1, ARCH)
    del policy.log_std  # the snapshot then carries no policy.log_std
    payload = snapshot_payload(policy, critic, env_id=spec.env_id, version=7, arch=ARCH, settings=SETTINGS)
    with pytest.raises(RuntimeError, match="log_std"):
        load_snapshot(payload, spec)


def test_holding_names_a_buffer_no_state_can_fill():
    class Scaled(torch.nn.Module):  # a buffer outside the state dict stays on the meta device
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2), persistent=False)

    with pytest.raises(ValueError, match="scale"):
        holding(Scaled, Scaled().state_dict())


def gradient_job_and_expected(redis_url, redis_client, run_id: str):
    """A gradient job over a real Hopper batch (a snapshot later than the behaviour policy, one live
    version later still) stored in Redis, and the gradient ``slice_gradient`` computes here."""
    from nitro.cache import TrajectoryCache
    from nitro.stellaris.jobs import GradientJob, snapshot_key

    spec = env_spec("Hopper-v5")
    policy, critic = build_policy(spec, 0, ARCH), build_critic(spec, 0, ARCH)
    behaviour = copy.deepcopy(policy)
    batch = _batch(spec, behaviour, seed=5, steps=96)
    live = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for p in live.parameters():
            p.add_(0.03 * torch.randn_like(p))
    cache = TrajectoryCache(redis_client, run_id, ttl_s=600)
    snap_key, live_key = snapshot_key(cache, 1, "a1", 4), snapshot_key(cache, 1, "a1", 5)
    for key, net, version in ((snap_key, policy, 4), (live_key, live, 5)):
        redis_client.set(key, snapshot_payload(net, critic, env_id=spec.env_id, version=version, arch=ARCH,
                                               settings=SETTINGS))
    meta = {"format": "nitro.policy/1", "env_id": spec.env_id, "version": 1, "arch": ARCH.to_meta()}
    weights_key = cache.publish_weights(1, dumps_tensors(behaviour.state_dict(), meta))
    batch_key, _ = cache.put_batch(1, f"{run_id}-r00001-0000", dumps_tensors(batch, {"format": "nitro.batch/1"}))
    job = GradientJob(run_id=run_id, round=1, invocation_id=f"{run_id}-r00001-a1-g00000", job=0, env_id=spec.env_id,
                      snapshot_key=snap_key, snapshot_version=4, behaviour_key=weights_key, live_keys=[live_key],
                      actor_id=f"{run_id}-r00001-0000", batch_key=batch_key, seed=11, epoch=2, slice=1,
                      slice_samples=40, cache_url=redis_url)
    rows = slice_rows(96, 40, seed=11, epoch=2, index=1)
    want, metrics = slice_gradient(policy, critic, behaviour, [live], batch, rows, SETTINGS)
    assert 0.0 < metrics["truncated_frac"] < 1.0  # the live version truncates some of the slice's ratios
    return job, want


def assert_function_gradient(summary, redis_client, job, want) -> None:
    """The function's answer and the gradient it stored equal ``want`` to 1e-6."""
    from nitro.cache import TrajectoryCache
    from nitro.stellaris.jobs import gradient_key

    assert summary.ok, summary.error
    assert summary.steps == 40
    assert set(summary.profile) == {"fetch_s", "decode_s", "compute_s", "write_s"}
    assert all(v > 0 for v in summary.profile.values())
    assert summary.batch_key == gradient_key(TrajectoryCache(redis_client, job.run_id), 1, job.invocation_id)
    got, _ = loads_tensors(redis_client.get(summary.batch_key))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name].numpy(), atol=1e-6, rtol=1e-5)


def test_function_gradient_equals_in_process_gradient(redis_url, redis_client):
    """A learner function in a real worker process (the pool's default handler, which every
    backend's image runs), through Redis and safetensors, against ``slice_gradient`` here."""
    from nitro.actors.local import LocalActorPool

    job, want = gradient_job_and_expected(redis_url, redis_client, "grad-eq")
    with LocalActorPool(workers=1, timeout_s=60) as pool:
        summary = pool.invoke(job)
    assert_function_gradient(summary, redis_client, job, want)


def test_a_lanes_invocation_runs_its_ready_jobs_and_stops_at_one_not_ready(redis_url, redis_client):
    """One invocation of a lane (in a real worker process) runs its jobs while each is ready: it
    pushes each job's answer as the job ends (not billed: the lane's invocation is), and returns at
    the first job whose batch is not in the cache within the linger, leaving it to the next."""
    from nitro.actors.events import ActorSummary
    from nitro.actors.local import LocalActorPool
    from nitro.cache import TrajectoryCache
    from nitro.stellaris.jobs import GradientLane

    job, want = gradient_job_and_expected(redis_url, redis_client, "lane")
    second = job.model_copy(update={"job": 1, "invocation_id": job.invocation_id.replace("g00000", "g00001")})
    waiting = job.model_copy(update={"job": 2, "invocation_id": job.invocation_id.replace("g00000", "g00002"),
                                     "batch_key": job.batch_key + "-not-landed"})
    lane = GradientLane(invocation_id="lane-r00001-a1-l000-i00000", round=1, lane=0, jobs=[job, second, waiting],
                        answers_key="nitro:lane:r00001:answers:a1", linger_s=0.3, budget_s=60)
    with LocalActorPool(workers=1, timeout_s=60) as pool:
        summary = pool.invoke(lane)
    assert summary.ok, summary.error
    assert summary.invocation_id == lane.invocation_id and summary.steps == 80  # two jobs of 40 samples
    assert summary.billed_ms >= 300  # it waited the linger for the third job, and is billed for it
    answers = [ActorSummary.model_validate_json(raw) for raw in redis_client.lrange(lane.answers_key, 0, -1)]
    assert [a.invocation_id for a in answers] == [job.invocation_id, second.invocation_id]
    assert [a.shared_invocation for a in answers] == [False, True] and all(a.billed_ms == 0 for a in answers)
    assert_function_gradient(answers[0], redis_client, job, want)
    assert_function_gradient(answers[1], redis_client, second, want)  # the same slice and snapshot
    stored = TrajectoryCache(redis_client, job.run_id).get_summaries(1, [lane.invocation_id])
    assert ActorSummary.model_validate_json(stored[lane.invocation_id]) == summary  # what a resume bills


def test_a_measured_lanes_invocation_takes_the_next_jobs_in_line_and_frees_each_place(redis_url, redis_client):
    """A measured lane's invocation (in a real worker process) runs the job its lane took for it,
    then takes each next job in line from the round's gate itself, bound to the version published
    then beside the versions running jobs hold (here another function's job 0, at v5), and frees
    its place in the gate with each answer. It returns at the first job whose batch is not in the
    cache within the linger, leaving that job untaken for the next invocation."""
    from nitro.actors.events import ActorSummary
    from nitro.actors.local import LocalActorPool
    from nitro.cache import TrajectoryCache
    from nitro.stellaris.arrivals import Gate
    from nitro.stellaris.jobs import GradientLane

    job, want = gradient_job_and_expected(redis_url, redis_client, "pull")
    cache = TrajectoryCache(redis_client, job.run_id, ttl_s=600)

    def nth(index: int, **update):
        inv = job.invocation_id.replace("g00000", f"g{index:05d}")
        return job.model_copy(update={"job": index, "invocation_id": inv, **update})

    planned = [nth(0), nth(1), nth(2), nth(3, batch_key=job.batch_key + "-not-landed")]
    gate = Gate(cache, 1, "a1", lanes=2)
    gate.open(planned, version=5)
    assert gate.take(planned[0], by="another-function").snapshot_version == 5  # runs on, at v5
    gate.publish(4)  # as the fixture's snapshot: jobs taken from now on compute at v4, v5 live
    invocation = "pull-r00001-a1-m00001"
    first = gate.take(planned[1], by=invocation)
    assert (first.snapshot_key, first.live_keys) == (job.snapshot_key, job.live_keys)
    lane = GradientLane(invocation_id=invocation, round=1, lane=0, jobs=[first], answers_key="nitro:pull:answers:a1",
                        linger_s=0.3, budget_s=60, pulls=True, attempt="a1", lanes=2)
    with LocalActorPool(workers=1, timeout_s=60) as pool:
        summary = pool.invoke(lane)
    assert summary.ok, summary.error
    assert summary.steps == 80 and summary.billed_ms >= 300  # two jobs, and the linger for the third
    answers = [ActorSummary.model_validate_json(raw) for raw in redis_client.lrange(lane.answers_key, 0, -1)]
    assert [a.invocation_id for a in answers] == [planned[1].invocation_id, planned[2].invocation_id]
    assert [a.shared_invocation for a in answers] == [False, True] and all(a.billed_ms == 0 for a in answers)
    assert_function_gradient(answers[0], redis_client, planned[1], want)
    assert_function_gradient(answers[1], redis_client, planned[2], want)  # pulled: v4, with v5 live
    assert gate.took(invocation) == [1, 2] and redis_client.hget(gate.bound, 2) == b"4"
    assert redis_client.hgetall(gate.running) == {b"0": b"5"}  # its own places freed
    assert gate.next_job() == 3  # not taken: its batch never landed


def test_parameter_server_takes_one_step_per_group_on_the_weighted_mean(redis_client):
    """A group of two gradients (32 samples fresh, 96 samples at staleness 8: weight 8^(-1/3) =
    0.5) is one Adam step on (32 g0 + 96 * 0.5 g1) / (32 + 48) at lr * (32 + 48) / 128, driven by
    hand on a copy; each group is one version and one step, an empty group a version and no step."""
    from nitro.cache import TrajectoryCache
    from nitro.learners import Progress
    from nitro.stellaris.server import Landed, ParameterServer
    from nitro.stellaris.wire import Gradient

    cfg = NitroConfig.load({"env_id": "Pendulum-v1", "model": {"hidden": [8]}, "learner": {"mode": "stellaris"}})
    spec = env_spec("Pendulum-v1")
    learner = PPOLearner(spec, cfg.ppo, seed=0, arch=cfg.model.architecture())
    reference = copy.deepcopy(learner)
    server = ParameterServer(learner, cfg.learner, TrajectoryCache(redis_client, "ps"))
    named = learner.parameter_names()
    g0 = {n: torch.full_like(p, 0.1) for n, p in named.items()}
    g1 = {n: torch.full_like(p, -0.3) for n, p in named.items()}
    landed = [Landed(Gradient("g0", 0, g0, {"samples": 32.0, "loss": 1.0}), staleness=0),
              Landed(Gradient("g1", 0, g1, {"samples": 96.0, "loss": 1.0}), staleness=8)]
    assert server.apply(landed, Progress(1, 10)) == 1
    assert server.version == 1

    ref_named = reference.parameter_names()
    for n, p in ref_named.items():
        p.grad = (32 * g0[n] + 96 * 0.5 * g1[n]) / 80.0
    torch.nn.utils.clip_grad_norm_([p for n, p in ref_named.items() if n.startswith("policy.")], cfg.ppo.max_grad_norm)
    torch.nn.utils.clip_grad_norm_([p for n, p in ref_named.items() if n.startswith("critic.")], cfg.ppo.max_grad_norm)
    reference.optimizer.param_groups[0]["lr"] = cfg.ppo.lr * 80.0 / 128.0
    reference.optimizer.step()
    for n, p in named.items():
        torch.testing.assert_close(p, ref_named[n], rtol=0, atol=1e-7)
        assert p.grad is None
    assert learner.optimizer.param_groups[0]["lr"] == cfg.ppo.lr  # the factor lasts one step

    # three more groups of 1, 3 and 0 gradients: three versions, two Adam steps
    for group in ([landed[0]], [*landed, landed[0]], []):
        server.apply(group, Progress(1, 10))
    assert server.version == 4
    assert {int(s["step"]) for s in learner.optimizer.state.values()} == {3}


def test_weighted_mean_by_samples_and_weights_by_hand():
    from nitro.learners.gradients import Gradients, weighted_mean

    a = Gradients({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])}, samples=10, loss=0.0)
    b = Gradients({"w": torch.tensor([3.0, -2.0])}, samples=30, loss=0.0)  # reached no "b"
    mean, factor = weighted_mean([a, b], [1.0, 0.5])
    # masses 10 and 15: w = (10 [1, 2] + 15 [3, -2]) / 25, b = 10 * 4 / 25; factor 25 / 40
    assert mean["w"].tolist() == pytest.approx([55 / 25, -10 / 25])
    assert mean["b"].tolist() == pytest.approx([40 / 25])
    assert factor == pytest.approx(25 / 40)
    alone, one = weighted_mean([a], [1.0])
    assert one == 1.0 and alone["w"] is a.tensors["w"]  # one gradient at weight 1 is applied as it is


def test_a_killed_round_bills_only_the_gradient_jobs_that_ran(redis_client, tmp_path):
    """Two actors (one answered, one lost: its timeout) and three gradient jobs of a dead attempt:
    one answered, one started and lost (its timeout), one never started (nothing)."""
    from nitro.actors.events import ActorSummary
    from nitro.cache import TrajectoryCache
    from nitro.pricing.cost import CostLedger
    from nitro.run.interrupted import bill_interrupted_round
    from nitro.run.rundir import RunDir

    cache, run_dir = TrajectoryCache(redis_client, "bill-jobs"), RunDir(tmp_path, "bill-jobs")
    actors, jobs = ["a0", "a1"], ["g0", "g1", "g2"]
    attempt = run_dir.save_inflight(1, actors)
    assert run_dir.save_inflight(1, actors, attempt=attempt, if_started=jobs) == attempt
    for inv, ms in (("a0", 1200), ("g0", 40)):
        cache.put_summary(1, inv, ActorSummary(invocation_id=inv, ok=True, billed_ms=ms).model_dump_json())
    cache.mark_started(1, "g0")
    cache.mark_started(1, "g1")
    ledger = CostLedger(PriceTable(), max_billed_ms=5000)
    assert bill_interrupted_round(run_dir, 1, cache, ledger) == 4
    (entry,) = ledger.rounds
    assert entry.interrupted and entry.n_requests == 4 and entry.attempt == attempt
    assert entry.billed_ms == 1200 + 5000 + 40 + 5000  # a0, a1 lost, g0, g1 started and lost
    assert bill_interrupted_round(run_dir, 1, cache, ledger) == 0  # the attempt is billed once


def test_two_attempts_at_a_round_share_no_snapshot_or_gradient_key(redis_client, redis_url):
    """A resumed attempt plans the round's jobs again (the same schedule, from the seed), under
    keys of its own: it never reads a snapshot or a gradient the dead attempt wrote."""
    from nitro.actors.events import ActorEvent
    from nitro.cache import TrajectoryCache
    from nitro.learners.behaviour import BehaviourPolicies
    from nitro.stellaris.jobs import gradient_key
    from nitro.stellaris.round import StellarisLearning
    from nitro.validation import bounds_for

    cfg = NitroConfig.load({"env_id": "CartPole-v1", "model": {"hidden": [8]}, "steps_per_actor": 64,
                            "learner": {"mode": "stellaris", "slice_samples": 32}})
    spec = env_spec("CartPole-v1")
    learner = PPOLearner(spec, cfg.ppo, seed=0, arch=cfg.model.architecture())
    cache = TrajectoryCache(redis_client, "attempts")
    learning = StellarisLearning(cfg, learner, cache, "attempts", BehaviourPolicies(spec, ARCH, atol=1e-5, rtol=1e-5),
                                 bounds_for(spec, cfg.door))
    events = [ActorEvent(run_id="attempts", round=1, invocation_id=f"attempts-r00001-{i:04d}", weights_key="w",
                         env_id=spec.env_id, seed=i, n_steps=64, cache_url=redis_url) for i in range(2)]
    checkpoint = learning.state_dict()  # what the resumed attempt starts from
    dead = learning.plan(1, events, "w", redis_url, {}, "dead0a")
    learning.load_state_dict(checkpoint)
    resumed = learning.plan(1, events, "w", redis_url, {}, "live1b")
    assert dead.schedule == resumed.schedule and len(dead.jobs) == len(resumed.jobs) == 2 * 2 * cfg.ppo.epochs

    def keys(plan) -> set[str]:
        return {k for j in plan.jobs
                for k in (j.invocation_id, j.snapshot_key, *j.live_keys, gradient_key(cache, 1, j.invocation_id))}

    assert keys(dead) and not keys(dead) & keys(resumed)
    assert all("dead0a" in k for k in keys(dead)) and all("live1b" in k for k in keys(resumed))
    for plan in (dead, resumed):  # each attempt published its own first version
        assert redis_client.exists(plan.jobs[0].snapshot_key)


def test_the_noise_groups_take_one_first_pass_gradient_per_batch_and_version():
    """The round's noise from the functions' gradients by hand: version 0 has actors a and b (a's
    second slice and every second-pass gradient are no new fragment), version 1 one fragment only,
    which says nothing; the result is what the sync learner reports for those two fragments."""
    from nitro.learners.fragments import (
        FRAGMENT_SAMPLES,
        FRAGMENTS,
        POLICY_FRAG_SQNORM,
        POLICY_MEAN_SQNORM,
        SECONDS,
        VALUE_FRAG_SQNORM,
        VALUE_MEAN_SQNORM,
    )
    from nitro.stellaris.jobs import GradientJob
    from nitro.stellaris.noise import NoiseGroups
    from nitro.stellaris.wire import Gradient

    def landed(job: int, actor: str, version: int, epoch: int, policy: list[float], critic: float):
        j = GradientJob(run_id="r", round=1, invocation_id=f"g{job}", job=job, env_id="Hopper-v5",
                        snapshot_key="s", snapshot_version=version, behaviour_key="b", actor_id=actor, batch_key="x",
                        seed=0, epoch=epoch, slice=0, slice_samples=32, cache_url="redis://localhost")
        g = Gradient(f"g{job}", version, {"policy.w": torch.tensor(policy), "critic.v": torch.tensor([critic])},
                     {"samples": 32.0, "loss": 0.1})
        return j, g

    noise = NoiseGroups()
    for args in ((0, "a", 0, 0, [1.0, 2.0], 2.0), (1, "a", 0, 0, [50.0, 50.0], 50.0),  # a's second slice
                 (2, "b", 0, 0, [3.0, 0.0], 0.0), (3, "c", 1, 0, [7.0, 7.0], 7.0),  # v1: one fragment
                 (4, "c", 0, 1, [9.0, 9.0], 9.0)):  # second pass
        noise.add(*landed(*args))
    out = noise.diagnostics()
    assert out.pop(SECONDS) >= 0
    # policy: |g_a|^2 = 5, |g_b|^2 = 9 -> 7; mean (2, 1) -> 5. critic: 4, 0 -> 2; mean 1 -> 1
    assert out == pytest.approx({FRAGMENTS: 2.0, FRAGMENT_SAMPLES: 32.0, POLICY_FRAG_SQNORM: 7.0,
                                 POLICY_MEAN_SQNORM: 5.0, VALUE_FRAG_SQNORM: 2.0, VALUE_MEAN_SQNORM: 1.0})
    lonely = NoiseGroups()
    lonely.add(*landed(0, "a", 0, 0, [1.0, 2.0], 2.0))
    lonely.add(*landed(1, "b", 1, 0, [3.0, 0.0], 0.0))
    assert lonely.diagnostics() == {}  # no version saw two batches: no measurement


# -- the measured schedule: real arrivals --------------------------------------------------------


def _measured_round(redis_client, redis_url, run_id: str, actors: int, **learner):
    """A StellarisLearning on ``learner.schedule: measured`` and its plan for round 1: 2 slices per
    actor, one pass, 2 learner functions (0.5 per actor, rounded up, for 3 actors); every batch
    already in the cache (its bytes are never read: the parameter server's ``land`` is the test's)."""
    from nitro.actors.events import ActorEvent
    from nitro.cache import TrajectoryCache
    from nitro.learners.behaviour import BehaviourPolicies
    from nitro.stellaris.round import StellarisLearning
    from nitro.validation import bounds_for

    cfg = NitroConfig.load({"env_id": "CartPole-v1", "model": {"hidden": [8]}, "steps_per_actor": 64,
                            "round_deadline_s": 30, "learner": {"mode": "stellaris", "slice_samples": 32, "epochs": 1,
                                                                "schedule": "measured", **learner}})
    spec = env_spec("CartPole-v1")
    cache = TrajectoryCache(redis_client, run_id)
    learner = PPOLearner(spec, cfg.ppo, seed=0, arch=cfg.model.architecture())
    learning = StellarisLearning(cfg, learner, cache, run_id, BehaviourPolicies(spec, ARCH, atol=1e-5, rtol=1e-5),
                                 bounds_for(spec, cfg.door))
    events = [ActorEvent(run_id=run_id, round=1, invocation_id=f"{run_id}-r00001-{i:04d}", weights_key="w",
                         env_id=spec.env_id, seed=i, n_steps=64, cache_url=redis_url) for i in range(actors)]
    plan = learning.plan(1, events, "w", redis_url, {}, "att01")
    assert plan.measured == (cfg.learner.schedule == "measured") and plan.lanes == 2
    return learning, plan


def _serve_in_thread(learning, plan, busy=None):
    """``_serve_arrivals`` on its own thread, as the parameter server's task runs it, with a ``land``
    that keeps each answered job (a failed one is lost) and a ``step`` that records each group's
    jobs and stalenesses and publishes the next version (once ``busy`` is set, when given: the
    server stays busy in its step until then)."""
    import threading

    from nitro.stellaris.server import Landed, Served

    served = Served(batches={}, missing=[], corrupt={}, lost={}, staleness=[], adam_steps=0, metrics={})
    groups: list[list[tuple[int, int]]] = []

    def land(job, staleness):
        if not learning._answers[job.invocation_id].ok:
            learning._lose(job, "gradient lost: the function failed", served)
            return None
        return Landed(job, staleness)  # the job stands in for its gradient

    def step(group):
        groups.append([(x.gradient.job, x.staleness) for x in group])
        if busy is not None:
            assert busy.wait(20)
        learning.server.version += 1
        learning._publish(1, plan.attempt)

    thread = threading.Thread(target=learning._serve_arrivals, args=(plan, served, land, step), daemon=True)
    thread.start()
    return thread, served, groups


def _ok(job):
    from nitro.actors.events import ActorSummary

    return ActorSummary(invocation_id=job.invocation_id, ok=True, steps=32)


def test_measured_jobs_take_the_version_they_find_and_land_as_simulate_says(redis_client, redis_url):
    """The hand-worked schedule of ``test_hand_worked_schedule_bound_0_trigger_k_2`` played by real
    arrivals: 2 learner functions, bound 0, K = 2, the answers in the order the latencies give
    (0, 2, 1, 3, 4). Each job is taken from the round's gate in Redis in line, bound to the version
    published when it is taken, beside the versions the running jobs hold; a job waits for a free
    function; the parameter server's groups and stalenesses are the simulation's."""
    import dataclasses
    import threading

    from nitro.stellaris.jobs import snapshot_key
    from nitro.stellaris.schedule import simulate
    from tests.support.servers import wait_until

    learning, plan = _measured_round(redis_client, redis_url, "measured", actors=3, functions_per_actor=0.5,
                                     trigger_k=2)
    plan = dataclasses.replace(plan, jobs=plan.jobs[:5], bound=0)
    for job in plan.jobs:
        redis_client.set(job.batch_key, b"landed")
    thread, served, groups = _serve_in_thread(learning, plan)

    def key(version: int) -> str:
        return snapshot_key(learning.cache, 1, "att01", version)

    jobs, started = plan.jobs, {}
    for _ in range(2):
        job = learning.take_next(plan)
        started[job.job] = job
    learning.answered(jobs[0], _ok(jobs[0]))
    wait_until(lambda: learning._published == 1, 20, "version 1", every_s=0.01)
    started[2] = learning.take_next(plan)
    learning.answered(jobs[2], _ok(jobs[2]))
    wait_until(lambda: learning._published == 2, 20, "version 2", every_s=0.01)
    started[3] = learning.take_next(plan)
    waiting = threading.Thread(target=lambda: started.__setitem__(4, learning.take_next(plan)), daemon=True)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # both functions are busy (jobs 1 and 3)
    learning.answered(jobs[1], _ok(jobs[1]))
    waiting.join(10)
    learning.answered(jobs[3], _ok(jobs[3]))
    wait_until(lambda: learning._published == 3, 20, "version 3", every_s=0.01)  # else 3 and 4 land as one
    learning.answered(jobs[4], _ok(jobs[4]))
    thread.join(10)
    assert not thread.is_alive() and served.lost == {}
    assert learning._flight.gate.next_job() == 5  # each of the five was taken once, in line

    assert [started[j].job for j in range(5)] == [0, 1, 2, 3, 4]  # in line
    assert [started[j].snapshot_version for j in range(5)] == [0, 0, 1, 2, 2]
    assert [started[j].snapshot_key for j in range(5)] == [key(v) for v in (0, 0, 1, 2, 2)]
    assert [started[j].live_keys for j in range(5)] == [[], [], [key(0)], [key(0)], []]
    assert groups == [[(0, 0)], [(2, 0)], [(1, 2), (3, 0)], [(4, 1)]]
    want = simulate([0.0] * 5, [1.0, 3.0, 1.5, 1.0, 2.0], lanes=2, start_version=0, bound=0, trigger_k=2)
    assert groups == [list(zip(a.jobs, a.staleness)) for a in want.applications]


def test_seeded_lanes_run_the_schedules_jobs(redis_client, redis_url):
    """Each lane runs the jobs the schedule put on it, in order, and the lanes together run every
    job once."""
    learning, plan = _measured_round(redis_client, redis_url, "lanes-seeded", actors=3, schedule="seeded")
    by_lane = [[job.job for job in learning.lane_jobs(plan, lane)] for lane in range(plan.lanes)]
    assert by_lane == [[j["job"] for j in plan.schedule["jobs"] if j["lane"] == lane] for lane in range(plan.lanes)]
    assert sorted(j for jobs in by_lane for j in jobs) == list(range(len(plan.jobs))) == [0, 1, 2, 3, 4, 5]
    assert all(jobs == sorted(jobs) and jobs for jobs in by_lane)


def test_the_gate_gives_each_job_once_in_line_to_a_free_function(redis_client, redis_url):
    """The measured round's gate in Redis, as a lane's task and a learner function both use it: a
    job is taken once (a second taker hears ``passed``), only when it is next in line and fewer
    than ``lanes`` jobs run (``busy``); it is bound to the version published then, its live ones the
    other versions running jobs hold; a job that gives up out of line is skipped once the line
    reaches it; each taker's jobs are recorded; a closed gate gives nothing."""
    learning, plan = _measured_round(redis_client, redis_url, "gate", actors=3)
    gate, jobs = learning._flight.gate, plan.jobs
    assert gate.next_job() == 0 and gate.job(3) == jobs[3]
    assert gate.take(jobs[1], by="a") == "passed"  # not in line
    first = gate.take(jobs[0], by="a")
    assert (first.job, first.snapshot_version, first.live_keys) == (0, 0, [])
    assert gate.take(jobs[0], by="b") == "passed" and gate.next_job() == 1
    gate.publish(1)
    second = gate.take(jobs[1], by="b")
    assert (second.snapshot_version, second.snapshot_key, second.live_keys) == (1, gate.snapshot_key(1),
                                                                                 [gate.snapshot_key(0)])
    assert gate.take(jobs[2], by="a") == "busy"  # two lanes, both running
    gate.give_up(3)  # out of line: the line skips it once it gets there
    assert gate.answered(0) == 0  # its function is free
    third = gate.take(jobs[2], by="a")
    assert (third.snapshot_version, third.live_keys) == (1, [])  # job 1 runs at the same version
    assert gate.next_job() == 4 and gate.took("a") == [0, 2] and gate.took("b") == [1]
    assert [redis_client.hget(gate.bound, j) for j in range(4)] == [b"0", b"1", b"1", None]
    gate.close()
    assert gate.next_job() is None and gate.take(jobs[4], by="a") == "closed"


def test_answers_that_come_while_the_server_is_busy_land_as_one_group(redis_client, redis_url):
    """Unbounded (round 1), K = 9: job 0 lands alone and the server stays busy in its step; jobs 1
    and 2 (both bound to v0) answer meanwhile. Once free, the server takes both at v1 and checks
    the trigger once: one group, staleness 1 each, not two versions."""
    import dataclasses
    import threading

    from tests.support.servers import wait_until

    learning, plan = _measured_round(redis_client, redis_url, "busy", actors=3, functions_per_actor=0.5, trigger_k=9)
    plan = dataclasses.replace(plan, jobs=plan.jobs[:3], bound=None)
    for job in plan.jobs:
        redis_client.set(job.batch_key, b"landed")
    busy = threading.Event()
    thread, served, groups = _serve_in_thread(learning, plan, busy)
    jobs = plan.jobs
    started = [learning.take_next(plan), learning.take_next(plan)]
    learning.answered(jobs[0], _ok(jobs[0]))
    wait_until(lambda: len(groups) == 1, 20, "the first group", every_s=0.01)
    started.append(learning.take_next(plan))  # job 0's function is free; v1 is not published yet
    learning.answered(jobs[1], _ok(jobs[1]))
    learning.answered(jobs[2], _ok(jobs[2]))
    busy.set()
    thread.join(10)
    assert not thread.is_alive() and served.lost == {}
    assert [j.snapshot_version for j in started] == [0, 0, 0]
    assert groups == [[(0, 0)], [(1, 1), (2, 1)]]


def test_measured_jobs_that_give_up_pass_the_gate_and_a_silent_function_is_lost(redis_client, redis_url):
    """Actor 1 fails, so its two jobs give up when the line reaches them (answered as failed) and
    hold no job behind them; job 0's function never answers. The parameter server applies every
    other gradient, waits ``gradient_timeout_s`` for job 0 and stops: job 0 is lost, and job 5,
    which had not started, is not taken any more and is lost too."""
    from nitro.actors.events import ActorSummary

    learning, plan = _measured_round(redis_client, redis_url, "measured-lost", actors=3, functions_per_actor=0.5,
                                     gradient_timeout_s=1.0)
    jobs = plan.jobs
    assert [j.actor_id[-1] for j in jobs] == ["0", "0", "1", "1", "2", "2"]
    for job in (jobs[0], jobs[1], jobs[4], jobs[5]):
        redis_client.set(job.batch_key, b"landed")
    learning.cache.put_summary(1, jobs[2].actor_id,
                               ActorSummary.failed(jobs[2].actor_id, "RuntimeError: env crashed").model_dump_json())
    thread, served, groups = _serve_in_thread(learning, plan)

    assert learning.take_next(plan).job == 0  # and never answers: it holds one function
    assert learning.take_next(plan).job == 1
    learning.answered(jobs[1], _ok(jobs[1]))
    assert learning.take_next(plan).job == 4  # jobs 2 and 3 gave up on the way
    for job in (jobs[2], jobs[3]):
        assert learning._answers[job.invocation_id].error == (
            f"gradient job not started: actor {job.actor_id} failed, its batch will not land")
    learning.answered(jobs[4], _ok(jobs[4]))
    thread.join(15)
    assert not thread.is_alive() and learning._flight.closed
    assert learning.take_next(plan) is None  # the gate is closed: job 5 never starts
    assert sorted(served.lost) == sorted(j.invocation_id for j in (jobs[0], jobs[2], jobs[3], jobs[5]))
    assert served.lost[jobs[0].invocation_id] == served.lost[jobs[5].invocation_id] == (
        "gradient lost: none landed within 1 s")
    assert [job for group in groups for job, _ in group] == [1, 4]  # unbounded: each lands alone


def test_the_schedule_is_measured_on_lambda_and_ray_unless_configured():
    from nitro.config.learner import LearnerConfig

    assert [LearnerConfig().schedule_on(kind) for kind in ("local", "lambda", "ray")] == [
        "seeded", "measured", "measured"]
    assert LearnerConfig(schedule="seeded").schedule_on("lambda") == "seeded"
    assert LearnerConfig(schedule="measured").schedule_on("local") == "measured"


def test_the_learner_functions_allowance_by_hand():
    """``nitro.stellaris.allowance``: every job at its timeout until a round is observed, then the
    lanes' timeouts plus twice the most billed per job in the last rounds; each invocation counted
    at its timeout while in flight and at its (timeout-capped) bill once it ends."""
    from nitro.stellaris.allowance import WINDOW, FunctionAllowance

    functions = FunctionAllowance(timeout_ms=5000, jobs_per_actor=10, lanes_for=lambda n: math.ceil(n / 2))
    assert functions.limit_ms(8) == 80 * 5000 and functions.limit_ms(0) == 0
    functions.allow(None)  # no budget: nothing is refused
    assert all(functions.take() for _ in range(200))
    functions.allow(None)
    for billed in (100, 60, 40):
        assert functions.take()
        functions.settle(billed)
    functions.answered(4)  # 200 ms over 4 answered jobs: 50 a job
    functions.close()
    functions.allow(12_000)
    assert list(functions.per_job_ms) == [50.0]
    assert functions.limit_ms(8) == 4 * 5000 + 2 * 50 * 80  # 4 lanes' timeouts, twice 50 ms a job
    assert functions.limit_ms(1) == 1 * 5000 + 2 * 50 * 10
    slow = FunctionAllowance(timeout_ms=5000, jobs_per_actor=10, lanes_for=lambda n: n)
    slow.per_job_ms.append(4000.0)
    assert slow.limit_ms(2) == 2 * 10 * 5000  # never more than every job at its timeout
    assert functions.take() and functions.take()  # 10,000 ms in flight
    assert not functions.take()  # 15,000 > 12,000
    functions.settle(300)  # 5,300 committed
    assert functions.take()  # 10,300
    assert not functions.take()
    functions.settle(9_000)  # capped at the timeout, as the ledger bills it: 10,300
    assert not functions.take()
    assert functions.metrics() == {"stellaris_functions_allowance_ms": 12_000.0, "stellaris_functions_refused": 3.0}
    assert "12000 ms" in functions.refusal()
    functions.answered(3)
    functions.close()
    functions.allow(None)
    assert functions.per_job_ms[-1] == (300 + 5000) / 3
    assert functions.metrics() == {"stellaris_functions_refused": 0.0}
    for _ in range(WINDOW):  # rounds of 10 ms a job: the older, dearer ones age out
        assert functions.take()
        functions.settle(10)
        functions.answered(1)
        functions.close()
        functions.allow(None)
    assert functions.limit_ms(8) == 4 * 5000 + 2 * 10 * 80
    restored = FunctionAllowance(timeout_ms=5000, jobs_per_actor=10, lanes_for=lambda n: math.ceil(n / 2))
    restored.load_state_dict(functions.state_dict())
    assert restored.limit_ms(8) == functions.limit_ms(8)
