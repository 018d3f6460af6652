"""Connecting to Redis: URL checks, password redaction, TLS and ACL options, the errors.

* ``connect_redis(url)`` opens a client (``redis://`` or ``rediss://`` with TLS, an ACL user in the
  URL, the password from the argument, the URL or ``NITRO_REDIS_PASSWORD``), pings once, and fails
  within a few seconds with ``CacheUnavailableError`` naming the URL *without* its password.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

DEFAULT_PASSWORD_ENV = "NITRO_REDIS_PASSWORD"
CA_ENV = "NITRO_REDIS_CA"
CERT_ENV = "NITRO_REDIS_CERT"
KEY_ENV = "NITRO_REDIS_KEY"

# Query parameters a Redis URL may carry (the rest are rejected with a clear message).
_URL_OPTIONS = {
    "db", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
    "ssl_check_hostname", "ssl_min_version", "socket_timeout", "socket_connect_timeout",
    "health_check_interval", "client_name", "max_connections",
}
_SECRET_QUERY = {"password", "pass", "auth", "token"}


class CacheError(RuntimeError):
    """Base class of trajectory-cache errors; messages are one line and never hold a password."""


class CacheUnavailableError(CacheError):
    """Redis cannot be reached, refuses our credentials, or fails the TLS handshake."""


class CacheKeyMissingError(CacheError, LookupError):
    """A key the caller relies on (e.g. a round's weights) is missing or has expired."""



def redact_url(url: str) -> str:
    """``url`` with any password (userinfo or query) replaced by ``***``; the user name stays."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        user, sep, _pw = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if sep else f"{user}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() in _SECRET_QUERY else v) for k, v in pairs], safe="/*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def strip_password(url: str) -> str:
    """``url`` with the password removed (the user name stays): what an actor event may carry."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, hostport = parts.netloc.rsplit("@", 1)
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{hostport}" if user else hostport
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 300 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def _connection_kwargs(url: str, password: str | None, password_env: str | None) -> dict[str, Any]:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: {one_line(exc)}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: scheme must be redis://, rediss:// or unix://")
    query = dict(parse_qsl(parts.query, keep_blank_values=False))
    bad = sorted(set(query) - _URL_OPTIONS)
    if bad:
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: unsupported option(s) {', '.join(bad)}")
    try:
        kwargs = redis.connection.parse_url(url)
    except ValueError as exc:
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: {one_line(exc)}") from None
    if password is None and not kwargs.get("password") and password_env:
        password = os.environ.get(password_env) or None
    if password is not None:
        kwargs["password"] = password
    if parts.scheme == "rediss":
        if "ssl_ca_certs" not in kwargs and os.environ.get(CA_ENV):
            kwargs["ssl_ca_certs"] = os.environ[CA_ENV]
        if "ssl_certfile" not in kwargs and os.environ.get(CERT_ENV):
            kwargs["ssl_certfile"] = os.environ[CERT_ENV]
        if "ssl_keyfile" not in kwargs and os.environ.get(KEY_ENV):
            kwargs["ssl_keyfile"] = os.environ[KEY_ENV]
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if name in kwargs and not os.path.exists(kwargs[name]):
                raise CacheUnavailableError(
                    f"cannot connect to {redact_url(url)}: {name} file not found: {kwargs[name]}")
    return kwargs


def connect_redis(
    url: str,
    password: str | None = None,
    timeout_s: float = 3.0,
    *,
    password_env: str | None = DEFAULT_PASSWORD_ENV,
    socket_timeout_s: float = 30.0,
    max_connections: int = 128,
    pool_timeout_s: float = 30.0,
) -> redis.Redis:
    """Open a pooled client for ``url`` and PING it once.

    * TLS: ``rediss://`` with ``ssl_ca_certs`` (and ``ssl_certfile``/``ssl_keyfile``,
      ``ssl_check_hostname``, ...) as URL query options, or the CA from ``NITRO_REDIS_CA``.
    * Auth: ``redis://user@host:port/0`` for an ACL user; the password comes from ``password``,
      else the URL, else the env var ``password_env``.
    * Timeouts: connecting and the first PING must finish within ``timeout_s`` (no retries), so
      an unreachable server fails fast with ``CacheUnavailableError``; later commands use
      ``socket_timeout_s`` and retry connection errors twice with jittered backoff.
    * Pool: a ``BlockingConnectionPool`` of ``max_connections`` (default 128, enough for 64
      threads plus BLPOP waiters); a thread waits at most ``pool_timeout_s`` for a connection.
    """
    shown = redact_url(url)
    kwargs = _connection_kwargs(url, password, password_env)
    kwargs.pop("max_connections", None)
    # A probe connection with no retries gives a hard bound on how long a dead server takes.
    probe_kwargs = {k: v for k, v in kwargs.items() if k not in ("connection_class",)}
    probe_kwargs.update(socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    probe = kwargs.get("connection_class", redis.Connection)(retry=Retry(NoBackoff(), 0), **probe_kwargs)
    start = time.monotonic()
    try:
        probe.connect()
        probe.send_command("PING")
        probe.read_response()
    except redis.AuthenticationError as exc:
        raise CacheUnavailableError(f"Redis at {shown} refused the credentials: {one_line(exc)}") from None
    except redis.ResponseError as exc:
        msg = one_line(exc)
        if "NOAUTH" in msg or "WRONGPASS" in msg or "AUTH" in msg.upper():
            raise CacheUnavailableError(f"Redis at {shown} refused the credentials: {msg}") from None
        raise CacheUnavailableError(f"Redis at {shown} answered PING with an error: {msg}") from None
    except (redis.RedisError, OSError, TypeError, ValueError) as exc:
        waited = time.monotonic() - start
        raise CacheUnavailableError(
            f"cannot connect to Redis at {shown} after {waited:.1f}s: {one_line(exc)}") from None
    finally:
        try:
            probe.disconnect()
        except Exception:
            pass
    pool_kwargs: dict[str, Any] = dict(
        socket_connect_timeout=timeout_s,
        socket_timeout=socket_timeout_s,
        socket_keepalive=True,
        health_check_interval=30,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 2),
    )
    pool_kwargs.update(kwargs)  # what the URL says explicitly wins
    pool = redis.BlockingConnectionPool(max_connections=max_connections, timeout=pool_timeout_s, **pool_kwargs)
    return redis.Redis(connection_pool=pool)


def password_fingerprint(password: str | None) -> str:
    """A short, non-reversible tag for a password (to key caches of clients without holding it)."""
    return "" if password is None else hashlib.sha256(password.encode()).hexdigest()[:16]
