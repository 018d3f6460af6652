"""AWS Lambda entry point of a Nitro actor: ``actor_lambda.handler.handler``.

It runs exactly what a local worker process runs, ``nitro.run.functions.run_function``: a learner
function's gradient job (``kind: gradient``, ``nitro.stellaris.function``) or an actor's event.
For an actor: validate the ``ActorEvent``, fetch the round's weights from Redis, ``rollout``,
write the batch under the invocation id (SET NX, so a duplicate delivery is neither stored nor
enqueued twice) and return the small ``ActorSummary`` as JSON.

* Warm invocations reuse the module-level ``STATE`` (``ActorState``): the Redis connection pool
  per URL, the env and the policy module per env id, the last decoded weights.
* A bad event (missing field, unknown env, negative seed, password in the URL, not a JSON object)
  gets a normal response ``{"ok": false, "error": "invalid event: <field>: <why>", ...}``: one
  line, never a stack trace. Failures inside the actor are reported the same way.
* ``cache_credentials={"secret_arn": ARN}`` is resolved here, with AWS Secrets Manager (cached for
  ``NITRO_SECRET_TTL_S`` seconds, default 900); ``{"env": VAR}`` reads the function's environment.
* ``NITRO_SIMULATE_DURATION_S`` (function environment; benchmarks only): instead of a rollout the
  handler waits that long and writes a small dummy batch (``meta.simulated = "true"``), so the
  fan-out of many invocations can be measured without CPU-bound rollouts.

Only a misconfigured function raises (an Unhandled function error, which Lambda counts in its
``Errors`` metric): e.g. an invalid ``NITRO_SIMULATE_DURATION_S``.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from typing import Any

os.environ.setdefault("MUJOCO_GL", "disable")  # nothing renders in an actor

# Heavy imports (gymnasium, the rollout) happen here, in Lambda's INIT phase, which runs ahead of
# traffic under provisioned concurrency; the first invocation then only builds the env. PyTorch is
# not among them unless ``NITRO_PRELOAD`` names it (below): an MLP policy's actor never needs it
# (docs/decisions.md, torch).
import nitro.actors.rollout  # noqa: F401  # imported for its import-time cost, paid in INIT
from nitro.actors.events import ActorEvent, ActorSummary
from nitro.actors.worker import ActorState, run_actor
from nitro.run.functions import run_function

SIMULATE_ENV = "NITRO_SIMULATE_DURATION_S"
SECRET_TTL_ENV = "NITRO_SECRET_TTL_S"
PRELOAD_ENV = "NITRO_PRELOAD"


class ConfigurationError(RuntimeError):
    """The function itself is misconfigured (its environment), not the event."""


def preload() -> tuple[str, ...]:
    """Import the modules ``NITRO_PRELOAD`` names (comma-separated), in INIT: PyTorch's networks
    for an image env's CNN, the learner function's modules for a Stellaris run. The deploy script
    sets it from the config it deploys for (``nitro.actors.preload.warm_modules_for``), so such a
    function's first invocation is as warm as a local pool's. A module that cannot be imported is
    a misconfigured function."""
    names = tuple(n.strip() for n in os.environ.get(PRELOAD_ENV, "").split(",") if n.strip())
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigurationError(f"{PRELOAD_ENV}: cannot import {name!r}: {exc}") from exc
    return names


PRELOADED = preload()


# -- credentials ---------------------------------------------------------------------------------

_SECRETS: dict[str, tuple[float, str]] = {}
_SECRETS_LOCK = threading.Lock()
_SM_CLIENT = None


def _secrets_client():
    global _SM_CLIENT
    if _SM_CLIENT is None:
        import boto3
        from botocore.config import Config

        _SM_CLIENT = boto3.client(
            "secretsmanager",
            config=Config(connect_timeout=3, read_timeout=5, retries={"mode": "standard", "max_attempts": 3}),
        )
    return _SM_CLIENT


def resolve_secret_arn(arn: str) -> str:
    """The Redis password held by the secret ``arn``: its SecretString, or the ``password`` field
    of a JSON SecretString (the shape RDS/ElastiCache rotation uses). Cached per warm container."""
    ttl = float(os.environ.get(SECRET_TTL_ENV, "900"))
    now = time.monotonic()
    with _SECRETS_LOCK:
        hit = _SECRETS.get(arn)
        if hit is not None and now - hit[0] < ttl:
            return hit[1]
    try:
        value = _secrets_client().get_secret_value(SecretId=arn)
    except Exception as exc:  # botocore errors carry the code; keep it to one line, no secret
        code = getattr(exc, "response", {}).get("Error", {}).get("Code") if hasattr(exc, "response") else None
        raise RuntimeError(f"cannot read secret {arn}: {code or type(exc).__name__}") from None
    text = value.get("SecretString")
    if text is None:
        raise RuntimeError(f"secret {arn} has no SecretString")
    password = text
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None
        if isinstance(doc, dict):
            if "password" not in doc:
                raise RuntimeError(f"secret {arn} is a JSON object without a 'password' field")
            password = str(doc["password"])
    with _SECRETS_LOCK:
        _SECRETS[arn] = (now, password)
    return password


# -- state kept across warm invocations ----------------------------------------------------------

STATE = ActorState(secret_resolver=resolve_secret_arn)


def _memory_mb(context: Any) -> int | None:
    try:
        return int(getattr(context, "memory_limit_in_mb", None) or os.environ["AWS_LAMBDA_FUNCTION_MEMORY_SIZE"])
    except (KeyError, TypeError, ValueError):
        return None


def _simulated_duration() -> float | None:
    raw = os.environ.get(SIMULATE_ENV)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"{SIMULATE_ENV}={raw!r} is not a number of seconds") from None
    if not (0 <= value <= 900):
        raise ConfigurationError(f"{SIMULATE_ENV}={raw!r} must be between 0 and 900 seconds")
    return value


def _coerce(event: Any) -> Any:
    if isinstance(event, (str, bytes)):  # a payload that was JSON-encoded twice
        try:
            return json.loads(event)
        except ValueError:
            return event
    return event


def _url_problem(event: Any) -> str | None:
    """A cache URL must not carry a secret: the event is logged and echoed; credentials are a reference."""
    if not isinstance(event, dict) or not isinstance(event.get("cache_url"), str):
        return None
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(event["cache_url"])
        has_password = bool(parts.password) or any(k.lower() in {"password", "pass", "auth", "token"}
                                                   for k, _ in parse_qsl(parts.query))
    except ValueError:
        return "invalid event: cache_url: not a valid URL"
    if has_password:
        return "invalid event: cache_url: must not contain a password; pass a cache_credentials reference instead"
    return None


def handler(event: Any, context: Any = None) -> dict[str, Any]:
    """Lambda entry point: an ``ActorEvent`` as a JSON object in, an ``ActorSummary`` dict out."""
    simulate = _simulated_duration()  # raises ConfigurationError: a function error, by design
    event = _coerce(event)
    memory = _memory_mb(context)
    problem = _url_problem(event)
    if problem is not None:
        raw = event.get("invocation_id")
        inv = raw if isinstance(raw, str) and raw else "unknown"
        return ActorSummary.failed(inv, problem, billed_ms=1, memory_mb=memory or 0).model_dump(mode="json")
    if simulate is not None:
        summary = simulate_actor(event, simulate, memory)
    else:
        summary = run_function(event, STATE, memory_mb=memory)
    return summary.model_dump(mode="json")


# -- simulate mode (benchmarks) ------------------------------------------------------------------


def simulate_actor(event: Any, duration_s: float, memory_mb: int | None) -> ActorSummary:
    """Validate like ``run_actor``, wait ``duration_s``, write a small valid dummy batch (zeros,
    four steps, the event's env's shapes)."""
    start = time.perf_counter()
    try:
        ev = event if isinstance(event, ActorEvent) else ActorEvent.model_validate(event)
    except Exception:
        # Same one-line message as the real actor gives for a bad event.
        return run_actor(event, STATE, memory_mb=memory_mb)
    time.sleep(max(0.0, duration_s - (time.perf_counter() - start)))
    try:
        import numpy as np

        from nitro.cache import TrajectoryCache
        from nitro.envs import env_spec
        from nitro.serialization import dumps_tensors

        password = STATE.resolve_password(ev.cache_credentials)
        cache = TrajectoryCache(STATE.redis_client(ev.cache_url, password), ev.run_id, ttl_s=ev.batch_ttl_s)
        # Shaped like the env's batches (the spec is cached per process), so that a learner can
        # train on simulated rounds: the orchestration benchmark runs whole rounds of them.
        spec = env_spec(ev.env_id)
        t = min(ev.n_steps, 4)
        obs_dtype = np.uint8 if spec.obs_dtype == "uint8" else np.float32
        batch = {
            "obs": np.zeros((t, *spec.obs_shape), obs_dtype),
            "actions": np.zeros((t, spec.action_dim), np.float32) if spec.continuous else np.zeros(t, np.int64),
            "logp": np.zeros(t, np.float32),
            "rewards": np.zeros(t, np.float32),
            "terminated": np.zeros(t, bool),
            "bootstrap_idx": np.array([t - 1], np.int64),
            "bootstrap_obs": np.zeros((1, *spec.obs_shape), obs_dtype),
        }
        meta = {"env_id": ev.env_id, "weights_version": ev.round, "invocation_id": ev.invocation_id,
                "format": "nitro.batch/1", "simulated": "true"}
        payload = dumps_tensors(batch, meta)
        key, _stored = cache.put_batch(ev.round, ev.invocation_id, payload)
    except Exception as exc:
        duration = time.perf_counter() - start
        return ActorSummary.failed(ev.invocation_id, f"{type(exc).__name__}: {exc}", duration_s=duration,
                                   billed_ms=int(duration * 1000) + 1, memory_mb=memory_mb or 0)
    duration = time.perf_counter() - start
    return ActorSummary(invocation_id=ev.invocation_id, ok=True, steps=t, duration_s=duration,
                        billed_ms=int(duration * 1000) + 1, batch_key=key, batch_bytes=len(payload),
                        memory_mb=memory_mb or 0)
