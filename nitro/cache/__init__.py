"""The trajectory cache: real Redis, keyed by run and round, every key with a TTL, every wait with a deadline.

Connecting (TLS, ACL users, passwords that never appear in a message), running a local
``redis-server`` that a resumed run finds again, and the run's key layout (docs/ARCHITECTURE.md)
live in the submodules; import the public names from ``nitro.cache``.
"""

from nitro.cache.server import LocalRedisServer, TLSFiles, free_port, redis7_binary, redis_server_binary
from nitro.cache.trajectories import CollectResult, TrajectoryCache, batch_samples
from nitro.cache.urls import (
    CA_ENV,
    CERT_ENV,
    DEFAULT_PASSWORD_ENV,
    KEY_ENV,
    CacheError,
    CacheKeyMissingError,
    CacheUnavailableError,
    connect_redis,
    password_fingerprint,
    redact_url,
    strip_password,
)

__all__ = [
    "CA_ENV",
    "CERT_ENV",
    "DEFAULT_PASSWORD_ENV",
    "KEY_ENV",
    "CacheError",
    "CacheKeyMissingError",
    "CacheUnavailableError",
    "CollectResult",
    "LocalRedisServer",
    "TLSFiles",
    "TrajectoryCache",
    "batch_samples",
    "connect_redis",
    "free_port",
    "password_fingerprint",
    "redact_url",
    "redis7_binary",
    "redis_server_binary",
    "strip_password",
]
