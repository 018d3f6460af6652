"""The presets: what the config takes, beneath the values a user gives, for an env's family and,
where one was tuned, its task.

``NitroConfig`` applies them before it validates: a preset's values, then the user's on top
(``beneath``), so a user's value always wins and a field nobody names keeps its section's default.
"""

from __future__ import annotations

from typing import Any, Literal

Preset = Literal["nitro", "paper"]
EnvFamily = Literal["image", "vector"]

# What a preset sets, by env family ("vector": MLP policies, "image": Atari and other image
# observations, CNN). Fields a preset does not name keep the defaults written in the config's
# sections, which are the paper's Table 1 (docs/decisions.md). "paper" is that table with the
# paper's networks and batch sizes, for replicating the paper; "nitro" are the defaults tuned here
# (docs/tuning.md: each trial, its seeds and its returns).
PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("paper", "vector"): {"steps_per_actor": 512},
    ("paper", "image"): {"steps_per_actor": 32, "envs_per_actor": 1},  # 8 actors x 32 steps of one game each:
    # the paper's 256-sample Atari batch
    ("nitro", "vector"): {
        # 8 actors x 256 = an update every 2048 samples, as SB3's PPO: twice the updates of 512-step
        # actors for the same samples, which learned faster on Hopper and Walker2d (docs/tuning.md)
        "steps_per_actor": 256,
        # SB3's / CleanRL's PPO settings on the paper's 2x256 networks, without the KL penalty
        "ppo": {"lr": 3e-4, "clip": 0.2, "kl_coef": 0.0, "vf_coef": 0.5, "minibatch_size": 64},
        # The paper's IMPACT with 8x the SGD steps (64-sample minibatches: 128 steps an update, not
        # 16) and no entropy bonus: at 300k steps 3.6x / 2.5x the paper's return on Hopper and 2.0x /
        # 1.6x on Walker2d, every seed higher (docs/tuning.md); still well below PPO's
        "impact": {"minibatch_size": 64, "entropy_coef": 0.0},
    },
    ("nitro", "image"): {
        "steps_per_actor": 128,  # CleanRL's ppo_atari: 8 envs x 128 steps, 4 epochs of 4 minibatches
        "ppo": {"lr": 2.5e-4, "clip": 0.1, "kl_coef": 0.0, "entropy_coef": 0.01, "vf_coef": 0.5, "epochs": 4,
                "minibatch_size": 256, "normalize_rewards": False},
        # The critic keeps a CNN of its own (the paper's). model.shared_trunk=true (SB3's and CleanRL's
        # layout) runs in 0.69x its wall, but its training curve was below the separate critic's on all
        # three SpaceInvaders seeds (0.79x), above on both Gravitar seeds and level on Qbert's one
        # (docs/tuning.md); only the separate critic is level with SB3 on a game. SB3's own network
        # (model.cnn=nature, shared) kept SpaceInvaders' curve at 0.87x the separate critic's.
    },
}


# What a preset sets for one task, over its family's values. SB3's 2x64 networks on Humanoid-v5:
# updates the size of SB3's (0.44 of the samples clipped early, against 0.69 with 2x256), 1.15x the
# 2x256 networks' return over six seeds with the mean action, level with SB3's, in about 0.7x the
# wall (docs/tuning.md). Hopper and Walker2d keep 2x256, which learned more there.
TASK_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("nitro", "Humanoid-v5"): {"model": {"hidden": [64, 64]}},
}


def env_family(env_id: Any) -> EnvFamily:
    """An env id's family: "image" (Atari, or an env whose observations are images) or "vector"."""
    from nitro.envs import UnknownEnvError, env_spec

    if isinstance(env_id, str) and env_id.startswith("ALE/"):
        return "image"
    try:
        return "image" if env_spec(str(env_id)).is_image else "vector"
    except UnknownEnvError:
        return "vector"  # the env_id validator reports it


def beneath(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` with ``given`` on top, section by section."""
    out = dict(defaults)
    for key, value in given.items():
        out[key] = beneath(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def preset_values(preset: str, env_id: Any) -> dict[str, Any]:
    """What ``preset`` sets for ``env_id``: its family's values, its task's on top (nothing for an
    unknown preset, which the ``preset`` field's validator reports)."""
    return beneath(PRESETS.get((preset, env_family(env_id)), {}), TASK_PRESETS.get((preset, str(env_id)), {}))
