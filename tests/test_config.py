import pytest
import yaml

from nitro.config import ConfigError, NitroConfig, PPOConfig


def test_paper_preset_is_the_papers_table_1():
    cfg = NitroConfig(preset="paper")
    assert (cfg.scaler.window, cfg.scaler.decay, cfg.scaler.i_min, cfg.scaler.i_max) == (6, 0.96, 8, 64)
    assert (cfg.ppo.lr, cfg.ppo.clip, cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.vf_coef) == (
        5e-5,
        0.3,
        0.2,
        0.01,
        1.0,
    )
    assert (cfg.impact.lr, cfg.impact.clip, cfg.impact.kl_coef, cfg.impact.entropy_coef) == (5e-4, 0.4, 1.0, 0.01)
    assert cfg.model.hidden == [256, 256] and cfg.model.activation == "tanh"
    assert cfg.prices.lambda_gb_s_x86 == 0.0000166667
    assert NitroConfig(preset="paper", env_id="ALE/Qbert-v5").steps_per_actor * 8 == 256  # the paper's Atari batch


def test_default_preset_is_tuned_and_yields_to_what_the_user_sets():
    cfg = NitroConfig()
    assert cfg.preset == "nitro"
    assert (cfg.ppo.lr, cfg.ppo.clip, cfg.ppo.kl_coef, cfg.ppo.vf_coef, cfg.ppo.minibatch_size) == (
        3e-4,
        0.2,
        0.0,
        0.5,
        64,
    )
    assert (cfg.impact.minibatch_size, cfg.impact.entropy_coef, cfg.impact.lr) == (64, 0.0, 5e-4)  # else the paper's
    assert cfg.scaler.i_max == 64  # the scaler's defaults are the paper's in both presets
    atari = NitroConfig(env_id="ALE/Qbert-v5")
    assert (atari.ppo.lr, atari.ppo.clip, atari.ppo.entropy_coef, atari.steps_per_actor) == (2.5e-4, 0.1, 0.01, 128)
    assert (atari.impact.minibatch_size, atari.impact.entropy_coef) == (512, 0.01)  # IMPACT on images: the paper's
    assert not atari.model.shared_trunk  # the critic keeps a trunk of its own (docs/tuning.md)
    assert cfg.model.hidden == [256, 256] and NitroConfig(env_id="Humanoid-v5").model.hidden == [64, 64]  # a task's
    assert NitroConfig(env_id="Humanoid-v5", preset="paper").model.hidden == [256, 256]
    assert NitroConfig.load(overrides=["env_id=Humanoid-v5", "model.hidden=[128,128]"]).model.hidden == [128, 128]
    mine = NitroConfig.load({"ppo": {"lr": 1e-3}}, ["preset=paper"])
    assert mine.ppo.lr == 1e-3 and mine.ppo.kl_coef == 0.2  # the user's value over the preset's
    # a dumped config reloads to itself, whatever the preset
    assert NitroConfig.load(yaml.safe_load(mine.dump_yaml())) == mine


def test_a_dump_lacking_a_later_field_takes_its_default_not_the_presets_value():
    """A run's config.yaml written before a field existed resumes as that run ran."""
    text = NitroConfig(env_id="ALE/Qbert-v5").dump_yaml()
    dump = yaml.safe_load(text)
    assert text.startswith("# ") and dump["resolved"] is True and dump["ppo"]["lr"] == 2.5e-4  # the preset's
    del dump["ppo"]["lr"]  # as if the field had come after the run
    assert NitroConfig.load(dump).ppo.lr == PPOConfig().lr == 5e-5  # the section's default
    assert NitroConfig.load(dump, ["resolved=false"]).ppo.lr == 2.5e-4  # a config a user writes takes the preset's


def test_a_shared_trunk_and_the_cnn_travel_with_the_architecture():
    cfg = NitroConfig.load({"env_id": "ALE/Qbert-v5"}, ["model.shared_trunk=true", "model.cnn=nature"])
    arch = cfg.model.architecture()
    assert arch.shared_trunk and arch.cnn == "nature" and type(arch).from_meta(arch.to_meta()) == arch
    older = type(arch).from_meta('{"hidden": null, "activation": "tanh", "log_std_init": 0.0}')
    assert not older.shared_trunk and older.cnn == "paper"  # weights published before either field


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env_id: Walker2d-v5\nrounds: 7\nppo:\n  lr: 0.001\n")
    cfg = NitroConfig.from_yaml(path, ["ppo.lr=3e-4", "scaler.name=fixed", "backend.lambda.region=eu-west-1"])
    assert cfg.env_id == "Walker2d-v5" and cfg.rounds == 7
    assert cfg.ppo.lr == 3e-4 and cfg.scaler.name == "fixed"
    assert cfg.backend.lambda_.region == "eu-west-1"
    # the dump round-trips
    again = tmp_path / "again.yaml"
    again.write_text(cfg.dump_yaml())
    assert NitroConfig.from_yaml(again) == cfg


@pytest.mark.parametrize(
    "override, field",
    [
        ("env_id=Pong-v9", "env_id"),
        ("budget_usd=-1", "budget_usd"),
        ("scaler.i_min=65", "scaler"),
        ("ppo.lr=0", "ppo.lr"),
        ("scaler.name=magic", "scaler.name"),
        ("ppo.nonsense=1", "ppo.nonsense"),
        ("rounds=many", "rounds"),
        ("model.shared_trunk=true", "model.shared_trunk"),  # Hopper has no CNN trunk to share
        ("model.cnn=nature", "model.cnn"),  # nor a CNN at all
    ],
)
def test_invalid_values_name_the_field_in_one_line(override, field):
    with pytest.raises(ConfigError) as info:
        NitroConfig.load({}, [override])
    msg = str(info.value)
    assert "\n" not in msg
    assert f"invalid config: {field}:" in msg


def test_unknown_env_is_one_line_naming_the_field():
    with pytest.raises(
        ConfigError, match=r"^invalid config: env_id: unknown env id 'NoSuchEnv-v0': not registered"
    ) as info:
        NitroConfig.load({"env_id": "NoSuchEnv-v0"})
    assert "\n" not in str(info.value)


def test_any_registered_env_with_box_or_discrete_spaces_is_accepted():
    assert NitroConfig.load({"env_id": "CartPole-v1"}).env_id == "CartPole-v1"
    assert NitroConfig.load({"env_id": "Pendulum-v1"}).env_id == "Pendulum-v1"


def test_env_with_spaces_nitro_cannot_handle_is_refused():
    with pytest.raises(ConfigError, match="env_id: env 'Blackjack-v1' has a Tuple observation space"):
        NitroConfig.load({"env_id": "Blackjack-v1"})


def test_i_min_above_i_max_is_explained():
    with pytest.raises(ConfigError, match=r"i_min \(64\) must not exceed i_max \(8\)"):
        NitroConfig.load({"scaler": {"i_min": 64, "i_max": 8}})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        NitroConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        NitroConfig.from_yaml(bad)
    with pytest.raises(ConfigError, match="key=value"):
        NitroConfig.load({}, ["rounds"])


def test_flat_dict_has_every_leaf():
    flat = NitroConfig().to_flat_dict()
    assert flat["scaler.i_max"] == 64 and flat["backend.lambda.function_name"] == "nitro-actor"
    assert flat["prices.lambda_per_million_requests"] == 0.20


def test_ray_backend_section_and_a_cluster_without_an_external_redis():
    cfg = NitroConfig.load({}, ["backend.kind=ray", "backend.ray.gpus_per_job={actor: 0.5}"])
    assert cfg.backend.ray.address is None and cfg.backend.ray.cpus_per_job == 1.0
    assert cfg.backend.ray.gpus_per_job == {"actor": 0.5} and cfg.to_flat_dict()["backend.ray.object_store_mb"] == 256
    with pytest.raises(ConfigError) as info:
        NitroConfig.load({}, ["backend.kind=ray", "backend.ray.address=auto"])
    msg = str(info.value)
    assert msg.startswith("invalid config: backend.ray.address='auto' needs redis.url") and "\n" not in msg
    joined = NitroConfig.load({}, ["backend.kind=ray", "backend.ray.address=10.0.0.5:6379", "redis.url=redis://10.0.0.5:6380/0"])
    assert joined.backend.ray.address == "10.0.0.5:6379"
    with pytest.raises(ConfigError, match=r"backend.ray.gpus_per_job.critic"):
        NitroConfig.load({}, ["backend.ray.gpus_per_job={critic: 1}"])


def test_ray_actors_are_priced_as_lambda():
    from nitro.pricing.cost import ledger_from_config

    tags = ledger_from_config(NitroConfig.load({}, ["backend.kind=ray"])).tags()
    assert tags["cost.actors_backend"] == "ray" and tags["cost.note"].startswith(
        "ray actors priced as if they were Lambda"
    )
