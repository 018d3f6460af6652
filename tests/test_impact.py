"""IMPACT: V-trace and the losses against numbers worked out by hand, V-trace against a reference
double loop, the replay buffer's reuse limit, then the learner on real Hopper-v5 batches."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import Categorical

from nitro.actors.rollout import rollout
from nitro.config import ImpactConfig
from nitro.envs import env_spec
from nitro.learners import ImpactLearner, OffPolicyLearner
from nitro.learners.distributions import CategoricalParams, GaussianParams
from nitro.learners.impact_loss import (
    ImpactMinibatch,
    impact_loss,
    impact_surrogate,
    truncated_is_weight,
    vtrace_value_loss,
)
from nitro.learners.replay import ReplayBuffer
from nitro.learners.returns import compute_gae, vtrace_returns
from nitro.scaling.detector import detect_on_batch, hessian_extremes
from nitro.serialization import dumps_tensors, loads_tensors
from tests.support.specs import ATARI_SHAPED


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The learner's setting (NitroConfig.learner_threads): with 2 threads on a loaded machine an
    update was measured 40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# ----------------------------------------------------------------------------------------------
# V-trace, by hand
# ----------------------------------------------------------------------------------------------


def test_vtrace_by_hand_truncation_termination_bootstrap():
    # gamma = 0.5, rho_bar = c_bar = 1. pi/mu = [2, 0.5, 1, 0.5] -> rho = c = [1, 0.5, 1, 0.5]
    behaviour = np.log([0.5, 0.5, 0.5, 0.5])
    target = np.log([1.0, 0.25, 0.5, 0.25])
    rewards = np.array([1.0, 2.0, 3.0, 4.0])
    values = np.array([0.5, 1.0, 1.5, 2.0])
    next_values = np.array([1.0, 1.5, 99.0, 3.0])  # 99 after a termination must be ignored
    terminated = np.array([False, False, True, False])
    episode_end = np.array([False, False, True, True])  # t=3: bootstrap (truncation / end of rollout)
    out = vtrace_returns(behaviour, target, rewards, values, next_values, terminated, episode_end, gamma=0.5)
    # successors: [1, 1.5, 0 (terminated), 3]
    # delta = rho (r + 0.5 succ - V):
    #   t0: 1   * (1 + 0.5  - 0.5) = 1.0
    #   t1: 0.5 * (2 + 0.75 - 1.0) = 0.875
    #   t2: 1   * (3 + 0    - 1.5) = 1.5
    #   t3: 0.5 * (4 + 1.5  - 2.0) = 1.75
    # v - V backwards, cut at t2 and t3:
    #   t3: 1.75 ; t2: 1.5 ; t1: 0.875 + 0.5*c1*1.5 = 0.875 + 0.5*0.5*1.5 = 1.25 ; t0: 1.0 + 0.5*1*1.25 = 1.625
    # vs = V + [1.625, 1.25, 1.5, 1.75] = [2.125, 2.25, 3.0, 3.75]
    np.testing.assert_allclose(out.vs, [2.125, 2.25, 3.0, 3.75])
    # successor targets: v1 = 2.25, v2 = 3.0, 0 (terminated), 3.0 (bootstrap value, the chain is cut)
    # q = r + 0.5 * succ = [1 + 1.125, 2 + 1.5, 3 + 0, 4 + 1.5] = [2.125, 3.5, 3.0, 5.5]
    np.testing.assert_allclose(out.q, [2.125, 3.5, 3.0, 5.5])
    np.testing.assert_allclose(out.rho, [1.0, 0.5, 1.0, 0.5])
    # pg = rho (q - V) = [1*1.625, 0.5*2.5, 1*1.5, 0.5*3.5] = [1.625, 1.25, 1.5, 1.75]
    np.testing.assert_allclose(out.pg_advantages, [1.625, 1.25, 1.5, 1.75])


def test_vtrace_rho_bar_and_c_bar_differ_and_torch_input():
    # gamma = 1, one episode of 2 steps, pi/mu = [3, 3]; rho_bar = 2, c_bar = 0.5 -> rho = [2, 2], c = [0.5, 0.5]
    lr = torch.log(torch.tensor([3.0, 3.0]))
    rewards, values = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])
    next_values = torch.tensor([0.0, 4.0])
    term, end = torch.tensor([False, False]), torch.tensor([False, True])
    vs, _, _, pg = vtrace_returns(torch.zeros(2), lr, rewards, values, next_values, term, end, gamma=1.0,
                                  rho_bar=2.0, c_bar=0.5)
    # delta = 2 * [1 + 0 - 0, 1 + 4 - 0] = [2, 10]; v1 - V1 = 10; v0 - V0 = 2 + 1*0.5*10 = 7
    assert isinstance(vs, torch.Tensor)
    torch.testing.assert_close(vs, torch.tensor([7.0, 10.0], dtype=torch.float64))
    # q0 = 1 + v1 = 11, q1 = 1 + 4 = 5; pg = 2 * (q - 0) = [22, 10]
    torch.testing.assert_close(pg, torch.tensor([22.0, 10.0], dtype=torch.float64))


def _vtrace_reference(mu, pi, r, v, nv, term, end, gamma, rho_bar, c_bar):
    """The definition, literally: v_s = V(x_s) + sum_{t=s}^{e(s)} gamma^(t-s) (prod_{i=s}^{t-1} c_i) delta_t."""
    T = len(r)
    rho = [min(rho_bar, math.exp(pi[t] - mu[t])) for t in range(T)]
    c = [min(c_bar, math.exp(pi[t] - mu[t])) for t in range(T)]
    succ = [0.0 if term[t] else nv[t] for t in range(T)]
    delta = [rho[t] * (r[t] + gamma * succ[t] - v[t]) for t in range(T)]
    vs = []
    for s in range(T):
        e = s
        while not (end[e] or term[e]) and e < T - 1:
            e += 1
        total, cprod = 0.0, 1.0
        for t in range(s, e + 1):
            total += gamma ** (t - s) * cprod * delta[t]
            cprod *= c[t]
        vs.append(v[s] + total)
    pg = []
    for s in range(T):
        nxt = 0.0 if term[s] else (nv[s] if (end[s] or s == T - 1) else vs[s + 1])
        pg.append(rho[s] * (r[s] + gamma * nxt - v[s]))
    return np.array(vs), np.array(pg)


@pytest.mark.parametrize("seed", range(5))
def test_vtrace_matches_reference_loop(seed):
    rng = np.random.default_rng(seed)
    T = 40
    mu = rng.normal(-1.0, 0.5, T)
    pi = mu + rng.normal(0.0, 0.7, T)  # ratios on both sides of the truncation levels
    r, v, nv = rng.normal(size=T), rng.normal(size=T), rng.normal(size=T)
    term = rng.random(T) < 0.1
    end = term | (rng.random(T) < 0.1)
    end[-1] = True
    for rho_bar, c_bar in ((1.0, 1.0), (1.5, 0.8)):
        vs, _, _, pg = vtrace_returns(mu, pi, r, v, nv, term, end, gamma=0.97, rho_bar=rho_bar, c_bar=c_bar)
        ref_vs, ref_pg = _vtrace_reference(mu, pi, r, v, nv, term, end, 0.97, rho_bar, c_bar)
        np.testing.assert_allclose(vs, ref_vs, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(pg, ref_pg, rtol=1e-10, atol=1e-10)


def test_vtrace_on_policy_equals_gae_lambda_one():
    # pi = mu: rho = c = 1, so v_s is the lambda=1 return and q - V the GAE(lambda=1) advantage.
    rng = np.random.default_rng(3)
    T = 30
    logp = rng.normal(size=T)
    r, v, nv = rng.normal(size=T), rng.normal(size=T), rng.normal(size=T)
    term = rng.random(T) < 0.15
    end = term | (rng.random(T) < 0.1)
    end[-1] = True
    nv[:-1] = np.where(end[:-1], nv[:-1], v[1:])  # inside an episode the successor is the next step
    out = vtrace_returns(logp, logp, r, v, nv, term, end, gamma=0.9)
    adv, ret = compute_gae(r, v, nv, term, end, gamma=0.9, lam=1.0)
    np.testing.assert_allclose(out.vs, ret, atol=1e-12)
    np.testing.assert_allclose(out.pg_advantages, adv, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# The losses, by hand
# ----------------------------------------------------------------------------------------------


def test_impact_surrogate_by_hand():
    logp_b = torch.log(torch.tensor([0.5, 0.5, 0.25, 0.5]))
    logp_t = torch.log(torch.tensor([0.5, 0.25, 0.5, 0.5]))
    # pi_target/mu = [1, 0.5, 2, 1] -> w = min(1, .) = [1, 0.5, 1, 1]
    torch.testing.assert_close(truncated_is_weight(logp_t, logp_b), torch.tensor([1.0, 0.5, 1.0, 1.0]))
    ratios = torch.tensor([1.5, 0.5, 1.2, 0.7])  # pi_new / pi_target
    logp_new = logp_t + torch.log(ratios)
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0])
    loss = impact_surrogate(logp_new, logp_t, logp_b, adv, clip=0.2)
    # clipped ratios [1.2, 0.8, 1.2, 0.8]
    # t0: 1   * min(1.5, 1.2)        =  1.2
    # t1: 0.5 * min(0.5, 0.8)        =  0.25
    # t2: 1   * min(-1.2, -1.2)      = -1.2
    # t3: 1   * min(-1.4, 0.8*-2)    = -1.6
    # mean = (1.2 + 0.25 - 1.2 - 1.6)/4 = -1.35/4 = -0.3375 -> loss 0.3375
    assert float(loss) == pytest.approx(0.3375, abs=1e-6)
    # rho_bar = 2 lets t2's weight through: t2 becomes 2 * -1.2 = -2.4 -> mean (1.2+0.25-2.4-1.6)/4 = -0.6375
    assert float(impact_surrogate(logp_new, logp_t, logp_b, adv, clip=0.2, rho_bar=2.0)) == pytest.approx(
        0.6375, abs=1e-6
    )


def test_impact_surrogate_gradient_at_target_is_vtrace_policy_gradient():
    # At theta = target (ratio 1), d loss / d logp_new_i = -w_i A_i / N: the V-trace policy gradient.
    logp_b = torch.log(torch.tensor([0.5, 0.5, 0.25]))
    logp_t = torch.log(torch.tensor([0.5, 0.25, 0.5]))
    adv = torch.tensor([2.0, -1.0, 3.0])
    logp_new = logp_t.clone().requires_grad_(True)
    impact_surrogate(logp_new, logp_t, logp_b, adv, clip=0.4).backward()
    # w = [1, 0.5, 1] -> grad = -[2, -0.5, 3]/3
    torch.testing.assert_close(logp_new.grad, -torch.tensor([2.0, -0.5, 3.0]) / 3)


def test_vtrace_value_loss_by_hand():
    # (1-2)^2 = 1, (3-0)^2 = 9, (3-3)^2 = 0 -> mean 10/3
    assert float(vtrace_value_loss(torch.tensor([1.0, 3.0, 3.0]), torch.tensor([2.0, 0.0, 3.0]))) == pytest.approx(
        10 / 3
    )


def test_impact_loss_combines_terms_by_hand():
    target = Categorical(probs=torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    new = Categorical(probs=torch.tensor([[0.25, 0.75], [0.25, 0.75]]))
    actions = torch.tensor([1, 0])
    logp_t = torch.log(torch.tensor([0.5, 0.5]))
    logp_b = torch.log(torch.tensor([0.25, 1.0]))  # pi_target/mu = [2, 0.5] -> w = [1, 0.5]
    adv = torch.tensor([1.0, -1.0])
    mb = ImpactMinibatch(obs=torch.zeros(2, 1), actions=actions, logp_target=logp_t, logp_behaviour=logp_b,
                         advantages=adv, vs=torch.tensor([2.0, 0.0]), anchor=target)
    total, terms = impact_loss(new, torch.tensor([1.0, 3.0]), mb,
                               clip=0.2, rho_bar=1.0, kl_coef=0.5, vf_coef=0.25, entropy_coef=0.1)
    # ratios vs target: a=1: 0.75/0.5 = 1.5 ; a=0: 0.25/0.5 = 0.5
    # surrogate: 1 * min(1.5, 1.2) = 1.2 ; 0.5 * min(-0.5, -0.8) = -0.4 -> mean 0.4 -> loss -0.4
    # KL(target || new) per state = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3) = 0.143841
    # VF = mean((1-2)^2, (3-0)^2) = 5 ; H(new) = 0.562335
    # total = -0.4 + 0.5*0.143841 + 0.25*5 - 0.1*0.562335 = -0.4 + 0.0719205 + 1.25 - 0.0562335 = 0.865687
    assert float(terms["policy_loss"]) == pytest.approx(-0.4, abs=1e-6)
    assert float(terms["kl"]) == pytest.approx(0.143841, abs=1e-6)
    assert float(terms["vf_loss"]) == pytest.approx(5.0, abs=1e-6)
    assert float(terms["entropy"]) == pytest.approx(0.562335, abs=1e-6)
    assert float(terms["clip_frac"]) == pytest.approx(1.0)
    assert float(total) == pytest.approx(0.865687, abs=1e-5)


# ----------------------------------------------------------------------------------------------
# The replay buffer
# ----------------------------------------------------------------------------------------------


def _b(i: int) -> dict[str, np.ndarray]:
    return {"rewards": np.array([float(i)])}


def _ids(batches) -> list[int]:
    return [int(b["rewards"][0]) for b in batches]


def test_replay_buffer_round_robin_and_eviction_after_k_uses():
    buf = ReplayBuffer(capacity=4, max_reuse=3)
    for i in range(3):
        buf.add(_b(i), uses=1)  # as the learner adds them: the arrival update is the first use
    assert _ids(buf.take(2)) == [0, 1]  # uses: 0->2, 1->2, 2->1
    assert _ids(buf.take(2)) == [2, 0]  # round-robin; 0 reaches 3 and is evicted
    assert buf.uses() == [(1, 2), (2, 2)]
    assert _ids(buf.take(5)) == [1, 2]  # at most once per call; both reach 3
    assert len(buf) == 0 and buf.take(2) == []
    assert (buf.n_replays, buf.n_exhausted, buf.n_added) == (6, 3, 3)


def test_replay_buffer_capacity_overwrites_oldest_and_k1_stores_nothing():
    buf = ReplayBuffer(capacity=2, max_reuse=2)
    for i in range(3):
        buf.add(_b(i), uses=1)
    assert [s for s, _ in buf.uses()] == [1, 2] and buf.n_dropped == 1
    once = ReplayBuffer(capacity=2, max_reuse=1)
    once.add(_b(0), uses=1)
    assert len(once) == 0 and once.take(1) == []


def test_replay_buffer_never_exceeds_k_uses():
    rng = np.random.default_rng(0)
    K = 3
    buf = ReplayBuffer(capacity=5, max_reuse=K)
    uses: dict[int, int] = {}
    for i in range(200):
        if rng.random() < 0.4:
            buf.add(_b(i), uses=1)
            uses[i] = 1
        for j in _ids(buf.take(int(rng.integers(0, 4)))):
            uses[j] += 1
    assert max(uses.values()) <= K
    assert sum(uses.values()) == len(uses) + buf.n_replays


# ----------------------------------------------------------------------------------------------
# The learner on real Hopper-v5 batches
# ----------------------------------------------------------------------------------------------

ENV = "Hopper-v5"
CFG = ImpactConfig(minibatch_size=128)


def _publish(learner: ImpactLearner) -> bytes:
    return dumps_tensors(learner.weights(), {"format": "nitro.policy/1", "env_id": ENV, "version": 0})


@pytest.fixture(scope="module")
def hopper_batches():
    """Two rounds of two 256-step batches from the seed-0 learner's published initial weights."""
    w = _publish(ImpactLearner(env_spec(ENV), CFG, seed=0))
    round1 = [rollout(w, ENV, seed=s, n_steps=256).batch for s in (1, 2)]
    round2 = [rollout(w, ENV, seed=s, n_steps=256).batch for s in (3, 4)]
    assert any(b["terminated"].any() for b in round1 + round2)
    return round1, round2


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_update_changes_weights_and_replays_then_runs_dry(hopper_batches):
    round1, round2 = hopper_batches
    learner = ImpactLearner(env_spec(ENV), CFG, seed=0)
    p0, c0 = _flat(learner.policy), _flat(learner.critic)
    assert isinstance(learner, OffPolicyLearner) and learner.name == "impact"
    m1 = learner.update(round1).diagnostics
    assert not torch.equal(p0, _flat(learner.policy)) and not torch.equal(c0, _flat(learner.critic))
    assert torch.equal(_flat(learner.target), p0)  # target = the pre-update policy (freq 1)
    for key in ("policy_loss", "vf_loss", "kl", "entropy", "kl_coef", "clip_frac", "explained_variance",
                "n_samples", "seconds", "grad_noise_scale", "grad_noise_tr_sigma", "is_weight_mean"):
        assert isinstance(m1[key], float), key
    assert m1["n_samples"] == 512 and m1["n_replay_batches"] == 0 and m1["kl"] > 0
    assert m1["action_std"] == pytest.approx(float(learner.policy.log_std.exp().mean()))
    assert m1["logp_drift"] < 1e-4  # fresh data, target = behaviour: every weight is 1
    assert m1["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # round 2: the two new batches plus round 1's two, replayed once (their second and last use)
    m2 = learner.update(round2).diagnostics
    assert (m2["n_new_samples"], m2["n_replay_samples"], m2["n_replay_batches"]) == (512, 512, 2)
    assert m2["logp_drift_replay"] > 0 and m2["is_weight_mean"] < 1.0  # stale data is down-weighted
    assert learner.replay.uses() == [(2, 1), (3, 1)]  # round 1 evicted after K=2 uses
    r3 = learner.replay_update()  # the cache is empty: replay round 2
    assert r3 is not None and (r3.diagnostics["n_new_samples"], r3.diagnostics["n_replay_samples"]) == (0, 512)
    assert r3.sgd_steps == r3.diagnostics["sgd_steps"] > 0 and not r3.cut_short
    assert learner.replay_update() is None  # every batch used K times
    # the normaliser saw each NEW observation once (replays are not merged again)
    assert float(learner.policy.obs_norm.count) == pytest.approx(1024, abs=1e-3)
    assert learner.n_updates == 3 and learner.n_target_updates == 3


def test_update_is_deterministic(hopper_batches):
    round1, round2 = hopper_batches
    runs = []
    for _ in range(2):
        learner = ImpactLearner(env_spec(ENV), CFG, seed=0)
        ms = [r.diagnostics for r in (learner.update(round1), learner.update(round2), learner.replay_update())]
        runs.append((_flat(learner.policy), _flat(learner.critic), ms))
    (p1, c1, a), (p2, c2, b) = runs
    assert torch.equal(p1, p2) and torch.equal(c1, c2)
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k != "seconds"} == pytest.approx(
            {k: v for k, v in y.items() if k != "seconds"}, nan_ok=True)


def test_a_deadline_in_the_past_cuts_updates_and_replays_short(hopper_batches):
    round1, _ = hopper_batches
    learner = ImpactLearner(env_spec(ENV), CFG, seed=0)
    p0 = _flat(learner.policy)
    result = learner.update(round1, deadline=time.perf_counter() - 1.0)
    assert result.cut_short and result.sgd_steps == 0 and not result.took_no_step
    assert torch.equal(p0, _flat(learner.policy))
    replay = learner.replay_update(deadline=time.perf_counter() - 1.0)  # round 1's two batches, second use
    assert replay is not None and replay.cut_short and replay.sgd_steps == 0
    assert replay.diagnostics["n_replay_batches"] == 2 and replay.diagnostics["update_cut_short"] == 1.0


def test_state_round_trip_with_target_and_replay(hopper_batches, monkeypatch):
    round1, round2 = hopper_batches
    a = ImpactLearner(env_spec(ENV), CFG, seed=0)
    a.update(round1)
    tensors, meta = a.state_dict()
    assert any(k.startswith("target.") for k in tensors) and any(k.startswith("replay.") for k in tensors)
    arrays, meta_str = loads_tensors(dumps_tensors(tensors, meta))  # data only
    b = ImpactLearner(env_spec(ENV), CFG, seed=7)
    b.load_state_dict(arrays, meta_str)
    assert torch.equal(_flat(a.target), _flat(b.target)) and b.replay.uses() == a.replay.uses()
    assert (b.kl_coef, b.n_updates, b.seed, b.reward_stats.var) == (a.kl_coef, a.n_updates, a.seed, a.reward_stats.var)
    ma, mb = a.update(round2).diagnostics, b.update(round2).diagnostics  # replays round 1 on both sides
    assert ma["n_replay_batches"] == mb["n_replay_batches"] == 2
    assert torch.equal(_flat(a.policy), _flat(b.policy)) and torch.equal(_flat(a.critic), _flat(b.critic))
    assert ma["policy_loss"] == mb["policy_loss"]
    assert set(a.weights()) == set(a.policy.state_dict()) and "obs_norm.mean" in a.weights()

    # Above the size limit the batches are dropped; the bookkeeping says what was lost.
    monkeypatch.setattr(a.cfg, "replay_checkpoint_max_bytes", 0)
    tensors, meta = a.state_dict()
    assert not any(k.startswith("replay.") for k in tensors) and meta["replay_batches_included"] is False
    c = ImpactLearner(env_spec(ENV), CFG, seed=0)
    c.load_state_dict(*loads_tensors(dumps_tensors(tensors, meta)))
    assert len(c.replay) == 0 and c.replay_dropped_on_load == 2  # two batches with one use left each
    assert c.replay.n_added == a.replay.n_added and c.replay_update() is None


def test_objective_gives_finite_hessian(hopper_batches):
    round1, _ = hopper_batches
    learner = ImpactLearner(env_spec(ENV), CFG, seed=0)
    learner.update(round1)
    data = learner.trained_batch
    assert {"rewards", "obs", "actions", "logp", "advantages", "anchor", "target_logp", "vs"} <= set(data._fields)
    assert isinstance(data.anchor, GaussianParams) and data.anchor.loc.shape == data.anchor.scale.shape == (512, 3)
    params = learner.policy_parameters()
    det = hessian_extremes(learner.objective(np.arange(0, 512, 2)), params, steps=8, negate=True)
    assert det.lambda_max is not None and math.isfinite(det.lambda_max) and math.isfinite(det.lambda_min)
    assert det.lambda_max >= det.lambda_min
    assert learner.trained_samples() == len(data.rewards)
    assert detect_on_batch(learner, subset_size=128, steps=6).status in (
        "ok", "lambda_min_nonnegative", "lambda_min_zero")
    assert all(p.grad is None for p in params)


def test_categorical_atari_shaped_smoke():
    spec = ATARI_SHAPED
    learner = ImpactLearner(spec, ImpactConfig(minibatch_size=8), seed=0)
    rng = np.random.default_rng(0)

    def batch(T: int) -> dict[str, np.ndarray]:
        obs = rng.integers(0, 256, size=(T, 4, 84, 84), dtype=np.uint8)
        actions, logp = np.empty(T, np.int64), np.empty(T, np.float32)
        for t in range(T):
            actions[t], logp[t] = learner.policy.sample(obs[t], rng)
        return {
            "obs": obs, "actions": actions, "logp": logp,
            "rewards": rng.choice([0.0, 25.0, -5.0], size=T).astype(np.float32),
            "terminated": np.zeros(T, bool), "bootstrap_idx": np.array([T - 1]),
            "bootstrap_obs": rng.integers(0, 256, size=(1, 4, 84, 84), dtype=np.uint8),
        }

    m1 = learner.update([batch(16)]).diagnostics
    assert set(np.unique(learner.trained_batch.rewards.numpy())) <= {-1.0, 0.0, 1.0}  # sign-clipped
    anchor = learner.trained_batch.anchor
    assert isinstance(anchor, CategoricalParams) and anchor.logits.shape == (16, 6) and m1["logp_drift"] < 1e-4
    m2 = learner.update([batch(16)]).diagnostics
    assert m2["n_samples"] == 32 and m2["n_replay_batches"] == 1 and math.isfinite(m2["loss"])
