"""Stellaris's parts against independent answers: the truncation against a literal loop over the
versions, the parameter server's steps against Adam by hand, the door a gradient passes, and a
gradient computed in a learner function (a real worker process, through Redis) against the same
gradient computed here."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.learners.ppo import PPOLearner
from nitro.models import Architecture, build_critic, build_policy
from nitro.rollout import rollout
from nitro.serialization import dumps_tensors, loads_tensors
from nitro.stellaris.gradient import LossSettings, gradient_names, slice_gradient, slice_rows
from nitro.stellaris.truncation import truncated_ratio
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
    return rollout(weights, spec.env_id, seed, steps, policy=build_policy(spec, arch=policy.arch)).batch


def test_gradient_door_drops_each_kind_of_bad_gradient():
    spec = env_spec("Pendulum-v1")
    policy, critic = build_policy(spec, 0, ARCH), build_critic(spec, 0, ARCH)
    expected = {n: p.shape for n, p in gradient_names(policy, critic).items()}
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
    snap = load_snapshot(snapshot_payload(policy, critic, env_id=spec.env_id, version=7, arch=ARCH, settings=SETTINGS), spec)
    assert snap.version == 7 and snap.settings == SETTINGS
    obs = torch.randn(5, *spec.obs_shape)
    assert torch.equal(snap.policy.distribution(obs).mean, policy.distribution(obs).mean)
    assert torch.equal(snap.critic(snap.policy.features(obs)), critic(policy.features(obs)))


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
    snap_key, live_key = snapshot_key(cache, 1, 4), snapshot_key(cache, 1, 5)
    redis_client.set(snap_key, snapshot_payload(policy, critic, env_id=spec.env_id, version=4, arch=ARCH, settings=SETTINGS))
    redis_client.set(live_key, snapshot_payload(live, critic, env_id=spec.env_id, version=5, arch=ARCH, settings=SETTINGS))
    weights_key = cache.publish_weights(1, dumps_tensors(behaviour.state_dict(), {"format": "nitro.policy/1", "env_id": spec.env_id,
                                                                                   "version": 1, "arch": ARCH.to_meta()}))
    batch_key, _ = cache.put_batch(1, f"{run_id}-r00001-0000", dumps_tensors(batch, {"format": "nitro.batch/1"}))
    job = GradientJob(run_id=run_id, round=1, invocation_id=f"{run_id}-r00001-g00000", job=0, env_id=spec.env_id,
                      snapshot_key=snap_key, snapshot_version=4, behaviour_key=weights_key, live_keys=[live_key],
                      actor_id=f"{run_id}-r00001-0000", batch_key=batch_key, seed=11, epoch=2, slice=1, slice_samples=40,
                      cache_url=redis_url)
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


def test_parameter_server_steps_match_adam_by_hand(redis_client):
    """Sequential: each gradient its own Adam step at lr * s^(-1/3); weighted mean: one step on the
    weighted mean. Checked against torch's Adam driven by hand on a copy."""
    from nitro.cache import TrajectoryCache
    from nitro.stellaris.server import Landed, ParameterServer
    from nitro.stellaris.wire import Gradient

    cfg = NitroConfig.load({"env_id": "Pendulum-v1", "model": {"hidden": [8]}, "learner": {"mode": "stellaris"}})
    spec = env_spec("Pendulum-v1")
    for apply in ("sequential", "weighted_mean"):
        learner = PPOLearner(spec, cfg.ppo, seed=0, arch=cfg.model.architecture())
        reference = copy.deepcopy(learner)
        server = ParameterServer(learner, cfg.learner.model_copy(update={"apply": apply}), TrajectoryCache(redis_client, "ps"))
        names = list(server.named)
        grads = [{n: torch.full_like(p, 0.1 * (i + 1)) for n, p in server.named.items()} for i in range(2)]
        landed = [Landed(Gradient(f"g{i}", 0, g, {}), staleness=s) for i, (g, s) in enumerate(zip(grads, (0, 8)))]
        assert server.apply(landed) == (2 if apply == "sequential" else 1)
        assert server.version == 1
        ref_named = dict(zip(names, [*[p for p in reference.policy.parameters() if p.requires_grad], *reference.critic.parameters()]))
        opt, lr = reference.optimizer, cfg.ppo.lr
        steps = [(grads[0], 1.0), (grads[1], 8 ** (-1 / 3))] if apply == "sequential" else \
            [({n: (grads[0][n] + 0.5 * grads[1][n]) / 1.5 for n in names}, 1.0)]
        for g, factor in steps:
            for n, p in ref_named.items():
                p.grad = g[n].clone()
            torch.nn.utils.clip_grad_norm_([p for n, p in ref_named.items() if n.startswith("policy.")], cfg.ppo.max_grad_norm)
            torch.nn.utils.clip_grad_norm_([p for n, p in ref_named.items() if n.startswith("critic.")], cfg.ppo.max_grad_norm)
            opt.param_groups[0]["lr"] = lr * factor
            opt.step()
            opt.param_groups[0]["lr"] = lr
        for n, p in server.named.items():
            torch.testing.assert_close(p, ref_named[n], rtol=0, atol=1e-7)
