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

``make_env(env_id, seed)`` returns a single environment; the rollout handles episode ends itself
(no autoreset, so no dummy transitions from gymnasium 1.x's NEXT_STEP autoreset can leak into a
batch).

``AtariGames(env_id, n)`` is n games of one ``ALE/...`` id stepped side by side in this process,
so that an actor runs its CNN once per step on all of them. Each game is the emulator of
``make_env``'s env driven directly, without the gymnasium wrappers, and preprocessed exactly as
those wrappers do (the same seeding, no-op starts, frame skip with max-pooling of the last two
frames, OpenCV's area resize, frame stack): from the same seed a game gives ``make_env``'s
observations and rewards bit for bit, at about 1.4x the speed (the wrappers fetch an RGB screen
and build an info dict on every frame). ale-py's own ``AtariVectorEnv`` is measured
beside it (``bench/atari_actor.py``): at one thread it is no faster, and it cannot save and restore
a game, which episodes that outlive an invocation need (``nitro/actors/episodes.py``). envpool is
not installed here and has not been measured.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Annotated, Any

import gymnasium as gym
import numpy as np
from pydantic import AfterValidator

os.environ.setdefault("MUJOCO_GL", "disable")  # nothing renders; avoids probing for GL
log = logging.getLogger("nitro")

MUJOCO_ENVS = ("Hopper-v5", "Walker2d-v5", "Humanoid-v5")
ATARI_ENVS = ("ALE/SpaceInvaders-v5", "ALE/Qbert-v5", "ALE/Gravitar-v5")
PAPER_ENVS: tuple[str, ...] = MUJOCO_ENVS + ATARI_ENVS
IMAGE_SIZE, FRAME_STACK = 84, 4
NOOP_MAX, FRAME_SKIP = 30, 4  # the DQN preprocessing of Atari games


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


@functools.lru_cache(maxsize=1)
def _route_mujoco_warnings() -> None:
    """MuJoCo's own warning handler appends to MUJOCO_LOG.TXT in the working directory (gymnasium's
    MuJoCo models use an attribute MuJoCo 4 deprecates, so every process that makes one warns):
    its warnings go to the log instead, each text once per process, a deprecation in the models
    (not the user's to act on) at debug level."""
    try:
        import mujoco
    except ImportError:
        return
    seen: set[str] = set()

    def warn(text: str) -> None:
        if text not in seen:
            seen.add(text)
            log.log(logging.DEBUG if "deprecated" in text else logging.WARNING, "mujoco: %s", text)

    mujoco.set_mju_user_warning(warn)


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
                env, noop_max=NOOP_MAX, frame_skip=FRAME_SKIP, screen_size=IMAGE_SIZE, grayscale_obs=True,
                scale_obs=False
            )
            env = gym.wrappers.FrameStackObservation(env, stack_size=FRAME_STACK)
        else:
            _route_mujoco_warnings()
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


class AtariGames:
    """``n`` games of one ``ALE/...`` id stepped side by side, each preprocessed exactly as
    ``make_env``'s wrappers do (module docstring).

    ``obs`` (n, FRAME_STACK, 84, 84) uint8 holds each game's current observation. ``step(actions)``
    steps the first ``len(actions)`` games one agent step each (FRAME_SKIP frames, the last two
    max-pooled) and returns their rewards, whether each game terminated or was truncated (ALE's
    frame limit), and whether it lost a life. A game that ended stays ended, ``obs`` its terminal
    observation, until ``reset(i)`` starts the next one."""

    def __init__(self, env_id: str, n: int):
        if not env_id.startswith("ALE/"):
            raise UnknownEnvError(f"AtariGames runs ALE/... games, not {env_id!r}")
        if n < 1:
            raise ValueError(f"AtariGames needs at least one game, got {n}")
        env_spec(env_id)  # one line (UnknownEnvError) if the id cannot be made here
        self.env_id, self.n = env_id, int(n)
        # AtariEnv configures each emulator as the id says (sticky actions, frame limit, action set)
        # and seeds it as make_env's env is seeded; its frame skipping is off, done here instead.
        self.emulators = [gym.make(env_id, frameskip=1).unwrapped for _ in range(n)]
        self._ales = [e.ale for e in self.emulators]  # type: ignore[attr-defined]  # AtariEnv.ale
        ale = self._ales[0]
        full = bool((gym.spec(env_id).kwargs or {}).get("full_action_space", False))
        self.action_set = list(ale.getLegalActionSet() if full else ale.getMinimalActionSet())
        height, width = ale.getScreenDims()
        # The last two frames of each game's frame skip, max-pooled into _last (AtariPreprocessing's
        # obs_buffer[0] and [1]); one contiguous array each, so that one resize serves every game.
        self._last = np.zeros((n, height, width), np.uint8)
        self._before = np.zeros((n, height, width), np.uint8)
        self.obs = np.zeros((n, FRAME_STACK, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
        self.lives = np.zeros(n, np.int64)
        self._after_reset: list[Any] = [None] * n  # each game's ALEState right after a reset_game (restore)

    def reset(self, i: int, seed: int | None = None) -> None:
        """Start game ``i`` anew (seeded when ``seed`` is given): 1..NOOP_MAX no-ops drawn from
        the game's RNG, as AtariPreprocessing.reset; the frame stack filled with the first frame."""
        game, ale = self.emulators[i], self._ales[i]
        game.reset(seed=seed)
        noop = self.action_set[0]
        for _ in range(int(game.np_random.integers(1, NOOP_MAX + 1))):
            ale.act(noop, 1.0)
            if ale.game_over(with_truncation=False) or ale.game_truncated():
                game.reset(seed=seed)
        self.lives[i] = ale.lives()
        ale.getScreenGrayscale(self._last[i])
        self._before[i].fill(0)
        self.obs[i] = self._pooled(i, i + 1)[0]

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One agent step of games 0..k-1, k = len(actions): (rewards float32, terminated,
        truncated, life_lost), each of shape (k,)."""
        k = len(actions)
        rewards = np.zeros(k, np.float32)
        terminated, truncated, life_lost = np.zeros(k, bool), np.zeros(k, bool), np.zeros(k, bool)
        for i in range(k):
            ale, action = self._ales[i], self.action_set[actions[i]]
            total = 0.0
            for t in range(FRAME_SKIP):  # AtariPreprocessing.step, frame by frame
                total += ale.act(action, 1.0)
                term, trunc = ale.game_over(with_truncation=False), ale.game_truncated()
                if term or trunc:
                    # the pooled frames are left as they are, as the wrapper leaves them: only a
                    # truncated game's bootstrap observation reads them
                    break
                if t == FRAME_SKIP - 2:
                    ale.getScreenGrayscale(self._before[i])
                elif t == FRAME_SKIP - 1:
                    ale.getScreenGrayscale(self._last[i])
            rewards[i], terminated[i], truncated[i] = total, term, trunc
            lives = ale.lives()
            life_lost[i] = lives < self.lives[i]
            self.lives[i] = lives
        self.obs[:k, :-1] = self.obs[:k, 1:]
        self.obs[:k, -1] = self._pooled(0, k)
        return rewards, terminated, truncated, life_lost

    def _pooled(self, start: int, stop: int) -> np.ndarray:
        """Games start..stop-1's frames, max-pooled and resized to 84x84: (stop - start, 84, 84).

        One cv2.resize over the games' frames stacked vertically is the per-game resize: the
        area cells never straddle two games, since each game's rows map to exactly 84 rows."""
        import cv2

        last = self._last[start:stop]
        np.maximum(last, self._before[start:stop], out=last)
        k, height, width = last.shape
        out = cv2.resize(last.reshape(k * height, width), (IMAGE_SIZE, k * IMAGE_SIZE), interpolation=cv2.INTER_AREA)
        return out.reshape(k, IMAGE_SIZE, IMAGE_SIZE)

    def state(self, i: int) -> tuple[np.ndarray, dict]:
        """Game ``i``'s emulator state (with its RNG: sticky actions) as uint8 bytes, and the
        state of the RNG its next no-op start draws from."""
        sim = np.frombuffer(self._ales[i].cloneState(include_rng=True).serialize(), dtype=np.uint8).copy()
        return sim, dict(self.emulators[i].np_random.bit_generator.state)

    def restore(self, i: int, sim_state: np.ndarray, obs: np.ndarray, env_rng: dict) -> None:
        """Put game ``i`` back into a ``state`` with observation ``obs``. The pooling buffers
        start at zero: a restored game fills them within its next step."""
        from ale_py import ALEState

        ale = self._ales[i]
        # The emulator keeps state that restoreState does not set and its next frame reads (ale-py
        # 0.12: restored into a fresh emulator, or one that played other frames, a state can play
        # its next frame differently, RAM and screen). One frame played from the state right after a
        # reset sets it as reset_game + one frame does, which make_env's env and a fresh game start
        # from. Restoring that state costs ~0.06 ms; reset_game costs 4-6 ms, a third of an actor's
        # time at 8 games of 16 steps (bench/atari_actor.py).
        if self._after_reset[i] is None:
            ale.reset_game()
            self._after_reset[i] = ale.cloneState(include_rng=True)
        ale.restoreState(self._after_reset[i])
        ale.act(self.action_set[0], 1.0)
        ale.restoreState(ALEState(np.asarray(sim_state, dtype=np.uint8).tobytes()))
        self.emulators[i].np_random.bit_generator.state = env_rng
        self.obs[i] = obs
        self.lives[i] = ale.lives()
        self._last[i].fill(0)
        self._before[i].fill(0)

    def close(self) -> None:
        for game in self.emulators:
            game.close()


@functools.cache
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


@functools.cache
def observation_bounds(env_id: str) -> tuple[np.ndarray, np.ndarray]:
    """The (low, high) of ``env_id``'s observation space as Nitro's models read it, float64, one
    entry per input; unbounded inputs are -inf / inf."""
    env = make_env(env_id)
    try:
        low, high = box_bounds(env.observation_space)
        return (np.asarray(low, np.float64).ravel().copy(), np.asarray(high, np.float64).ravel().copy())
    finally:
        env.close()


def box_bounds(space: gym.Space) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of a Box space: every observation space ``env_spec`` admits, and every continuous action space."""
    if not isinstance(space, gym.spaces.Box):
        raise TypeError(f"expected a Box space, got {type(space).__name__}")
    return space.low, space.high


def check_env_id(env_id: str) -> str:
    """``env_id`` if Nitro can train on it, else UnknownEnvError (for validators)."""
    env_spec(env_id)
    return env_id


# An env id field of a pydantic model (the run's config, an actor's event): UnknownEnvError is a
# ValueError, so pydantic reports its one line as the field's error.
EnvId = Annotated[str, AfterValidator(check_env_id)]
