"""Episodes that outlive an invocation.

A serverless actor lives for one invocation of a few hundred steps, but a Hopper episode runs to
1000 steps and an Atari game to many thousands. If every invocation reset its environment, no
state past the invocation's last step would ever be visited or trained on, and no long episode
would ever be scored. SB3 and CleanRL run their envs on across updates; Nitro does the same by
carrying the environment from one invocation to the next as data:

* At the end of a rollout the actor takes an ``EpisodeSnapshot`` of its environment: the
  simulator's exact state (MuJoCo's integration state, or ALE's serialised state with its RNG),
  the time-limit counter, the environment's and the action noise's RNG states, the current
  observation, and the running return and length of the episode in progress. It is stored in
  the cache next to the trajectory batch, as safetensors with JSON metadata: never pickle.
* A later invocation (any actor, Lambda or local) restores the snapshot and goes on exactly where
  the first one stopped: with the same weights and the snapshot's RNG states, two invocations of
  N steps give the same trajectory as one invocation of 2N steps, bit for bit.
* Returns are scored on whole episodes: an episode's return is reported by the invocation that
  sees it end, summed over every invocation it spanned.

What happens to an episode whose actor failed: it is dropped. The snapshot the failed actor
started from is not handed out again (its steps up to that point were trained on already, and
the failed invocation may have written part of a continuation), so the episode is never scored
and a fresh one takes its slot. The learner side of this (which snapshot goes to which
invocation) is ``Engine.actor_events`` and ``Engine.open_episodes`` in ``nitro/run/engine.py``.

An Atari actor steps several games side by side (``nitro.envs.AtariGames``) and leaves one
unfinished episode per game: they travel together, game i's snapshot at position i of one
``nitro.episodes/1`` payload (``episodes_to_bytes``), and the next invocation continues game i
from it. An ALE snapshot restores into a game of ``AtariGames`` or into ``make_env``'s env alike.

Environments whose state cannot be captured (anything but gymnasium's MuJoCo envs and ALE
games) are reset at the start of every invocation; ``can_snapshot`` says which.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from nitro.envs import AtariGames
from nitro.serialization import SerializationError, dumps_tensors, loads_tensors

EPISODE_FORMAT = "nitro.episode/1"  # one episode
EPISODES_FORMAT = "nitro.episodes/1"  # one actor's episodes, one per env it steps


@dataclass
class EpisodeSnapshot:
    """An unfinished episode, as data."""

    env_id: str
    kind: str  # "mujoco" | "atari": how ``sim_state`` is to be restored
    sim_state: np.ndarray  # MuJoCo: mjSTATE_INTEGRATION (float64); ALE: serialised state (uint8)
    obs: np.ndarray  # the observation the next step acts on
    elapsed_steps: int | None  # the TimeLimit wrapper's counter
    episode_return: float
    episode_length: int
    env_rng: dict[str, Any]  # env.unwrapped.np_random's bit-generator state (resets use it)
    noise_rng: dict[str, Any]  # the action-noise generator's state

    def progress(self) -> dict[str, Any]:
        """What the snapshot holds besides its arrays and its env (JSON-able)."""
        return {
            "elapsed_steps": self.elapsed_steps, "episode_return": self.episode_return,
            "episode_length": self.episode_length, "env_rng": self.env_rng, "noise_rng": self.noise_rng,
        }

    def to_bytes(self) -> bytes:
        meta = {"format": EPISODE_FORMAT, "env_id": self.env_id, "kind": self.kind,
                "progress": json.dumps(self.progress())}
        return dumps_tensors({"sim_state": self.sim_state, "obs": np.asarray(self.obs)}, meta)

    @classmethod
    def from_bytes(cls, payload: bytes) -> EpisodeSnapshot:
        """Parse ``to_bytes``; SerializationError on anything malformed."""
        arrays, meta = loads_tensors(payload, expect_format=EPISODE_FORMAT)
        try:
            return cls.from_arrays(arrays["sim_state"], arrays["obs"], meta["env_id"], meta["kind"],
                                   json.loads(meta["progress"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise SerializationError(f"episode snapshot is incomplete: {exc}") from None

    @classmethod
    def from_arrays(cls, sim_state: np.ndarray, obs: np.ndarray, env_id: str, kind: str,
                    m: dict[str, Any]) -> EpisodeSnapshot:
        """A snapshot from its arrays, its env and its ``progress()``."""
        return cls(
            env_id=env_id, kind=kind, sim_state=sim_state, obs=obs,
            elapsed_steps=m["elapsed_steps"], episode_return=float(m["episode_return"]),
            episode_length=int(m["episode_length"]), env_rng=m["env_rng"], noise_rng=m["noise_rng"],
        )


def episodes_to_bytes(snaps: Sequence[EpisodeSnapshot]) -> bytes:
    """One actor's unfinished episodes (at least one, all of one env and kind) as one payload:
    episode i's arrays as ``{i}.sim_state`` and ``{i}.obs``, the rest as JSON in the meta."""
    if not snaps or len({(s.env_id, s.kind) for s in snaps}) != 1:
        raise ValueError("episodes_to_bytes needs one or more episodes of one env")
    arrays: dict[str, np.ndarray] = {}
    for i, snap in enumerate(snaps):
        arrays[f"{i}.sim_state"], arrays[f"{i}.obs"] = snap.sim_state, np.asarray(snap.obs)
    meta = {"format": EPISODES_FORMAT, "env_id": snaps[0].env_id, "kind": snaps[0].kind,
            "episodes": json.dumps([s.progress() for s in snaps])}
    return dumps_tensors(arrays, meta)


def episodes_from_bytes(payload: bytes) -> list[EpisodeSnapshot]:
    """Parse ``episodes_to_bytes`` (or one ``EpisodeSnapshot.to_bytes``, which is one episode);
    SerializationError on anything malformed."""
    arrays, meta = loads_tensors(payload)
    if meta.get("format") == EPISODE_FORMAT:
        return [EpisodeSnapshot.from_bytes(payload)]
    if meta.get("format") != EPISODES_FORMAT:
        raise SerializationError(f"expected a {EPISODES_FORMAT!r} payload, got format {meta.get('format')!r}")
    try:
        progress = json.loads(meta["episodes"])
        return [EpisodeSnapshot.from_arrays(arrays[f"{i}.sim_state"], arrays[f"{i}.obs"], meta["env_id"],
                                            meta["kind"], m) for i, m in enumerate(progress)]
    except (KeyError, ValueError, TypeError) as exc:
        raise SerializationError(f"episode snapshots are incomplete: {exc}") from None


def _wrappers(env: gym.Env) -> list[gym.Wrapper]:
    chain: list[gym.Wrapper] = []
    while isinstance(env, gym.Wrapper):
        chain.append(env)
        env = env.env
    return chain


def _kind(env: gym.Env) -> str | None:
    unwrapped = env.unwrapped
    if hasattr(unwrapped, "ale"):
        return "atari"
    if hasattr(unwrapped, "model") and hasattr(unwrapped, "data") and type(unwrapped).__module__.startswith(
            "gymnasium.envs.mujoco"):
        return "mujoco"
    return None


def can_snapshot(env: gym.Env) -> bool:
    return _kind(env) is not None


def take_snapshot(env: gym.Env, env_id: str, obs: np.ndarray, episode_return: float, episode_length: int,
                  noise_rng: np.random.Generator) -> EpisodeSnapshot:
    """The episode in progress in ``env`` (which must pass ``can_snapshot``)."""
    kind = _kind(env)
    unwrapped: Any = env.unwrapped  # has model and data (MuJoCo) or ale (Atari), as _kind found
    sim: np.ndarray
    if kind == "mujoco":
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        sim = np.empty(mujoco.mj_stateSize(unwrapped.model, spec), dtype=np.float64)
        mujoco.mj_getState(unwrapped.model, unwrapped.data, sim, spec)
    elif kind == "atari":
        sim = np.frombuffer(unwrapped.ale.cloneState(include_rng=True).serialize(), dtype=np.uint8).copy()
    else:
        raise ValueError(f"cannot snapshot {env_id}: its state is not capturable")
    elapsed = next((w._elapsed_steps for w in _wrappers(env) if isinstance(w, gym.wrappers.TimeLimit)), None)
    return EpisodeSnapshot(
        env_id=env_id, kind=kind, sim_state=sim, obs=np.array(obs, copy=True),
        elapsed_steps=None if elapsed is None else int(elapsed), episode_return=float(episode_return),
        episode_length=int(episode_length), env_rng=dict(unwrapped.np_random.bit_generator.state),
        noise_rng=dict(noise_rng.bit_generator.state),
    )


def restore_snapshot(env: gym.Env, snap: EpisodeSnapshot) -> tuple[np.ndarray, np.random.Generator]:
    """Put ``env`` back into the snapshot's state; returns (observation, action-noise generator)."""
    kind = _kind(env)
    if kind != snap.kind:
        raise ValueError(f"snapshot of a {snap.kind} env cannot be restored into {kind or 'this'} env")
    env.reset()  # clears every wrapper's per-episode state; the simulator is overwritten below
    unwrapped: Any = env.unwrapped  # has model and data (MuJoCo) or ale (Atari), as _kind found
    if kind == "mujoco":
        import mujoco

        mujoco.mj_setState(unwrapped.model, unwrapped.data, np.asarray(snap.sim_state, dtype=np.float64),
                           mujoco.mjtState.mjSTATE_INTEGRATION)
        # The state sets positions and velocities, not what MuJoCo derives from them (body and
        # mass-centre positions), which would stay those of the reset above: Humanoid's and Ant's
        # next step reward their displacement from them (Humanoid's first reward after a restore
        # was -10.6 where the episode that never left gets -0.15). mj_forward recomputes them and
        # leaves the integration state, warm start included, as restored.
        mujoco.mj_forward(unwrapped.model, unwrapped.data)
    else:
        from ale_py import ALEState

        unwrapped.ale.restoreState(ALEState(np.asarray(snap.sim_state, dtype=np.uint8).tobytes()))
    for w in _wrappers(env):
        if isinstance(w, gym.wrappers.TimeLimit) and snap.elapsed_steps is not None:
            w._elapsed_steps = snap.elapsed_steps  # type: ignore[assignment]  # typed None by TimeLimit.__init__
        elif isinstance(w, gym.wrappers.FrameStackObservation):
            w.obs_queue = deque(np.array(snap.obs, copy=True), maxlen=w.stack_size)
        elif isinstance(w, gym.wrappers.AtariPreprocessing):
            w.lives = unwrapped.ale.lives()
            w.game_over = False
    unwrapped.np_random.bit_generator.state = snap.env_rng
    noise = np.random.default_rng()
    noise.bit_generator.state = snap.noise_rng
    return np.array(snap.obs, copy=True), noise


def take_game_snapshot(games: AtariGames, i: int, episode_return: float, episode_length: int,
                       noise_rng: np.random.Generator) -> EpisodeSnapshot:
    """The game in progress in slot ``i`` of ``games`` (ALE keeps no time-limit counter: the frame
    limit is part of the emulator's state)."""
    sim, env_rng = games.state(i)
    return EpisodeSnapshot(
        env_id=games.env_id, kind="atari", sim_state=sim, obs=games.obs[i].copy(), elapsed_steps=None,
        episode_return=float(episode_return), episode_length=int(episode_length), env_rng=env_rng,
        noise_rng=dict(noise_rng.bit_generator.state),
    )


def restore_game_snapshot(games: AtariGames, i: int, snap: EpisodeSnapshot) -> np.random.Generator:
    """Put slot ``i`` of ``games`` into the snapshot's state; returns its action-noise generator."""
    if snap.kind != "atari":
        raise ValueError(f"snapshot of a {snap.kind} env cannot be restored into an Atari game")
    games.restore(i, snap.sim_state, snap.obs, snap.env_rng)
    noise = np.random.default_rng()
    noise.bit_generator.state = snap.noise_rng
    return noise
