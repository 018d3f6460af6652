"""Environments: any registered gymnasium id whose spaces Nitro's models handle, preprocessed the
way those models expect.

* ``ALE/...`` games: the DQN preprocessing (no-op starts, frame skip 4, 84x84 grayscale, a stack
  of 4 frames as uint8), read by the CNN.
* Other environments with image observations (a 3-D uint8 Box): resized to 84x84, grayscale,
  4 frames stacked, read by the same CNN.
* Everything else with a Box observation: flattened to a vector, read by the MLP.
* Actions: a Box (Gaussian policy, actions clipped to the bounds) or Discrete (categorical).

The paper's six environments (``PAPER_ENVS``: three MuJoCo tasks and three Atari games) are the
ones with tuned defaults; any other id trains with the defaults of its family. An id that is
not registered, cannot be made (a missing optional dependency, say), or whose spaces Nitro cannot
handle fails with ``UnknownEnvError`` and one line that says why.

``make_env(env_id, seed)`` returns a single environment. Vector envs are deliberately not used:
an actor steps one env, and the rollout handles episode ends itself (no autoreset, so no dummy
transitions from gymnasium 1.x's NEXT_STEP autoreset can leak into a batch).
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
PAPER_ENVS: tuple[str, ...] = MUJOCO_ENVS + ATARI_ENVS
IMAGE_SIZE, FRAME_STACK = 84, 4


class UnknownEnvError(ValueError):
    """An env id Nitro cannot train on; the message is one line."""


@dataclass(frozen=True)
class EnvSpec:
    """What the models and the learner need to know about an environment."""

    env_id: str
    kind: str  # "atari" | "image" (both: CNN on stacked uint8 frames) | "vector" (MLP)
    obs_shape: tuple[int, ...]
    obs_dtype: str  # "float32" | "uint8"
    continuous: bool
    action_dim: int  # continuous: size of the action vector; discrete: number of actions
    max_episode_steps: int | None

    @property
    def is_atari(self) -> bool:
        """Atari rewards are sign-clipped for training (the DQN convention)."""
        return self.kind == "atari"

    @property
    def is_image(self) -> bool:
        return self.kind in ("atari", "image")


@functools.lru_cache(maxsize=1)
def _register_ale() -> None:
    import ale_py

    gym.register_envs(ale_py)


def _is_image(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def make_env(env_id: str, seed: int | None = None) -> gym.Env:
    """Build one preprocessed environment (seeded if ``seed`` is given)."""
    if env_id.startswith("ALE/"):
        _register_ale()
    if env_id not in gym.registry:
        close = sorted(e for e in PAPER_ENVS if e.split("-")[0].lower() in env_id.lower())
        hint = f"; did you mean {close[0]}?" if close else f"; the tuned ones: {', '.join(PAPER_ENVS)}"
        raise UnknownEnvError(f"unknown env id {env_id!r}: not registered with gymnasium{hint}")
    try:
        if env_id.startswith("ALE/"):
            # AtariPreprocessing does the frame skipping itself, so the base env must not.
            env = gym.make(env_id, frameskip=1)
            env = gym.wrappers.AtariPreprocessing(
                env, noop_max=30, frame_skip=4, screen_size=IMAGE_SIZE, grayscale_obs=True, scale_obs=False
            )
            env = gym.wrappers.FrameStackObservation(env, stack_size=FRAME_STACK)
        else:
            env = gym.make(env_id)
            if _is_image(env.observation_space):
                env = gym.wrappers.ResizeObservation(env, (IMAGE_SIZE, IMAGE_SIZE))
                env = gym.wrappers.GrayscaleObservation(env)
                env = gym.wrappers.FrameStackObservation(env, stack_size=FRAME_STACK)
            elif isinstance(env.observation_space, gym.spaces.Box) and len(env.observation_space.shape) != 1:
                env = gym.wrappers.FlattenObservation(env)
    except UnknownEnvError:
        raise
    except Exception as exc:  # a missing optional dependency, a bad kwarg, ...
        raise UnknownEnvError(f"env {env_id!r} cannot be made here: {_one_line(exc)}") from None
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


@functools.lru_cache(maxsize=None)
def env_spec(env_id: str) -> EnvSpec:
    """The spec of ``env_id``; UnknownEnvError (one line) if Nitro cannot train on it."""
    env = make_env(env_id)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(obs_space, gym.spaces.Box):
            raise UnknownEnvError(f"env {env_id!r} has a {type(obs_space).__name__} observation space; "
                                  "Nitro handles Box observations")
        if isinstance(act_space, gym.spaces.Box):
            continuous, action_dim = True, int(np.prod(act_space.shape))
            if not (np.all(np.isfinite(act_space.low)) and np.all(np.isfinite(act_space.high))):
                raise UnknownEnvError(f"env {env_id!r} has an unbounded Box action space; Nitro clips actions "
                                      "to the bounds, so it needs finite ones")
        elif isinstance(act_space, gym.spaces.Discrete):
            continuous, action_dim = False, int(act_space.n)
        else:
            raise UnknownEnvError(f"env {env_id!r} has a {type(act_space).__name__} action space; "
                                  "Nitro handles Box and Discrete actions")
        kind = "atari" if env_id.startswith("ALE/") else ("image" if _is_image(obs_space) else "vector")
        return EnvSpec(
            env_id=env_id,
            kind=kind,
            obs_shape=tuple(int(d) for d in obs_space.shape),
            obs_dtype="uint8" if obs_space.dtype == np.uint8 else "float32",
            continuous=continuous,
            action_dim=action_dim,
            max_episode_steps=env.spec.max_episode_steps if env.spec is not None else None,
        )
    finally:
        env.close()


@functools.lru_cache(maxsize=None)
def observation_bounds(env_id: str) -> tuple[np.ndarray, np.ndarray]:
    """The (low, high) of ``env_id``'s observation space as Nitro's models read it, float64, one
    entry per input; unbounded inputs are -inf / inf."""
    env = make_env(env_id)
    try:
        space = env.observation_space
        return (np.asarray(space.low, np.float64).ravel().copy(), np.asarray(space.high, np.float64).ravel().copy())
    finally:
        env.close()


def check_env_id(env_id: str) -> str:
    """``env_id`` if Nitro can train on it, else UnknownEnvError (for validators)."""
    env_spec(env_id)
    return env_id
