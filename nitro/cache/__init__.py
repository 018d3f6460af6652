"""The trajectory cache: real Redis, keyed by run and round, every key with a TTL, every wait with a deadline.

One module per job:

* ``nitro.cache.urls``: ``connect_redis(url)`` opens a client (``redis://`` or ``rediss://`` with
  TLS, an ACL user in the URL, the password from the argument, the URL or ``NITRO_REDIS_PASSWORD``),
  pings once, and fails within a few seconds with ``CacheUnavailableError`` naming the URL
  *without* its password; ``redact_url``, ``strip_password``, the errors.
* ``nitro.cache.server``: ``LocalRedisServer`` runs the real ``redis-server`` binary on a free
  127.0.0.1 port with AOF persistence in a data directory, so a resumed run finds its
  trajectories. It is stopped on exit and never leaks.
* ``nitro.cache.trajectories``: ``TrajectoryCache``, the key layout of docs/ARCHITECTURE.md.

Import the public names from ``nitro.cache``.
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
