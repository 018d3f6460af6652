"""PPO: every pure function against numbers worked out by hand, then the learner on real Hopper data."""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import Categorical, Independent, Normal

from nitro.config import PPOConfig
from nitro.envs import EnvSpec, env_spec, make_env
from nitro.learners import Learner, PPOLearner, Progress
from nitro.learners.distributions import CategoricalParams
from nitro.learners.objective import adapt_kl_coef, entropy_bonus, kl_penalty
from nitro.learners.ppo_loss import (
    PPOMinibatch,
    clipped_surrogate,
    ppo_loss,
    ppo_objective,
    prepare_batches,
    value_loss,
)
from nitro.learners.returns import compute_gae
from nitro.learners.sgd import annealed_lr, minibatch_count, minibatch_indices, noise_scale_from_norms
from nitro.learners.statistics import action_std, discounted_return_trace, explained_variance, training_rewards
from nitro.models import Architecture
from nitro.models.networks import Policy
from nitro.serialization import dumps_tensors, loads_tensors
from tests.support.specs import ATARI_SHAPED

LN2 = math.log(2.0)

# ----------------------------------------------------------------------------------------------
# Pure functions, hand-computed
# ----------------------------------------------------------------------------------------------


def test_gae_by_hand_terminated_and_bootstrap():
    # gamma = lam = 0.5, so gamma*lam = 0.25.
    rewards = np.array([1.0, 2.0, 3.0, 4.0])
    values = np.array([0.5, 1.0, 1.5, 2.0])
    next_values = np.array([1.0, 1.5, 99.0, 3.0])  # 99 at a terminated step must be ignored
    terminated = np.array([False, False, True, False])
    episode_end = np.array([False, False, True, True])  # t=3 is a bootstrap point
    adv, ret = compute_gae(rewards, values, next_values, terminated, episode_end, gamma=0.5, lam=0.5)
    # delta3 = 4 + 0.5*3.0 - 2.0 = 3.5          A3 = 3.5               (end of the sequence)
    # delta2 = 3 + 0 (terminated) - 1.5 = 1.5    A2 = 1.5               (chain cut at t=2)
    # delta1 = 2 + 0.5*1.5 - 1.0 = 1.75          A1 = 1.75 + 0.25*1.5   = 2.125
    # delta0 = 1 + 0.5*1.0 - 0.5 = 1.0           A0 = 1.0 + 0.25*2.125  = 1.53125
    np.testing.assert_allclose(adv, [1.53125, 2.125, 1.5, 3.5])
    # returns = A + V = [1.53125+0.5, 2.125+1.0, 1.5+1.5, 3.5+2.0]
    np.testing.assert_allclose(ret, [2.03125, 3.125, 3.0, 5.5])


def test_gae_truncation_cuts_chain_but_bootstraps_and_accepts_torch():
    # gamma = 1, lam = 1: A_t is the plain sum of deltas within an episode.
    rewards = torch.tensor([1.0, 1.0, 1.0])
    values = torch.tensor([0.0, 0.0, 0.0])
    next_values = torch.tensor([0.0, 10.0, 5.0])
    terminated = torch.tensor([False, False, False])
    episode_end = torch.tensor([False, True, True])  # t=1 truncated (time limit), t=2 end of rollout
    adv, ret = compute_gae(rewards, values, next_values, terminated, episode_end, gamma=1.0, lam=1.0)
    # delta = [1+0-0, 1+10-0, 1+5-0] = [1, 11, 6]
    # A2 = 6; A1 = 11 (cut, the 6 belongs to the next episode); A0 = 1 + 11 = 12
    assert isinstance(adv, torch.Tensor)
    torch.testing.assert_close(adv, torch.tensor([12.0, 11.0, 6.0], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([12.0, 11.0, 6.0], dtype=torch.float64))


def test_clipped_surrogate_by_hand():
    logp_old = torch.zeros(4)
    logp_new = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.1]))  # ratios
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0])
    loss = clipped_surrogate(logp_new, logp_old, adv, clip=0.2)
    # clipped ratios [1.2, 0.8, 0.8, 1.1]
    # t0: min(1.5*1, 1.2*1) = 1.2     t1: min(0.5*1, 0.8*1) = 0.5
    # t2: min(0.5*-1, 0.8*-1) = -0.8  t3: min(1.1*-2, 1.1*-2) = -2.2
    # mean = (1.2 + 0.5 - 0.8 - 2.2)/4 = -1.3/4 = -0.325 -> loss 0.325
    assert float(loss) == pytest.approx(0.325, abs=1e-6)


def test_action_std_is_the_gaussians_mean_std_and_absent_for_a_categorical_policy():
    gaussian = Policy(env_spec("Hopper-v5"), Architecture(hidden=(8,), log_std_init=-1.0))
    with torch.no_grad():
        gaussian.log_std[0] = 0.0
    want = (1.0 + 2 * math.exp(-1.0)) / 3  # Hopper's three action dimensions
    assert action_std(gaussian) == {"action_std": pytest.approx(want)}
    assert action_std(Policy(env_spec("CartPole-v1"), Architecture(hidden=(8,)))) == {}


def test_kl_penalty_gaussian_and_categorical_by_hand():
    old = Independent(Normal(torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])), 1)
    new = Independent(Normal(torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 1.0]])), 1)
    # dim 0: ln(2/1) + (1 + (0-1)^2)/(2*4) - 1/2 = 0.693147 + 0.25 - 0.5 = 0.443147; dim 1: 0
    assert float(kl_penalty(old, new)) == pytest.approx(LN2 - 0.25, abs=1e-6)
    old_c = Categorical(probs=torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    new_c = Categorical(probs=torch.tensor([[0.25, 0.75], [0.5, 0.5]]))
    # state 0: 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3) = 0.143841; state 1: 0
    # mean over the two states = 0.0719205
    assert float(kl_penalty(old_c, new_c)) == pytest.approx(0.5 * math.log(4 / 3) / 2, abs=1e-6)
    assert float(kl_penalty(old_c, new_c)) == pytest.approx(0.0719205, abs=1e-6)


def test_adapt_kl_coef_rllib_rule():
    assert adapt_kl_coef(0.2, kl=0.03, kl_target=0.01) == pytest.approx(0.3)  # 0.03 > 0.02: x1.5
    assert adapt_kl_coef(0.2, kl=0.004, kl_target=0.01) == pytest.approx(0.1)  # 0.004 < 0.005: x0.5
    assert adapt_kl_coef(0.2, kl=0.01, kl_target=0.01) == 0.2  # in the band: unchanged
    assert adapt_kl_coef(0.2, kl=0.02, kl_target=0.01) == 0.2  # exactly 2x target: not above
    assert adapt_kl_coef(0.2, kl=0.005, kl_target=0.01) == 0.2  # exactly 0.5x target: not below


def test_annealed_lr_by_hand():
    # 5 rounds = 4 updates (rounds 1-4): 3e-4 x (1, 3/4, 2/4, 1/4), then the 1/4 floor past the end
    assert [annealed_lr(3e-4, k, rounds=5) for k in range(1, 7)] == pytest.approx(
        [3e-4, 2.25e-4, 1.5e-4, 0.75e-4, 0.75e-4, 0.75e-4])
    assert annealed_lr(3e-4, 1, rounds=1) == pytest.approx(3e-4)  # no update is planned: no decay either


def test_value_loss_by_hand():
    values = torch.tensor([1.0, 3.0, 3.0])
    returns = torch.tensor([2.0, 0.0, 3.0])
    old_values = torch.zeros(3)
    # clipped V = old + clamp(V - old, -2, 2) = [1, 2, 2]
    # unclipped sq: (1-2)^2=1, (3-0)^2=9, (3-3)^2=0 ; clipped sq: (1-2)^2=1, (2-0)^2=4, (2-3)^2=1
    # max: [1, 9, 1] -> mean 11/3
    assert float(value_loss(values, returns, old_values, vf_clip=2.0)) == pytest.approx(11 / 3, abs=1e-6)


def test_entropy_bonus_by_hand():
    # uniform over 4 actions: ln 4 = 1.386294
    assert float(entropy_bonus(Categorical(logits=torch.zeros(3, 4)))) == pytest.approx(1.386294, abs=1e-6)
    # N(0, 1): 0.5 * ln(2*pi*e) = 1.418939
    g = Independent(Normal(torch.zeros(2, 1), torch.ones(2, 1)), 1)
    assert float(entropy_bonus(g)) == pytest.approx(1.418939, abs=1e-6)


def test_ppo_loss_combines_terms_by_hand():
    old = Categorical(probs=torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    new = Categorical(probs=torch.tensor([[0.25, 0.75], [0.25, 0.75]]))
    actions = torch.tensor([1, 0])
    logp_old = torch.log(torch.tensor([0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0])
    mb = PPOMinibatch(obs=torch.zeros(2, 1), actions=actions, logp_old=logp_old, advantages=adv,
                      returns=torch.tensor([2.0, 0.0]), old_values=torch.zeros(2), anchor=old)
    total, terms = ppo_loss(new, torch.tensor([1.0, 3.0]), mb,
                            clip=0.2, kl_coef=0.5, vf_clip=2.0, vf_coef=0.25, entropy_coef=0.1)
    # ratios: a=1: 0.75/0.5 = 1.5 ; a=0: 0.25/0.5 = 0.5
    # surrogate terms: min(1.5, 1.2) = 1.2 ; min(-0.5, -0.8) = -0.8 -> mean 0.2 -> loss -0.2
    # KL per state 0.5 ln(4/3) = 0.143841 (both states)
    # VF: unclipped [1, 9], clipped V [1, 2] -> [1, 4]; max [1, 9] -> 5
    # H(new) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    # total = -0.2 + 0.5*0.143841 + 0.25*5 - 0.1*0.562335 = -0.2 + 0.0719205 + 1.25 - 0.0562335 = 1.065687
    assert float(terms["policy_loss"]) == pytest.approx(-0.2, abs=1e-6)
    assert float(terms["kl"]) == pytest.approx(0.143841, abs=1e-6)
    assert float(terms["vf_loss"]) == pytest.approx(5.0, abs=1e-6)
    assert float(terms["entropy"]) == pytest.approx(0.562335, abs=1e-6)
    assert float(terms["clip_frac"]) == pytest.approx(1.0)  # |1.5-1| and |0.5-1| both exceed 0.2
    assert float(total) == pytest.approx(1.065687, abs=1e-5)


def test_noise_scale_by_hand():
    # Suppose |G|^2 = 1 and tr(Sigma) = 64. Then E|g_32|^2 = 1 + 64/32 = 3, E|g_128|^2 = 1 + 64/128 = 1.5.
    # |G|^2 est = (128*1.5 - 32*3)/(128-32) = 96/96 = 1 ; tr est = (3-1.5)/(1/32-1/128) = 1.5/(3/128) = 64
    tr, g_sq, b = noise_scale_from_norms(3.0, 1.5, 32, 128)
    assert (tr, g_sq, b) == pytest.approx((64.0, 1.0, 64.0))
    # |G|^2 est = (128*0.5 - 32*3)/96 = -1/3 <= 0: undefined
    assert math.isnan(noise_scale_from_norms(3.0, 0.5, 32, 128)[2])
    # tr est = (1-2)/(3/128) < 0: undefined
    assert math.isnan(noise_scale_from_norms(1.0, 2.0, 32, 128)[2])


def test_discounted_return_trace_and_reward_transform_by_hand():
    # gamma 0.5: R0 = 1; R1 = 0.5*1 + 1 = 1.5 (episode ends) ; R2 = 1 ; R3 = 0.5*1 + 1 = 1.5
    got = discounted_return_trace(np.ones(4), np.array([False, True, False, False]), 0.5)
    np.testing.assert_allclose(got, [1.0, 1.5, 1.0, 1.5])
    # Atari: sign, then scale 0.5: [-3, 0, 0.5] -> [-1, 0, 1] -> [-0.5, 0, 0.5]
    np.testing.assert_allclose(training_rewards(np.array([-3.0, 0.0, 0.5]), True, 0.5), [-0.5, 0.0, 0.5])
    np.testing.assert_allclose(training_rewards(np.array([-3.0, 0.0, 0.5]), False, 0.5), [-1.5, 0.0, 0.25])


def test_explained_variance_by_hand():
    # returns [1,2,3] (var 2/3), values [1,2,2]: residual [0,0,1] (var 2/9) -> 1 - (2/9)/(2/3) = 2/3
    assert explained_variance(np.array([1.0, 2.0, 2.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------------------------
# prepare_batches on a hand-made batch (V(s) = s, identity normaliser)
# ----------------------------------------------------------------------------------------------

TINY = EnvSpec("Tiny", "mujoco", (1,), "float32", True, 1, None)


class IdentityCritic(nn.Module):
    reads_trunk = False  # a critic of its own (networks.Critic's attribute)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features[:, 0]


def _tiny_batch(obs, rewards, terminated, boot_idx, boot_obs):
    T = len(obs)
    return {
        "obs": np.asarray(obs, np.float32).reshape(T, 1),
        "actions": np.zeros((T, 1), np.float32),
        "logp": np.zeros(T, np.float32),
        "rewards": np.asarray(rewards, np.float32),
        "terminated": np.asarray(terminated, bool),
        "bootstrap_idx": np.asarray(boot_idx, np.int64),
        "bootstrap_obs": np.asarray(boot_obs, np.float32).reshape(-1, 1),
    }


def test_prepare_batches_terminated_vs_truncated_by_hand():
    policy = Policy(TINY)  # fresh normaliser: mean 0, var 1 -> features = obs, so V(s) = s
    # Batch A: truncation in the middle (t=1) and a bootstrap at the end (t=3).
    a = _tiny_batch([1, 2, 3, 4], [1, 1, 1, 1], [0, 0, 0, 0], [1, 3], [7, 9])
    # Batch B: terminated at t=1, bootstrapped end; must not chain into A.
    b = _tiny_batch([5, 6, 8], [2, 2, 2], [0, 1, 0], [2], [1])
    out = prepare_batches([a, b], policy, IdentityCritic(), gamma=0.5, lam=1.0, reward_scale=1.0)
    # A: V = [1,2,3,4]; successors: V(obs1)=2, V(boot)=7, V(obs3)=4, V(boot)=9
    #    delta = [1+1-1, 1+3.5-2, 1+2-3, 1+4.5-4] = [1, 2.5, 0, 1.5]; ends at t=1, t=3
    #    A3 = 1.5 ; A2 = 0 + 0.5*1.5 = 0.75 ; A1 = 2.5 ; A0 = 1 + 0.5*2.5 = 2.25
    # B: V = [5,6,8]; successors: V(obs1)=6, 0 (terminated), V(boot)=1
    #    delta = [2+3-5, 2+0-6, 2+0.5-8] = [0, -4, -5.5]; ends at t=1, t=2
    #    A2 = -5.5 ; A1 = -4 ; A0 = 0 + 0.5*(-4) = -2
    np.testing.assert_allclose(out.advantages.numpy(), [2.25, 2.5, 0.75, 1.5, -2.0, -4.0, -5.5], atol=1e-6)
    # returns = A + V
    np.testing.assert_allclose(out.returns.numpy(), [3.25, 4.5, 3.75, 5.5, 3.0, 2.0, 2.5], atol=1e-6)
    np.testing.assert_allclose(out.values.numpy(), [1, 2, 3, 4, 5, 6, 8], atol=1e-6)
    assert out.obs.shape == (7, 1) and out.anchor.loc.shape == (7, 1) and out.anchor.scale.shape == (7, 1)

    # reward_scale multiplies the rewards: batch B alone with scale 2, delta = [4+3-5, 4-6, 4+0.5-8]
    # = [2, -2, -3.5]; A = [2 + 0.5*(-2), -2, -3.5] = [1, -2, -3.5]
    out2 = prepare_batches([b], policy, IdentityCritic(), gamma=0.5, lam=1.0, reward_scale=2.0)
    np.testing.assert_allclose(out2.advantages.numpy(), [1.0, -2.0, -3.5], atol=1e-6)


def test_prepare_batches_rejects_unknown_last_successor():
    policy = Policy(TINY)
    bad = _tiny_batch([1, 2], [1, 1], [0, 0], [], np.zeros((0, 1)))
    with pytest.raises(ValueError, match="last step"):
        prepare_batches([bad], policy, IdentityCritic(), 0.99, 0.95)


# ----------------------------------------------------------------------------------------------
# The learner on real Hopper-v5 batches
# ----------------------------------------------------------------------------------------------

ENV = "Hopper-v5"
CFG = PPOConfig(lr=3e-4, epochs=2, minibatch_size=128)


def collect(policy: Policy, seed: int, n_steps: int) -> dict[str, np.ndarray]:
    """A minimal actor loop in the batch format of docs/ARCHITECTURE.md."""
    spec = policy.spec
    env = make_env(ENV)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    out = {
        "obs": np.empty((n_steps, *spec.obs_shape), np.float32),
        "actions": np.empty((n_steps, spec.action_dim), np.float32),
        "logp": np.empty(n_steps, np.float32),
        "rewards": np.empty(n_steps, np.float32),
        "terminated": np.zeros(n_steps, bool),
    }
    boot_idx, boot_obs = [], []
    for t in range(n_steps):
        out["obs"][t] = obs
        action, out["logp"][t] = policy.sample(out["obs"][t], rng)
        out["actions"][t] = action
        obs, reward, term, trunc, _ = env.step(np.clip(action, -1.0, 1.0))
        out["rewards"][t] = reward
        if term or trunc:
            out["terminated"][t] = term
            if not term:
                boot_idx.append(t)
                boot_obs.append(np.asarray(obs, np.float32))
            obs, _ = env.reset()
        elif t == n_steps - 1:
            boot_idx.append(t)
            boot_obs.append(np.asarray(obs, np.float32))
    env.close()
    out["bootstrap_idx"] = np.asarray(boot_idx, np.int64)
    out["bootstrap_obs"] = np.stack(boot_obs) if boot_obs else np.zeros((0, *spec.obs_shape), np.float32)
    return out


@pytest.fixture(scope="module")
def hopper_batches():
    """Two rounds of two 256-step segments, from the seed-0 learner's initial policy."""
    learner = PPOLearner(env_spec(ENV), CFG, seed=0)
    round1 = [collect(learner.policy, s, 256) for s in (1, 2)]
    round2 = [collect(learner.policy, s, 256) for s in (3, 4)]
    assert any(b["terminated"].any() for b in round1 + round2)  # random Hopper falls quickly
    return round1, round2


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_learner_update_improves_objective_and_changes_weights(hopper_batches):
    round1, _ = hopper_batches
    learner = PPOLearner(env_spec(ENV), CFG, seed=0, noise_scale=True)  # as the kungfu scaler asks for it
    data = learner.prepare(round1)
    closure = ppo_objective(learner.policy, data, np.arange(len(data.rewards)),
                            clip=CFG.clip, kl_coef=learner.kl_coef, entropy_coef=CFG.entropy_coef)
    with torch.no_grad():
        surrogate_before = float(closure())
        vf_before = float(
            value_loss(learner.critic(learner.policy.features(data.obs)), data.returns, data.values, CFG.vf_clip)
        )
    p_before, c_before = _flat(learner.policy), _flat(learner.critic)
    before = copy.deepcopy(learner.policy)

    m = learner.update(round1).diagnostics

    with torch.no_grad():
        surrogate_after = float(closure())
        vf_after = float(
            value_loss(learner.critic(learner.policy.features(data.obs)), data.returns, data.values, CFG.vf_clip)
        )
    assert surrogate_after < surrogate_before
    assert vf_after < vf_before
    assert not torch.equal(p_before, _flat(learner.policy))
    assert not torch.equal(c_before, _flat(learner.critic))
    for key in ("policy_loss", "vf_loss", "kl", "entropy", "kl_coef", "clip_frac", "explained_variance",
                "n_samples", "seconds", "grad_noise_scale", "grad_noise_tr_sigma", "grad_sq_norm"):
        assert isinstance(m[key], float), key
    assert m["n_samples"] == 512.0
    # the std as SB3 logs it (train/std), after the update: it moved from log_std_init's 1.0
    assert m["action_std"] == pytest.approx(float(learner.policy.log_std.exp().mean())) and m["action_std"] != 1.0
    assert m["kl"] > 0 and math.isfinite(m["grad_noise_tr_sigma"]) and m["grad_noise_tr_sigma"] > 0
    # the round's statistics are merged BEFORE the update: the KL anchor is the pre-update policy
    # read through the merged statistics, and the actors' log-probs differ from it only by that move
    assert float(learner.policy.obs_norm.count) == pytest.approx(1e-4 + 512)
    before.obs_norm.load_state_dict(learner.policy.obs_norm.state_dict())
    with torch.no_grad():
        anchor = before.distribution(learner.trained_batch.obs).base_dist.loc
    assert torch.allclose(anchor, learner.trained_batch.anchor.loc, atol=1e-6)
    assert 0 < m["logp_drift"] < 0.5
    # adaptive KL applied after the update, from the whole-batch KL
    assert m["kl_coef"] == pytest.approx(adapt_kl_coef(m["kl_coef_used"], m["kl"], CFG.kl_target))
    assert learner.kl_coef == m["kl_coef"]


def test_learner_update_is_deterministic(hopper_batches):
    round1, round2 = hopper_batches
    results = []
    for _ in range(2):
        learner = PPOLearner(env_spec(ENV), CFG, seed=0)
        m1, m2 = learner.update(round1).diagnostics, learner.update(round2).diagnostics
        results.append((_flat(learner.policy), _flat(learner.critic), m1, m2))
    (p1, c1, a1, a2), (p2, c2, b1, b2) = results
    assert torch.equal(p1, p2) and torch.equal(c1, c2)
    for x, y in ((a1, b1), (a2, b2)):
        assert {k: v for k, v in x.items() if k != "seconds"} == pytest.approx(
            {k: v for k, v in y.items() if k != "seconds"}, nan_ok=True
        )


def test_an_update_is_compute_gradients_then_apply_gradients_in_a_loop(hopper_batches):
    """The seam Stellaris splits across processes: driven by hand (the update's statistics merge,
    its seeded minibatches, one ``compute_gradients`` and one ``apply_gradients`` each), the
    weights and Adam's state come out bit for bit as ``update`` leaves them."""
    round1, _ = hopper_batches
    learner, by_hand = PPOLearner(env_spec(ENV), CFG, seed=0), PPOLearner(env_spec(ENV), CFG, seed=0)
    learner.update(round1)
    by_hand.merge_statistics(round1)
    data = by_hand.prepare(round1)
    n = len(data.rewards)
    rng = np.random.default_rng([by_hand.seed, by_hand.n_updates])
    count = minibatch_count(n, CFG.minibatch_size, CFG.minibatches)
    for _ in range(CFG.epochs):
        for idx in minibatch_indices(n, count, rng):
            gradients = by_hand.compute_gradients(data, idx)
            assert gradients.samples == len(idx) and set(gradients.tensors) == set(by_hand.parameter_names())
            assert by_hand.apply_gradients([gradients])
    assert torch.equal(_flat(by_hand.policy), _flat(learner.policy))
    assert torch.equal(_flat(by_hand.critic), _flat(learner.critic))
    for a, b in zip(by_hand.optimizer.state.values(), learner.optimizer.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert all(p.grad is None for p in by_hand.parameter_names().values())


def test_apply_gradients_refuses_a_non_finite_loss_and_takes_no_step(hopper_batches):
    from nitro.learners import Gradients

    learner = PPOLearner(env_spec(ENV), CFG, seed=0)
    before = _flat(learner.policy)
    grads = {name: torch.ones_like(p) for name, p in learner.parameter_names().items()}
    assert not learner.apply_gradients([Gradients(grads, samples=4, loss=float("nan"))])
    assert not learner.apply_gradients([Gradients({**grads, "policy.log_std": torch.full_like(
        grads["policy.log_std"], float("inf"))}, samples=4, loss=1.0)])
    assert torch.equal(before, _flat(learner.policy)) and not learner.optimizer.state


def test_ppo_anneals_its_own_learning_rate_from_progress(hopper_batches):
    round1, round2 = hopper_batches
    cfg = PPOConfig(lr=3e-4, epochs=2, minibatch_size=128, anneal_lr=True)
    lr3 = annealed_lr(cfg.lr, 3, 5)  # 3e-4 x (1 - 2/4) = 1.5e-4
    learner = PPOLearner(env_spec(ENV), cfg, seed=0)
    assert isinstance(learner, Learner) and learner.name == "ppo"
    result = learner.update(round1, progress=Progress(round=3, rounds=5))
    assert result.diagnostics["lr"] == lr3 == learner.optimizer.param_groups[0]["lr"]
    # set before the update's first step: the same weights as setting it by hand beforehand
    by_hand = PPOLearner(env_spec(ENV), cfg, seed=0)
    by_hand.set_learning_rate(lr3)
    by_hand.update(round1)
    assert torch.equal(_flat(by_hand.policy), _flat(learner.policy))
    assert torch.equal(_flat(by_hand.critic), _flat(learner.critic))
    # no progress (outside a run): the learning rate stays where it is
    assert learner.update(round2).diagnostics["lr"] == lr3
    # anneal_lr off: progress moves nothing
    fixed = PPOLearner(env_spec(ENV), CFG, seed=0)
    assert fixed.update(round1, progress=Progress(round=3, rounds=5)).diagnostics["lr"] == CFG.lr


def test_a_deadline_in_the_past_stops_the_update_before_its_first_step(hopper_batches):
    round1, _ = hopper_batches
    learner = PPOLearner(env_spec(ENV), CFG, seed=0)
    p0, c0 = _flat(learner.policy), _flat(learner.critic)
    result = learner.update(round1, deadline=time.perf_counter() - 1.0)
    assert result.cut_short and result.sgd_steps == 0 and result.skipped_minibatches == 0
    assert not result.took_no_step  # nothing failed: the budget ran out
    assert result.diagnostics["update_cut_short"] == 1.0 and result.diagnostics["sgd_steps"] == 0.0
    assert torch.equal(p0, _flat(learner.policy)) and torch.equal(c0, _flat(learner.critic))
    later = learner.update(round1, deadline=time.perf_counter() + 3600.0)
    assert not later.cut_short and later.sgd_steps == later.diagnostics["sgd_steps"] == 2 * 4  # epochs x minibatches
    assert later.grad_noise_scale == later.diagnostics["grad_noise_scale"] or math.isnan(later.grad_noise_scale)


def test_minibatch_count_and_split_by_hand():
    assert minibatch_count(2048, 64) == 32 and minibatch_count(100, 64) == 2 and minibatch_count(10, 64) == 1
    assert minibatch_count(16384, 64, minibatches=32) == 32  # 512-sample minibatches
    assert minibatch_count(3, 64, minibatches=32) == 3  # never an empty minibatch
    parts = minibatch_indices(10, 3, np.random.default_rng(0))
    assert [len(p) for p in parts] == [4, 3, 3]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))  # a permutation: each sample once
    with pytest.raises(ValueError, match="minibatches"):
        PPOConfig(minibatches=0)


def test_constant_minibatches_keep_a_boosted_update_s_adam_steps(hopper_batches):
    """ppo.minibatches: twice the samples make minibatches twice as big, not twice as many steps;
    on the batch the count was chosen for, the update is the minibatch_size update exactly."""
    round1, round2 = hopper_batches  # 512 samples each; together a "boosted" round of 1024
    by_size = PPOLearner(env_spec(ENV), CFG, seed=0)  # 128-sample minibatches
    assert by_size.update(round1 + round2).sgd_steps == 2 * 8
    constant = PPOConfig(lr=3e-4, epochs=2, minibatch_size=128, minibatches=4)
    boosted = PPOLearner(env_spec(ENV), constant, seed=0)
    assert boosted.update(round1 + round2).sgd_steps == 2 * 4  # epochs x minibatches, of 256 samples
    assert boosted._minibatches(1024, np.random.default_rng(0))[0].numel() == 256
    a, b = PPOLearner(env_spec(ENV), CFG, seed=0), PPOLearner(env_spec(ENV), constant, seed=0)
    assert a.update(round1).sgd_steps == b.update(round1).sgd_steps == 2 * 4
    assert torch.equal(_flat(a.policy), _flat(b.policy)) and torch.equal(_flat(a.critic), _flat(b.critic))


def test_state_dict_round_trips_through_safetensors(hopper_batches):
    round1, round2 = hopper_batches
    a = PPOLearner(env_spec(ENV), CFG, seed=0)
    a.update(round1)
    tensors, meta = a.state_dict()
    arrays, meta_str = loads_tensors(dumps_tensors(tensors, meta))  # data only: no pickle anywhere
    b = PPOLearner(env_spec(ENV), CFG, seed=7)  # different init, overwritten by the load
    b.load_state_dict(arrays, meta_str)
    assert b.kl_coef == a.kl_coef and b.n_updates == a.n_updates and b.seed == a.seed
    assert (b.reward_stats.mean, b.reward_stats.var, b.reward_stats.count) == (
        a.reward_stats.mean, a.reward_stats.var, a.reward_stats.count)
    # Same state (Adam moments included) -> the next update is identical.
    ma, mb = a.update(round2).diagnostics, b.update(round2).diagnostics
    assert torch.equal(_flat(a.policy), _flat(b.policy)) and torch.equal(_flat(a.critic), _flat(b.critic))
    assert ma["policy_loss"] == mb["policy_loss"] and ma["kl_coef"] == mb["kl_coef"]
    assert set(a.weights()) == set(a.policy.state_dict())  # publishing: the policy alone
    assert "obs_norm.mean" in a.weights()


def test_obs_norm_and_reward_stats_merge_after_update(hopper_batches):
    round1, round2 = hopper_batches
    learner = PPOLearner(env_spec(ENV), CFG, seed=0)
    learner.update(round1)
    learner.update(round2)
    all_obs = np.concatenate([b["obs"] for b in round1 + round2]).astype(np.float64)
    norm = learner.policy.obs_norm
    # prior (mean 0, var 1, count 1e-4) is negligible against 1024 observations
    np.testing.assert_allclose(norm.mean.numpy(), all_obs.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.var.numpy(), all_obs.var(0), rtol=1e-5, atol=1e-6)
    assert float(norm.count) == pytest.approx(1024, abs=1e-3)
    traces = []
    for b in round1 + round2:
        end = b["terminated"].copy()
        end[b["bootstrap_idx"]] = True
        traces.append(discounted_return_trace(b["rewards"], end, CFG.gamma))
    traces = np.concatenate(traces)
    assert learner.reward_stats.var == pytest.approx(traces.var(), rel=1e-5)
    assert learner.reward_scale == pytest.approx(1 / math.sqrt(traces.var() + 1e-8), rel=1e-5)


def test_stats_frozen_during_update_and_closure_supports_hvp(hopper_batches):
    round1, _ = hopper_batches
    learner = PPOLearner(env_spec(ENV), CFG, seed=0)
    mean_before = learner.policy.obs_norm.mean.clone()
    learner.prepare(round1)
    assert torch.equal(learner.policy.obs_norm.mean, mean_before)  # preparing does not touch stats
    learner.update(round1)
    closure = learner.objective(np.arange(0, 512, 4))  # on the update's batch, prepare(round1)
    params = learner.policy_parameters()
    grads = torch.autograd.grad(closure(), params, create_graph=True)
    vec = [torch.randn_like(p) for p in params]
    hvp = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vec)), params)
    assert all(h.shape == p.shape for h, p in zip(hvp, params))
    assert sum(float(h.abs().sum()) for h in hvp) > 0
    assert all(p.grad is None for p in params)  # autograd.grad leaves no .grad behind


def test_a_checkpoint_of_another_network_is_refused_naming_the_model_section():
    spec = ATARI_SHAPED
    shared = PPOLearner(spec, PPOConfig(), seed=0, arch=Architecture(shared_trunk=True))
    separate = PPOLearner(spec, PPOConfig(), seed=0)
    with pytest.raises(ValueError, match=r"checkpoint's critic is not the network .*model.shared_trunk"):
        separate.load_state_dict(*shared.state_dict())
    nature = PPOLearner(spec, PPOConfig(), seed=0, arch=Architecture(cnn="nature"))
    with pytest.raises(ValueError, match=r"checkpoint's policy is not the network .*model.cnn"):
        separate.load_state_dict(*nature.state_dict())


@pytest.mark.parametrize(("shared_trunk", "cnn"), [(False, "paper"), (True, "paper"), (True, "nature")])
def test_learner_runs_on_a_discrete_atari_shaped_batch(shared_trunk, cnn):
    """The Categorical / CNN / sign-clipped-reward path, on synthetic frames (no emulator needed),
    with a critic of its own or a value head on the policy's trunk, on either CNN."""
    spec = ATARI_SHAPED
    learner = PPOLearner(spec, PPOConfig(epochs=1, minibatch_size=8), seed=0,
                         arch=Architecture(shared_trunk=shared_trunk, cnn=cnn))
    before = {name: p.detach().clone() for name, p in learner.parameter_names().items()}
    rng = np.random.default_rng(0)
    T = 16
    obs = rng.integers(0, 256, size=(T, 4, 84, 84), dtype=np.uint8)
    actions, logp = np.empty(T, np.int64), np.empty(T, np.float32)
    for t in range(T):
        actions[t], logp[t] = learner.policy.sample(obs[t], rng)
    batch = {
        "obs": obs, "actions": actions, "logp": logp,
        "rewards": rng.choice([0.0, 25.0, -5.0], size=T).astype(np.float32),
        "terminated": np.zeros(T, bool), "bootstrap_idx": np.array([T - 1]),
        "bootstrap_obs": rng.integers(0, 256, size=(1, 4, 84, 84), dtype=np.uint8),
    }
    data = learner.prepare([batch])
    assert set(np.unique(data.rewards.numpy())) <= {-1.0, 0.0, 1.0}  # sign-clipped
    assert isinstance(data.anchor, CategoricalParams) and data.anchor.logits.shape == (T, 6)
    m = learner.update([batch]).diagnostics
    assert m["n_samples"] == T and m["kl"] >= 0 and m["logp_drift"] < 1e-4
    moved = {name for name, p in learner.parameter_names().items() if not torch.equal(p, before[name])}
    assert moved == set(before)  # both heads, and the trunk(s)
    assert ("critic.net.weight" in moved) == shared_trunk
