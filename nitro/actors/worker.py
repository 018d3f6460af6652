"""The whole actor: ``run_actor(event, state) -> ActorSummary``.

Local worker processes (nitro/actors/local.py) and the Lambda handler (actor_lambda/handler.py)
both run exactly this. It validates the event, fetches the round's weights from the trajectory
cache, and then, by the event's mode:

* ``train``: restores the unfinished episodes the event names (``episode_key``, see
  ``nitro/actors/episodes.py``; an expired snapshot means fresh episodes, reported as
  ``continued=False``), rolls out with ``nitro.actors.rollout.rollout`` (an Atari actor over
  ``n_envs`` games), and writes the batch and the snapshots of the episodes it leaves unfinished
  under the invocation id;
* ``eval_deterministic`` / ``eval_stochastic``: plays whole episodes with ``nitro.actors.rollout.evaluate``
  and writes nothing;

and returns the small summary. It never raises: any failure becomes ``ActorSummary.failed`` with
a one-line reason (never a password, never a stack trace).

``ActorState`` is what survives across warm invocations of one process: Redis clients by URL,
envs and Atari games by env id, and the last weights (key and decoded arrays).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.config import validation_message

log = logging.getLogger(__name__)

WEIGHTS_FORMAT = "nitro.policy/1"
BATCH_FORMAT = "nitro.batch/1"


class CredentialsError(RuntimeError):
    """The event's credentials reference cannot be resolved."""


def _secret_arn_not_implemented(arn: str) -> str:
    raise NotImplementedError(
        "cache_credentials.secret_arn needs a secret resolver: set ActorState.secret_resolver "
        "(the Lambda handler installs one that reads AWS Secrets Manager)"
    )


@dataclass
class ActorState:
    """What one actor process keeps between invocations (a Lambda container or a local worker)."""

    memory_mb: int | None = None
    connect_timeout_s: float = 3.0
    # Hook for {"secret_arn": ARN} credentials: ARN -> password. The Lambda handler sets it.
    secret_resolver: Callable[[str], str] = _secret_arn_not_implemented
    clients: dict[tuple[str, str], Any] = field(default_factory=dict)  # (url, password tag) -> redis.Redis
    envs: dict[str, Any] = field(default_factory=dict)  # env id -> gymnasium env
    games: dict[str, Any] = field(default_factory=dict)  # Atari env id -> AtariGames a training rollout steps
    weights_key: str | None = None
    weights: dict[str, np.ndarray] | None = None
    weights_meta: dict[str, str] = field(default_factory=dict)
    snapshots: dict[str, Any] = field(default_factory=dict)  # learner functions: snapshot key -> decoded networks
    invocations: int = 0

    def redis_client(self, url: str, password: str | None):
        from nitro.cache import connect_redis, password_fingerprint

        key = (url, password_fingerprint(password))
        client = self.clients.get(key)
        if client is None:
            # password_env=None: the event's credentials reference is the only source here.
            client = connect_redis(url, password=password, timeout_s=self.connect_timeout_s, password_env=None,
                                   max_connections=8)
            self.clients[key] = client
        return client

    def resolve_password(self, credentials: dict[str, str]) -> str | None:
        """``{}`` -> no password; ``{"env": VAR}`` -> os.environ[VAR]; ``{"secret_arn": ARN}`` -> hook."""
        if not credentials:
            return None
        unknown = sorted(set(credentials) - {"env", "secret_arn"})
        if unknown or len(credentials) != 1:
            raise CredentialsError("cache_credentials must be {'env': VAR} or {'secret_arn': ARN}, "
                                   f"got keys {sorted(credentials)}")
        if "env" in credentials:
            var = credentials["env"]
            value = os.environ.get(var)
            if not value:
                raise CredentialsError(f"cache_credentials: environment variable {var!r} is not set")
            return value
        return self.secret_resolver(credentials["secret_arn"])

    def close(self) -> None:
        for client in self.clients.values():
            try:
                client.close()
                client.connection_pool.disconnect()
            except Exception:
                pass
        self.clients.clear()
        for env in [*self.envs.values(), *self.games.values()]:
            try:
                env.close()
            except Exception:
                pass
        self.envs.clear()
        self.games.clear()


def memory_mb_of(state: ActorState, memory_mb: int | None) -> int:
    """The memory an invocation is billed at: the caller's, the warm state's, else Lambda's own setting."""
    if memory_mb is not None:
        return int(memory_mb)
    if state.memory_mb is not None:
        return int(state.memory_mb)
    try:
        return int(os.environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "0"))
    except ValueError:
        return 0


def error_line(exc: BaseException) -> str:
    """An exception as one line with its type, for an ``ActorSummary``'s ``error``."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def run_actor(event: ActorEvent | dict[str, Any], state: ActorState | None = None, *,
              memory_mb: int | None = None) -> ActorSummary:
    """Fetch the weights, roll out, write the batch, summarise. Never raises."""
    start = time.perf_counter()
    state = state if state is not None else ActorState()
    mem = memory_mb_of(state, memory_mb)
    state.invocations += 1

    def failed(reason: str, inv: str) -> ActorSummary:
        return ActorSummary.since(inv, start, mem, error=reason)

    if isinstance(event, ActorEvent):
        ev = event
    else:
        raw_id = event.get("invocation_id") if isinstance(event, dict) else None
        inv = raw_id if isinstance(raw_id, str) and raw_id else "unknown"
        if not isinstance(event, dict):
            return failed(f"invalid event: expected a JSON object, got {type(event).__name__}", inv)
        try:
            ev = ActorEvent.model_validate(event)
        except ValidationError as exc:
            return failed(validation_message(exc, "event"), inv)

    cache = None
    try:
        from nitro.actors.episodes import episodes_from_bytes, episodes_to_bytes
        from nitro.actors.rollout import evaluate, games_for, rollout
        from nitro.cache import TrajectoryCache
        from nitro.envs import env_spec
        from nitro.models import Architecture
        from nitro.serialization import dumps_tensors, loads_tensors

        password = state.resolve_password(ev.cache_credentials)
        client = state.redis_client(ev.cache_url, password)
        cache = TrajectoryCache(client, ev.run_id, ttl_s=ev.batch_ttl_s)

        if state.weights_key != ev.weights_key or state.weights is None:
            arrays, meta = loads_tensors(cache.fetch_weights(ev.weights_key), expect_format=WEIGHTS_FORMAT)
            state.weights_key, state.weights, state.weights_meta = ev.weights_key, arrays, meta
        meta = state.weights_meta
        if meta.get("env_id") not in (None, ev.env_id):
            return _kept(cache, ev, failed(f"weights {ev.weights_key!r} are for env {meta.get('env_id')!r}, "
                                           f"the event asks for {ev.env_id!r}", ev.invocation_id))

        arch = Architecture.from_meta(meta.get("arch"))
        if ev.mode != "train":
            played = evaluate(state.weights, ev.env_id, ev.seed, ev.n_episodes, max_steps=ev.n_steps,
                              deterministic=ev.mode == "eval_deterministic", arch=arch,
                              env=_env(state, ev.env_id))
            return _kept(cache, ev, ActorSummary.since(
                ev.invocation_id, start, mem, steps=played.steps,
                episode_returns=[float(x) for x in played.episode_returns],
                episode_lengths=[int(x) for x in played.episode_lengths],
            ))

        resume = []
        if ev.episode_key is not None:
            stored_episode = cache.fetch(ev.episode_key)
            resume = episodes_from_bytes(stored_episode) if stored_episode is not None else []
            if resume and resume[0].env_id != ev.env_id:
                return _kept(cache, ev, failed(f"episode {ev.episode_key!r} is of env {resume[0].env_id!r}, "
                                               f"the event asks for {ev.env_id!r}", ev.invocation_id))
        if env_spec(ev.env_id).is_atari:
            env = state.games[ev.env_id] = games_for(ev.env_id, ev.n_envs, ev.n_steps, state.games.get(ev.env_id))
        else:
            env = _env(state, ev.env_id)
        result = rollout(state.weights, ev.env_id, ev.seed, ev.n_steps, n_envs=ev.n_envs, resume=resume,
                         arch=arch, env=env)

        version = meta.get("version", str(ev.round))
        batch_meta = {
            "env_id": ev.env_id,
            "weights_version": int(version) if str(version).lstrip("-").isdigit() else version,
            "invocation_id": ev.invocation_id,
            "format": BATCH_FORMAT,
            "run_id": ev.run_id,
            "round": ev.round,
            "seed": ev.seed,
        }
        payload = dumps_tensors(result.batch, batch_meta)
        carry = episodes_to_bytes(result.carry) if result.carry else None
        key, stored = cache.put_batch(ev.round, ev.invocation_id, payload, episode=carry)
        episode_key = cache.episode_key(ev.round, ev.invocation_id) if carry is not None else None
        if not stored:
            log.info("duplicate delivery of %s: batch already stored, not enqueued again", ev.invocation_id)
        summary = result.summary
        return _kept(cache, ev, ActorSummary.since(
            ev.invocation_id, start, mem,
            steps=int(summary.steps),
            episode_returns=[float(x) for x in summary.episode_returns],
            episode_lengths=[int(x) for x in summary.episode_lengths],
            batch_key=key,
            batch_bytes=len(payload),
            continued=bool(resume),
            episode_key=episode_key,
        ))
    except Exception as exc:  # the actor never raises: the invoker gets one line
        log.debug("actor %s failed", ev.invocation_id, exc_info=True)
        return _kept(cache, ev, failed(error_line(exc), ev.invocation_id))


def _kept(cache, ev: ActorEvent, summary: ActorSummary) -> ActorSummary:
    """``summary``, after leaving a copy in the cache: if the learner dies before it reads the
    answer, the resumed run still bills this invocation from it (nitro.run.engine, in-flight
    billing). Best effort: the answer itself is what counts, so a failed write is only logged."""
    if cache is not None:
        try:
            cache.put_summary(ev.round, ev.invocation_id, summary.model_dump_json())
        except Exception as exc:
            log.debug("actor %s: summary not kept in the cache: %s", ev.invocation_id, error_line(exc))
    return summary


def _env(state: ActorState, env_id: str):
    """The process's env of ``env_id`` (evaluation, and training on any env but Atari)."""
    from nitro.envs import make_env

    if env_id not in state.envs:
        state.envs[env_id] = make_env(env_id)
    return state.envs[env_id]
