import subprocess
import sys

import numpy as np
import pytest

from nitro.actors.rollout import rollout, rollout_env, rollout_games
from nitro.envs import ATARI_ENVS, MUJOCO_ENVS, PAPER_ENVS, AtariGames, UnknownEnvError, env_spec, make_env
from nitro.models import Architecture
from nitro.models.acting import acting_policy
from nitro.models.networks import build_critic, build_policy, evaluate
from nitro.serialization import dumps_tensors
from nitro.validation import check_batch

QBERT = "ALE/Qbert-v5"


def _weights(env_id, seed=0):
    policy = build_policy(env_spec(env_id), seed=seed)
    return dumps_tensors(policy.state_dict(), {"format": "nitro.policy/1", "env_id": env_id, "version": 0})


def _arrays(policy) -> dict[str, np.ndarray]:
    """A policy's state dict as an actor receives it: arrays."""
    return {name: t.detach().numpy().copy() for name, t in policy.state_dict().items()}


@pytest.mark.parametrize("env_id", PAPER_ENVS)
def test_every_env_builds_and_steps(env_id):
    env = make_env(env_id, seed=1)
    obs, _ = env.reset(seed=1)
    spec = env_spec(env_id)
    assert obs.shape == spec.obs_shape
    for _ in range(5):
        obs, _reward, _term, _trunc, _ = env.step(env.action_space.sample())
    if env_id in ATARI_ENVS:
        assert obs.dtype == np.uint8 and obs.shape == (4, 84, 84)
    env.close()


def test_making_a_mujoco_env_writes_nothing_into_the_working_directory(tmp_path):
    # MuJoCo's own warning handler appends to MUJOCO_LOG.TXT in the working directory; a fresh
    # process, so that the handler is not one an earlier test installed
    code = "from nitro.envs import make_env; make_env('Hopper-v5', 0).reset(seed=0)"
    made = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [], made.stderr[-2000:]
    assert "WARNING: compiler" not in made.stderr  # MuJoCo's own handler prints before it writes


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


def test_the_nature_cnn_is_dqns_as_sb3_builds_it():
    """``model.cnn=nature``: 32@8x8/4, 64@4x4/2, 64@3x3/1, then 3136 -> 512, as SB3's ``NatureCNN``;
    its parameters counted by hand: 4*32*64+32, 32*64*16+64, 64*64*9+64 and 3136*512+512."""
    import torch

    atari, nature = env_spec(QBERT), Architecture(cnn="nature")
    trunk = build_policy(atari, seed=0, arch=nature).body[0]
    assert sum(p.numel() for p in trunk.parameters()) == 8224 + 32832 + 36928 + 1606144
    x = torch.zeros(2, 4, 84, 84, dtype=torch.uint8)
    assert trunk(x.float()).shape == (2, 512)
    assert build_policy(atari, arch=nature).distribution(x).logits.shape == (2, 6)
    assert build_critic(atari, arch=nature)(build_policy(atari).features(x)).shape == (2,)
    shared = Architecture(cnn="nature", shared_trunk=True)
    assert sum(p.numel() for p in build_critic(atari, arch=shared).parameters()) == 512 + 1


def test_a_shared_trunk_feeds_both_heads_and_takes_both_gradients():
    """With ``shared_trunk`` the critic is a value head on the policy's trunk. The policy is the
    same network either way (an actor's weights do not change), V is the head on the trunk's
    output, and the value's gradient reaches the trunk, which a separate critic's never does."""
    import torch

    atari, shared = env_spec(QBERT), Architecture(shared_trunk=True)
    policy, critic = build_policy(atari, seed=0, arch=shared), build_critic(atari, seed=0, arch=shared)
    assert policy.state_dict().keys() == build_policy(atari, seed=0).state_dict().keys()
    assert sum(p.numel() for p in critic.parameters()) == 256 + 1
    x = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    dist, values = evaluate(policy, critic, policy.features(x))
    assert torch.equal(dist.logits, policy.distribution(x).logits)
    latent = policy.body[0](policy.features(x))
    assert torch.allclose(values, latent @ critic.net.weight[0] + critic.net.bias)
    trunk = list(policy.body[0].parameters())
    assert all(float(g.abs().sum()) > 0 for g in torch.autograd.grad(values.sum(), trunk))
    _, separate_values = evaluate(policy, build_critic(atari, seed=0), policy.features(x))
    assert torch.autograd.grad(separate_values.sum(), trunk, allow_unused=True) == (None,) * len(trunk)


def test_atari_convolutions_start_orthogonal_with_gain_sqrt2():
    """As CleanRL and SB3 start their CNNs: each filter bank's rows are orthogonal with norm
    sqrt(2) and the biases zero, in the policy's trunk and the critic's. PyTorch's default start
    left the features about 12x smaller and the policy barely moved on Qbert (docs/tuning.md)."""
    import torch

    atari, nature = env_spec("ALE/Qbert-v5"), Architecture(cnn="nature")
    for net in (build_policy(atari, seed=0), build_critic(atari, seed=0), build_policy(atari, seed=0, arch=nature),
                build_critic(atari, seed=0, arch=nature)):
        convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
        assert len(convs) == 3
        for conv in convs:
            w = conv.weight.detach().reshape(conv.out_channels, -1).double()
            assert torch.allclose(w @ w.T, 2 * torch.eye(conv.out_channels, dtype=torch.float64), atol=1e-5)
            assert not conv.bias.detach().any()
    dense = build_policy(atari, seed=0, arch=nature).body[0].net[7].weight.detach().double()  # 512 x 3136
    assert torch.allclose(dense @ dense.T, 2 * torch.eye(512, dtype=torch.float64), atol=1e-5)


def test_atari_trunk_pads_as_rllibs_filters():
    """The first convolution pads inside itself; the result is the explicit zero pads' to float
    rounding: 2 on each side (84 -> 21), then (1, 2, 1, 2) (21 -> 11), then the valid 11x11."""
    import torch
    import torch.nn.functional as F

    trunk = build_policy(env_spec("ALE/Qbert-v5"), seed=3).body[0]
    c1, c2, c3 = (m for m in trunk.modules() if isinstance(m, torch.nn.Conv2d))
    x = torch.rand(5, 4, 84, 84, generator=torch.Generator().manual_seed(0))
    ref = F.conv2d(F.pad(x, (2, 2, 2, 2)), c1.weight, c1.bias, stride=4).relu()
    assert ref.shape[-2:] == (21, 21)
    ref = F.conv2d(F.pad(ref, (1, 2, 1, 2)), c2.weight, c2.bias, stride=2).relu()
    ref = F.conv2d(ref, c3.weight, c3.bias).relu().flatten(1)
    with torch.no_grad():
        assert torch.allclose(trunk(x), ref, atol=1e-5)  # float32 sums in another order: 1.3e-6 seen on AMD EPYC


def test_obs_normaliser_travels_with_the_weights():
    policy = build_policy(env_spec("Hopper-v5"))
    policy.obs_norm.merge(np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 11)))
    state = policy.state_dict()
    assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(state)
    clone = build_policy(env_spec("Hopper-v5"))
    clone.load_state_dict(state)
    assert np.allclose(clone.obs_norm.mean.numpy(), policy.obs_norm.mean.numpy())


@pytest.mark.parametrize(("env_id", "arch"), [
    ("Hopper-v5", Architecture()),  # Gaussian, the paper's 2x256 tanh
    ("Hopper-v5", Architecture(hidden=(64, 64, 64), activation="relu", log_std_init=-0.5)),
    ("CartPole-v1", Architecture(hidden=(32,))),  # categorical
    (QBERT, Architecture()),  # the paper's CNN
    (QBERT, Architecture(cnn="nature")),
])
def test_the_acting_policy_is_the_learners_policy(env_id, arch):
    """What an actor steps with, built from the published arrays alone, gives the actions and
    log-probabilities of the torch ``Policy`` it was published from, sampling from the same RNG
    (to float32 rounding), with the normaliser's statistics away from their start."""
    import torch

    spec = env_spec(env_id)
    policy = build_policy(spec, seed=4, arch=arch).eval()
    env = make_env(env_id, seed=0)
    observations = [env.reset(seed=0)[0]]
    for _ in range(40):
        obs, _, term, trunc, _ = env.step(env.action_space.sample())
        observations.append(env.reset()[0] if term or trunc else obs)
    if policy.obs_norm is not None:
        policy.obs_norm.merge(np.stack(observations) * 3.0 + 1.0)
    actor = acting_policy(spec, arch, _arrays(policy))
    for i, obs in enumerate(observations):
        expected, got = policy.act(obs), actor.act(obs)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        (a_expected, lp_expected), (a_got, lp_got) = (
            p.sample(obs, np.random.default_rng(i)) for p in (policy, actor))
        np.testing.assert_allclose(a_got, a_expected, rtol=1e-5, atol=1e-5)
        assert lp_got == pytest.approx(lp_expected, rel=1e-5, abs=1e-4)
    with torch.no_grad():  # the distribution the learner scores an action with agrees too
        dist = policy.distribution(torch.as_tensor(np.stack(observations[:5])))
        actions = np.stack([actor.sample(o, np.random.default_rng(7))[0] for o in observations[:5]])
        np.testing.assert_allclose(
            dist.log_prob(torch.as_tensor(actions)).numpy(),
            [actor.sample(o, np.random.default_rng(7))[1] for o in observations[:5]], rtol=1e-5, atol=1e-4)


def test_weights_of_another_shape_are_refused_in_one_line():
    hopper = _arrays(build_policy(env_spec("Hopper-v5"), seed=0))
    with pytest.raises(ValueError, match="the weights have 3 layers, their architecture 4"):
        acting_policy(env_spec("Hopper-v5"), Architecture(hidden=(8, 8, 8)), hopper)
    with pytest.raises(ValueError, match="no observation normaliser"):
        acting_policy(env_spec("Hopper-v5"), Architecture(), _arrays(build_policy(env_spec(QBERT), seed=0)))
    with pytest.raises(ValueError, match=r"no layer 'body\.0\.net\.1'"):
        acting_policy(env_spec(QBERT), Architecture(), hopper)


def test_an_mlp_policys_actor_never_imports_torch_mlflow_or_prefect(tmp_path):
    """A fresh process runs the actor as a local worker does (its preloaded modules, a rollout and
    an evaluation of published weights) and PyTorch is never imported: on a 2-core host that
    import is a second or more of every fresh actor (docs/ARCHITECTURE.md, the actors)."""
    (tmp_path / "weights").write_bytes(_weights("Hopper-v5"))
    code = (
        "import sys\n"
        "import nitro.actors.local_process, nitro.actors.worker, nitro.actors.rollout, nitro.cache\n"
        "from nitro.actors.rollout import evaluate, rollout\n"
        f"w = open({str(tmp_path / 'weights')!r}, 'rb').read()\n"
        "r = rollout(w, 'Hopper-v5', 1, 64)\n"
        "e = evaluate(w, 'Hopper-v5', 1, 1, deterministic=True, max_steps=1000)\n"
        "assert r.batch['obs'].shape == (64, 11) and e.episode_returns, (r, e)\n"
        "print(sorted(m for m in ('torch', 'mlflow', 'prefect') if m in sys.modules))\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "[]"  # nor MLflow's or Prefect's imports (seconds each): actors need neither


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


def test_a_reused_env_gives_the_same_batch():
    env_id = "Hopper-v5"
    w = _weights(env_id)
    env = make_env(env_id)
    first = rollout(w, env_id, 3, 200, env=env)
    rollout(w, env_id, 4, 123, env=env)  # leave the env mid-episode
    again = rollout(w, env_id, 3, 200, env=env)
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


# -- Atari: games stepped side by side (nitro.envs.AtariGames, rollout.rollout_games) ------------


def test_atari_games_preprocess_as_make_env_does_bit_for_bit():
    """Two games of AtariGames and two make_env envs from the same seeds: the same stacked
    84x84 uint8 observations, rewards and episode ends, through game overs and new games."""
    games, envs = AtariGames(QBERT, 2), [make_env(QBERT), make_env(QBERT)]
    for i, env in enumerate(envs):
        games.reset(i, seed=40 + i)
        obs, _ = env.reset(seed=40 + i)
        assert np.array_equal(games.obs[i], obs)
    assert games.obs.shape == (2, 4, 84, 84) and games.obs.dtype == np.uint8
    rng, game_overs, lives_lost = np.random.default_rng(0), 0, 0
    for _ in range(700):
        actions = rng.integers(0, len(games.action_set), size=2)
        rewards, terminated, truncated, life_lost = games.step(actions)
        lives_lost += int(life_lost.sum())
        for i, env in enumerate(envs):
            obs, reward, term, trunc, _ = env.step(int(actions[i]))
            assert np.array_equal(games.obs[i], obs)
            assert (rewards[i], terminated[i], truncated[i]) == (reward, term, trunc)
            if term or trunc:
                game_overs += 1
                games.reset(i)
                assert np.array_equal(games.obs[i], env.reset()[0])
    assert game_overs >= 2 and lives_lost > game_overs  # a random Q*bert loses its lives within a few hundred steps


def test_one_game_plays_what_the_per_env_actor_plays():
    """rollout_games over one game and rollout_env over make_env's env, from the same seed and
    actor: the same observations, actions, log-probabilities and rewards. The games mark each
    lost life terminated too (the per-env actor only the game over)."""
    spec = env_spec(QBERT)
    actor = acting_policy(spec, Architecture(), _arrays(build_policy(spec, seed=2)))
    games = rollout_games(actor, AtariGames(QBERT, 1), seed=8, n_steps=500)
    single = rollout_env(actor, spec, make_env(QBERT), seed=8, n_steps=500)
    for key in ("obs", "actions", "logp", "rewards"):
        assert np.array_equal(games.batch[key], single.batch[key]), key
    assert (games.batch["terminated"] >= single.batch["terminated"]).all()
    assert games.batch["terminated"].sum() > single.batch["terminated"].sum()
    assert games.summary.episode_returns == single.summary.episode_returns
    assert games.summary.episode_lengths == single.summary.episode_lengths


def test_games_fill_the_batch_in_segments_that_the_door_accepts():
    """102 steps over 4 games: segments of 26, 26, 25, 25 steps back to back, each ending in a
    bootstrap or a termination, uint8 throughout; game 0's segment is what one game plays from
    the same seed, and the batch passes the learner's door."""
    w = _weights(QBERT)
    r = rollout(w, QBERT, seed=5, n_steps=102, n_envs=4)
    batch, spec = r.batch, env_spec(QBERT)
    assert batch["obs"].shape == (102, *spec.obs_shape) and batch["obs"].dtype == np.uint8
    assert batch["bootstrap_obs"].dtype == np.uint8 and batch["actions"].dtype == np.int64
    boot = batch["bootstrap_idx"]
    assert list(boot) == sorted(set(boot.tolist()))
    for last in (25, 51, 76, 101):  # each segment's last step has a successor the learner can value
        assert batch["terminated"][last] or last in boot
    check_batch(batch, spec, max_steps=102)
    alone = rollout(w, QBERT, seed=5, n_steps=26)
    assert np.array_equal(batch["obs"][:26], alone.batch["obs"])
    assert np.array_equal(batch["actions"][:26], alone.batch["actions"])
    np.testing.assert_allclose(batch["logp"][:26], alone.batch["logp"], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(batch["obs"][26:52], batch["obs"][:26])  # game 1 is another game
    assert len(r.carry) == 4 and all(c.kind == "atari" for c in r.carry)


def test_games_rollout_is_deterministic_from_its_seed():
    w = _weights(QBERT)
    a = rollout(w, QBERT, seed=3, n_steps=96, n_envs=8)
    games = AtariGames(QBERT, 8)
    rollout(_weights(QBERT, seed=9), QBERT, seed=7, n_steps=40, n_envs=8, env=games)  # games that played on
    b = rollout(w, QBERT, seed=3, n_steps=96, n_envs=8, env=games)
    c = rollout(w, QBERT, seed=4, n_steps=96, n_envs=8)
    for key in a.batch:
        assert np.array_equal(a.batch[key], b.batch[key]), key
    assert not np.array_equal(a.batch["obs"], c.batch["obs"])
    assert [s.sim_state.tobytes() for s in a.carry] == [s.sim_state.tobytes() for s in b.carry]


def test_a_lost_life_ends_a_training_episode_and_the_game_goes_on():
    """One game long enough to play a whole random Q*bert game: the game's return is the sum of
    its rewards, and it lost lives before it ended, each a terminated step."""
    r = rollout(_weights(QBERT), QBERT, seed=0, n_steps=900)
    length = r.summary.episode_lengths[0]
    assert r.summary.episode_returns[0] == pytest.approx(float(r.batch["rewards"][:length].sum()))
    assert r.batch["terminated"][length - 1]
    assert r.batch["terminated"][: length - 1].sum() >= 2  # lives lost while the game went on
    assert not set(np.flatnonzero(r.batch["terminated"])) & set(r.batch["bootstrap_idx"].tolist())
