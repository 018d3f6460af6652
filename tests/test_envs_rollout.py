import numpy as np
import pytest

from nitro.envs import ATARI_ENVS, MUJOCO_ENVS, PAPER_ENVS, UnknownEnvError, env_spec, make_env
from nitro.models import build_critic, build_policy
from nitro.rollout import rollout
from nitro.serialization import dumps_tensors


def _weights(env_id, seed=0):
    policy = build_policy(env_spec(env_id), seed=seed)
    return dumps_tensors(policy.state_dict(), {"format": "nitro.policy/1", "env_id": env_id, "version": 0})


@pytest.mark.parametrize("env_id", PAPER_ENVS)
def test_every_env_builds_and_steps(env_id):
    env = make_env(env_id, seed=1)
    obs, _ = env.reset(seed=1)
    spec = env_spec(env_id)
    assert obs.shape == spec.obs_shape
    for _ in range(5):
        obs, reward, term, trunc, _ = env.step(env.action_space.sample())
    if env_id in ATARI_ENVS:
        assert obs.dtype == np.uint8 and obs.shape == (4, 84, 84)
    env.close()


def test_unknown_env_is_refused_with_a_hint():
    with pytest.raises(UnknownEnvError, match="not registered with gymnasium; did you mean Hopper-v5"):
        make_env("Hopper-v9", 0)


def test_networks_have_the_papers_shapes():
    hopper = env_spec("Hopper-v5")
    policy, critic = build_policy(hopper), build_critic(hopper)
    linear = [m for m in policy.body if hasattr(m, "weight")]
    assert [tuple(m.weight.shape) for m in linear] == [(256, 11), (256, 256), (3, 256)]
    assert sum(p.numel() for p in critic.parameters()) == 11 * 256 + 256 + 256 * 256 + 256 + 256 + 1
    atari = env_spec("ALE/Qbert-v5")
    import torch

    x = torch.zeros(2, 4, 84, 84, dtype=torch.uint8)
    trunk = build_policy(atari).body[0]
    assert trunk(x.float()).shape == (2, 256)  # 84 -> 21 -> 11 -> 1x1x256
    assert build_policy(atari).distribution(x).logits.shape == (2, 6)
    assert build_critic(atari)(build_policy(atari).features(x)).shape == (2,)


def test_obs_normaliser_travels_with_the_weights():
    policy = build_policy(env_spec("Hopper-v5"))
    policy.obs_norm.merge(np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 11)))
    state = policy.state_dict()
    assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(state)
    clone = build_policy(env_spec("Hopper-v5"))
    clone.load_state_dict(state)
    assert np.allclose(clone.obs_norm.mean.numpy(), policy.obs_norm.mean.numpy())


@pytest.mark.parametrize("env_id", ["Hopper-v5", "ALE/Gravitar-v5"])
def test_rollout_is_deterministic_and_well_formed(env_id):
    w = _weights(env_id)
    a = rollout(w, env_id, seed=11, n_steps=300)
    b = rollout(w, env_id, seed=11, n_steps=300)
    c = rollout(w, env_id, seed=12, n_steps=300)
    for key in a.batch:
        assert np.array_equal(a.batch[key], b.batch[key]), key
    assert not np.array_equal(a.batch["obs"], c.batch["obs"])
    batch, spec = a.batch, env_spec(env_id)
    assert batch["obs"].shape == (300, *spec.obs_shape)
    assert batch["obs"].dtype == (np.uint8 if spec.is_atari else np.float32)
    assert a.summary.steps == 300 and a.summary.duration_s > 0
    # the last step is bootstrapped unless it terminated
    assert batch["terminated"][-1] or batch["bootstrap_idx"][-1] == 299
    assert len(batch["bootstrap_idx"]) == len(batch["bootstrap_obs"])


def test_reused_env_and_policy_give_the_same_batch():
    env_id = "Hopper-v5"
    w = _weights(env_id)
    env, policy = make_env(env_id), build_policy(env_spec(env_id), seed=5)  # other weights: reloaded
    first = rollout(w, env_id, 3, 200, env=env, policy=policy)
    rollout(w, env_id, 4, 123, env=env, policy=policy)  # leave the env mid-episode
    again = rollout(w, env_id, 3, 200, env=env, policy=policy)
    fresh = rollout(w, env_id, 3, 200)
    assert np.array_equal(first.batch["obs"], again.batch["obs"])
    assert np.array_equal(first.batch["actions"], fresh.batch["actions"])


def test_episode_ends_are_recorded_not_autoreset():
    # A random Hopper falls within a few dozen steps: terminated steps have no bootstrap, and
    # returns of finished episodes add up to the rewards of their steps.
    r = rollout(_weights("Hopper-v5"), "Hopper-v5", seed=0, n_steps=400)
    term = np.flatnonzero(r.batch["terminated"])
    assert len(term) >= 2
    assert not set(term) & set(r.batch["bootstrap_idx"].tolist())
    first_len = r.summary.episode_lengths[0]
    assert term[0] == first_len - 1
    assert r.summary.episode_returns[0] == pytest.approx(float(r.batch["rewards"][:first_len].sum()), rel=1e-5)


@pytest.mark.parametrize("env_id", MUJOCO_ENVS[1:])
def test_other_mujoco_envs_roll_out(env_id):
    r = rollout(_weights(env_id), env_id, seed=0, n_steps=64)
    assert r.batch["actions"].shape == (64, env_spec(env_id).action_dim)


def test_rollout_ending_on_a_termination_has_an_empty_bootstrap():
    # Find a seed whose 20-step rollout ends exactly on a termination: Hopper falls quickly
    # under a random policy, so scan the episode lengths of one long rollout for the first one.
    w = _weights("Hopper-v5")
    first = rollout(w, "Hopper-v5", seed=0, n_steps=200).summary.episode_lengths[0]
    r = rollout(w, "Hopper-v5", seed=0, n_steps=first)
    assert r.batch["terminated"][-1]
    assert r.batch["bootstrap_idx"].shape == (0,)
    assert r.batch["bootstrap_obs"].shape == (0, 11)
