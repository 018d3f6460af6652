import pytest

from nitro.config import ConfigError, NitroConfig


def test_defaults_are_the_papers():
    cfg = NitroConfig()
    assert (cfg.scaler.window, cfg.scaler.decay, cfg.scaler.i_min, cfg.scaler.i_max) == (6, 0.96, 8, 64)
    assert (cfg.ppo.lr, cfg.ppo.clip, cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.vf_coef) == (5e-5, 0.3, 0.2, 0.01, 1.0)
    assert (cfg.impact.lr, cfg.impact.clip, cfg.impact.kl_coef, cfg.impact.entropy_coef) == (5e-4, 0.4, 1.0, 0.01)
    assert cfg.prices.lambda_gb_s_x86 == 0.0000166667


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
    ],
)
def test_invalid_values_name_the_field_in_one_line(override, field):
    with pytest.raises(ConfigError) as info:
        NitroConfig.load({}, [override])
    msg = str(info.value)
    assert "\n" not in msg
    assert f"invalid config: {field}:" in msg


def test_unknown_env_lists_supported_ids():
    with pytest.raises(ConfigError, match="supported: Hopper-v5, Walker2d-v5, Humanoid-v5, ALE/SpaceInvaders-v5"):
        NitroConfig.load({"env_id": "CartPole-v1"})


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
