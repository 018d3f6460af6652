"""The detector against the exact Hessian of a tiny policy, on a real Hopper PPO batch and on
random data; the degenerate cases; clean-up."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import nitro.models.networks as models
from nitro.actors.rollout import rollout
from nitro.envs import env_spec
from nitro.scaling.detector import (
    Detection,
    classify,
    detect_on_batch,
    hessian_extremes,
    pyhessian_extremes,
)

CLIP = 0.3


def tiny_policy(monkeypatch, seed: int = 0) -> models.Policy:
    """The real Policy class for Hopper (obs 11 -> 2x8 tanh -> 3 actions): 198 parameters."""
    monkeypatch.setattr(models, "HIDDEN", 8)
    return models.build_policy(env_spec("Hopper-v5"), seed=seed)


def advantages(batch: dict[str, np.ndarray], gamma: float = 0.99) -> torch.Tensor:
    """Discounted reward-to-go within episodes, normalised (a critic-free advantage)."""
    rewards, term = batch["rewards"], batch["terminated"]
    ends = np.zeros(len(rewards), bool)
    ends[batch["bootstrap_idx"]] = True
    ret, out = 0.0, np.zeros(len(rewards), np.float64)
    for t in reversed(range(len(rewards))):
        if term[t] or ends[t]:
            ret = 0.0
        ret = rewards[t] + gamma * ret
        out[t] = ret
    out = (out - out.mean()) / (out.std() + 1e-8)
    return torch.as_tensor(out, dtype=torch.float32)


def surrogate(policy: models.Policy, obs, actions, logp_old, adv) -> torch.Tensor:
    """PPO's clipped surrogate objective L (to maximise)."""
    logp = policy.distribution(obs).log_prob(actions)
    ratio = torch.exp(logp - logp_old)
    return torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()


def real_hopper_batch(policy: models.Policy, n_steps: int = 400, seed: int = 3):
    weights = {k: v.numpy() for k, v in policy.state_dict().items()}
    batch = rollout(weights, "Hopper-v5", seed=seed, n_steps=n_steps).batch
    policy.obs_norm.merge(batch["obs"])  # the learner merges the round's statistics
    # the policy moved a little during the update epochs: ratios != 1, some clipped
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return (
        torch.as_tensor(batch["obs"]),
        torch.as_tensor(batch["actions"]),
        torch.as_tensor(batch["logp"]),
        advantages(batch),
    )


class _LossOf(nn.Module):
    """forward() = loss_of(policy), so torch.func.functional_call can swap the parameters."""

    def __init__(self, policy, loss_of):
        super().__init__()
        self.policy = policy
        self._loss_of = loss_of

    def forward(self):
        return self._loss_of(self.policy)


def exact_extremes(policy: models.Policy, loss_of) -> tuple[float, float]:
    """eigvalsh of the exact Hessian, formed with autograd.functional.hessian over the flattened
    parameters (float64 eigensolve)."""
    wrapper = _LossOf(policy, loss_of)
    named = list(wrapper.named_parameters())
    flat0 = torch.cat([p.detach().reshape(-1) for _, p in named])

    def f(flat):
        tensors, i = {}, 0
        for n, p in named:
            tensors[n] = flat[i : i + p.numel()].reshape(p.shape)
            i += p.numel()
        return torch.func.functional_call(wrapper, tensors, ())

    H = torch.autograd.functional.hessian(f, flat0)
    H = 0.5 * (H + H.T)
    ev = torch.linalg.eigvalsh(H.double())
    return float(ev[-1]), float(ev[0])


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def ppo_learner_after_update(monkeypatch, seed: int = 0, n_steps: int = 400):
    """A tiny PPOLearner (the real one, 2x8 nets) that has collected a real Hopper-v5 batch with
    its own policy and done its PPO update on it; returns (learner, prepared batch tensors)."""
    from nitro.config import PPOConfig
    from nitro.learners import PPOLearner

    monkeypatch.setattr(models, "HIDDEN", 8)
    learner = PPOLearner(env_spec("Hopper-v5"), PPOConfig(lr=3e-3, epochs=4), seed=seed)
    weights = {k: v.numpy() for k, v in learner.weights().items()}
    batch = rollout(weights, "Hopper-v5", seed=seed + 10, n_steps=n_steps).batch
    tensors = learner.prepare([batch])
    learner.update([batch])  # the engine detects after the update, on that round's batches
    return learner, tensors


def test_matches_exact_hessian_on_real_hopper_ppo_batch(monkeypatch):
    learner, _tensors = ppo_learner_after_update(monkeypatch)
    params = learner.policy_parameters()
    assert sum(p.numel() for p in params) == 198
    idx = np.arange(0, 400, 2)  # a 200-sample subset
    closure = learner.objective(idx)  # PPO's policy loss (-L + kl * KL) on the update's batch (= tensors)
    lmax, lmin = exact_extremes(learner.policy, lambda _pol: -closure())  # Hessian of L
    assert lmin < 0 < lmax  # an indefinite surrogate, the case Eq. 2 is about

    grads_before = [None if p.grad is None else p.grad.clone() for p in params]  # left by the update
    det = hessian_extremes(closure, params, steps=40, seed=0, negate=True)
    assert det.status == "ok", det
    assert rel(det.lambda_max, lmax) < 1e-3 and rel(det.lambda_min, lmin) < 1e-3, (det, lmax, lmin)
    assert det.R == pytest.approx(-lmax / lmin, rel=2e-3)  # noqa: SIM300  .R is the attribute, not a constant
    assert det.n_hvp == 40
    for p, g in zip(params, grads_before):  # .grad untouched (autograd.grad never writes it)
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)

    # without negate: the loss's Hessian, whose extremes are the objective's, swapped and negated
    raw = hessian_extremes(closure, params, steps=40, seed=0)
    assert raw.lambda_max == pytest.approx(-det.lambda_min, rel=1e-4)
    assert raw.lambda_min == pytest.approx(-det.lambda_max, rel=1e-4)

    # the same through the round-level helper (PPOLearner's closure is a loss: negate by default)
    via = detect_on_batch(learner, subset_size=400, steps=40, seed=0)
    whole = hessian_extremes(learner.objective(np.arange(400)), params, steps=40, seed=0, negate=True)
    assert via.ok and via.R == pytest.approx(whole.R, rel=1e-9)  # noqa: SIM300  .R is the attribute, not a constant


def test_default_steps_close_on_real_batch(monkeypatch):
    """At the default 20 steps the extremes are already close (Ritz values converge outside-in)."""
    policy = tiny_policy(monkeypatch, seed=1)
    obs, actions, logp_old, adv = real_hopper_batch(policy, seed=5)
    loss_of = lambda pol: surrogate(pol, obs, actions, logp_old, adv)  # noqa: E731
    lmax, lmin = exact_extremes(policy, loss_of)
    det = hessian_extremes(lambda: loss_of(policy), list(policy.parameters()), steps=20, seed=1)
    assert det.ok
    # Ritz values lie inside the spectrum
    assert lmin - 1e-5 * abs(lmin) <= det.lambda_min and det.lambda_max <= lmax + 1e-5 * abs(lmax)
    assert rel(det.lambda_max, lmax) < 2e-2 and rel(det.lambda_min, lmin) < 2e-2


def test_matches_exact_hessian_on_random_data(monkeypatch):
    policy = tiny_policy(monkeypatch, seed=2)
    gen = torch.Generator().manual_seed(7)
    obs = torch.randn(256, 11, generator=gen)
    actions = torch.randn(256, 3, generator=gen)
    adv = torch.randn(256, generator=gen)
    with torch.no_grad():
        logp_old = policy.distribution(obs).log_prob(actions) + 0.1 * torch.randn(256, generator=gen)
    loss_of = lambda pol: surrogate(pol, obs, actions, logp_old, adv)  # noqa: E731
    lmax, lmin = exact_extremes(policy, loss_of)
    det = hessian_extremes(lambda: loss_of(policy), list(policy.parameters()), steps=40, seed=3)
    assert det.ok
    assert rel(det.lambda_max, lmax) < 1e-3 and rel(det.lambda_min, lmin) < 1e-3, (det, lmax, lmin)


def test_seeded_and_clean(monkeypatch):
    policy = tiny_policy(monkeypatch)
    policy.train()
    obs = torch.randn(64, 11)
    actions = torch.randn(64, 3)
    adv = torch.randn(64)
    logp_old = policy.distribution(obs).log_prob(actions).detach()
    closure = lambda: surrogate(policy, obs, actions, logp_old, adv)  # noqa: E731
    rng_before = torch.random.get_rng_state()
    a = hessian_extremes(closure, list(policy.parameters()), steps=10, seed=11)
    b = hessian_extremes(closure, list(policy.parameters()), steps=10, seed=11)
    assert torch.equal(rng_before, torch.random.get_rng_state())  # global RNG untouched
    assert (a.lambda_max, a.lambda_min) == (b.lambda_max, b.lambda_min)
    assert all(p.grad is None for p in policy.parameters())
    assert policy.training

    # PyHessian path (benchmark only): shim works, and it cleans up after itself
    policy.eval()
    ph = pyhessian_extremes(closure, policy, steps=30, seed=0)
    ours = hessian_extremes(closure, list(policy.parameters()), steps=30, seed=0)
    assert ph.status == "ok", ph
    assert all(p.grad is None for p in policy.parameters())
    assert not policy.training
    with pytest.raises(RuntimeError):  # torch's own removed-function stub is back in place
        torch.eig(torch.eye(2))
    assert ph.lambda_max == pytest.approx(ours.lambda_max, rel=1e-2)
    assert ph.lambda_min == pytest.approx(ours.lambda_min, rel=1e-2)


# -- degenerate cases ------------------------------------------------------------------------


def test_classify_cases():
    assert classify(2.0, -1.0) == (2.0, "ok")
    assert classify(-1.0, -2.0) == (-0.5, "ok")  # concave everywhere: formula kept as written
    assert classify(3.0, 1.0) == (None, "lambda_min_nonnegative")
    assert classify(3.0, 0.0) == (None, "lambda_min_zero")
    assert classify(3.0, -1e-9) == (None, "lambda_min_zero")
    assert classify(0.0, 0.0) == (None, "lambda_min_zero")
    assert classify(float("nan"), -1.0) == (None, "nan")
    assert classify(float("inf"), -1.0) == (None, "nan")


def test_degenerate_losses_never_raise(caplog):
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    caplog.set_level(logging.INFO, logger="nitro.scaling.detector")

    convex = hessian_extremes(lambda: (x**2).sum(), [x])
    assert convex.status == "lambda_min_nonnegative" and convex.R is None
    assert convex.lambda_min == pytest.approx(2.0) and convex.lambda_max == pytest.approx(2.0)

    linear = hessian_extremes(lambda: (3 * x).sum(), [x])  # zero Hessian
    assert linear.status == "lambda_min_zero" and linear.R is None

    semidef = hessian_extremes(lambda: x[0] ** 2 - 0 * x[1:].sum(), [x], steps=5)  # eigenvalues {2, 0, ...}
    assert semidef.status == "lambda_min_zero"

    nan = hessian_extremes(lambda: (x**2).sum() * float("nan"), [x])
    assert nan.status == "nan" and nan.R is None

    inf_grad = hessian_extremes(lambda: torch.sqrt(x * 0).sum(), [x])  # d sqrt(0) = inf
    assert inf_grad.status == "nan"

    boom = hessian_extremes(lambda: 1 / 0, [x])
    assert boom.status == "error" and "ZeroDivisionError" in boom.message

    frozen = torch.randn(3)
    assert hessian_extremes(lambda: (frozen**2).sum(), [frozen]).status == "no_params"

    # y unused: left out of the Krylov space, not counted as a zero eigenvalue
    saddle = hessian_extremes(lambda: x[0] ** 2 - x[1] ** 2 + 0 * x[2:].sum(), [x, y])
    assert saddle.status in {"lambda_min_zero", "ok"}
    saddle2 = hessian_extremes(lambda: (x[:2] ** 2).sum() - 2 * x[2] ** 2 - (x[3:] ** 2).sum(), [x, y])
    assert saddle2.ok and saddle2.R == pytest.approx(0.5)  # noqa: SIM300  .R is the attribute, not a constant

    assert any("degenerate" in r.message for r in caplog.records)
    for det in (convex, linear, nan, boom):
        d = det.to_dict()
        assert set(d) >= {"lambda_max", "lambda_min", "R", "status", "seconds", "n_hvp"}


def test_invariant_subspace_stops_early():
    x = torch.randn(50, requires_grad=True)
    det = hessian_extremes(lambda: (x[:10] ** 2).sum() - 3 * (x[10:] ** 2).sum(), [x], steps=20)
    assert det.ok and det.R == pytest.approx(2 / 6)  # noqa: SIM300  .R is the attribute, not a constant
    assert det.n_hvp <= 3  # two distinct eigenvalues: the Krylov space has dimension 2


class _FakeLearner:
    def __init__(self, policy, obs, actions, logp_old, adv):
        self.policy, self.obs, self.actions, self.logp_old, self.adv = policy, obs, actions, logp_old, adv
        self.seen = None
        self.n = len(obs)

    def policy_parameters(self):
        return list(self.policy.parameters())

    def trained_samples(self):
        return self.n

    def objective(self, indices):
        self.seen = indices
        return lambda: -surrogate(self.policy, self.obs[indices], self.actions[indices],
                                  self.logp_old[indices], self.adv[indices])


def test_detect_on_batch_subset(monkeypatch):
    policy = tiny_policy(monkeypatch)
    obs, actions, adv = torch.randn(300, 11), torch.randn(300, 3), torch.randn(300)
    logp_old = policy.distribution(obs).log_prob(actions).detach()
    learner = _FakeLearner(policy, obs, actions, logp_old, adv)
    det = detect_on_batch(learner, subset_size=64, steps=10, seed=4)
    assert isinstance(det, Detection) and det.n_samples == 64
    assert len(learner.seen) == 64 and len(set(learner.seen.tolist())) == 64
    again = detect_on_batch(learner, subset_size=64, steps=10, seed=4)
    assert again.R == det.R
    whole = detect_on_batch(learner, subset_size=1000, steps=10, seed=4)
    assert whole.n_samples == 300
    learner.n = 0  # before the first update
    empty = detect_on_batch(learner, subset_size=64)
    assert empty.R is None
