"""The six benchmark environments (SPEC.md): three MuJoCo tasks and three Atari games.

``make_env(env_id, seed)`` returns a single gymnasium environment, already seeded, preprocessed the
way the models expect. Vector envs are deliberately not used: an actor steps one env, and the
rollout loop handles episode ends itself (no autoreset, so no dummy transitions from gymnasium 1.x's
NEXT_STEP autoreset can leak into a batch).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

os.environ.setdefault("MUJOCO_GL", "disable")  # nothing renders; avoids probing for GL

MUJOCO_ENVS = ("Hopper-v5", "Walker2d-v5", "Humanoid-v5")
ATARI_ENVS = ("ALE/SpaceInvaders-v5", "ALE/Qbert-v5", "ALE/Gravitar-v5")
SUPPORTED_ENVS: tuple[str, ...] = MUJOCO_ENVS + ATARI_ENVS


class UnknownEnvError(ValueError):
    pass


@dataclass(frozen=True)
class EnvSpec:
    """What the models and the learner need to know about an environment."""

    env_id: str
    kind: str  # "mujoco" | "atari"
    obs_shape: tuple[int, ...]
    obs_dtype: str  # "float32" | "uint8"
    continuous: bool
    action_dim: int  # continuous: size of the action vector; discrete: number of actions
    max_episode_steps: int | None

    @property
    def is_atari(self) -> bool:
        return self.kind == "atari"


def _check(env_id: str) -> None:
    if env_id not in SUPPORTED_ENVS:
        raise UnknownEnvError(f"unknown env id {env_id!r}; supported: {', '.join(SUPPORTED_ENVS)}")


def make_env(env_id: str, seed: int | None = None) -> gym.Env:
    """Build one preprocessed, seeded environment. Unknown ids list the supported ones."""
    _check(env_id)
    if env_id in ATARI_ENVS:
        import ale_py

        gym.register_envs(ale_py)
        # AtariPreprocessing does the frame skipping itself, so the base env must not.
        env = gym.make(env_id, frameskip=1)
        env = gym.wrappers.AtariPreprocessing(
            env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True, scale_obs=False
        )
        env = gym.wrappers.FrameStackObservation(env, stack_size=4)
    else:
        env = gym.make(env_id)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


@functools.lru_cache(maxsize=None)
def env_spec(env_id: str) -> EnvSpec:
    _check(env_id)
    env = make_env(env_id)
    try:
        obs_space = env.observation_space
        act_space = env.action_space
        continuous = isinstance(act_space, gym.spaces.Box)
        action_dim = int(np.prod(act_space.shape)) if continuous else int(act_space.n)
        max_steps = env.spec.max_episode_steps if env.spec is not None else None
        return EnvSpec(
            env_id=env_id,
            kind="atari" if env_id in ATARI_ENVS else "mujoco",
            obs_shape=tuple(int(d) for d in obs_space.shape),
            obs_dtype="uint8" if obs_space.dtype == np.uint8 else "float32",
            continuous=continuous,
            action_dim=action_dim,
            max_episode_steps=max_steps,
        )
    finally:
        env.close()
