"""One local Redis per Nitro home, shared by every nitro process that opens a run there.

Without a configured Redis, a run keeps its trajectories (and its writer lease, nitro/cache/lease.py)
in a local ``redis-server`` persisted under ``<home>/redis``. Two servers on one data directory
would write one append-only file and each hold a different lease, so two resumers of one run
would both run. ``HomeRedis`` lets one process per home own the server: it holds an exclusive
``flock`` on ``<home>/redis/server.lock`` (released by the kernel when the process dies, even by
kill -9) and, once ``share`` is called, names the server in ``server.json``. Any other process
that opens the home waits (with a deadline) for that file and connects to the same server: a
second resumer then meets the first one's lease. The server stops with its owner, so a run that
uses another process's server stops (with the one-line Redis error and the resume command) when
that process ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import redis

from nitro.cache.server import LocalRedisServer
from nitro.cache.urls import CacheUnavailableError

LOCK_FILE, SERVER_FILE = "server.lock", "server.json"


class HomeRedis:
    """``with HomeRedis(data_dir) as home: home.url``; ``owner`` says whether this process started it."""

    def __init__(self, data_dir: str | os.PathLike, wait_s: float = 60.0):
        self.data_dir, self.wait_s = Path(data_dir).resolve(), float(wait_s)
        self.server: LocalRedisServer | None = None
        self.url = ""
        self._lock_fd: int | None = None

    @property
    def owner(self) -> bool:
        return self.server is not None

    def __enter__(self) -> HomeRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        while True:
            if self._try_lock():
                try:
                    self.server = LocalRedisServer(data_dir=self.data_dir).start()
                except BaseException:
                    self._unlock()
                    raise
                self.url = self.server.url
                return self
            url = self._shared_url()
            if url is not None:
                self.url = url
                return self
            if time.monotonic() > deadline:
                raise CacheUnavailableError(f"the local Redis of {self.data_dir} is owned by another nitro process "
                                            f"that did not share it within {self.wait_s:.0f}s")
            time.sleep(0.05)

    def share(self) -> None:
        """Name this process's server in ``server.json`` for the other processes of the home."""
        if self.server is not None:
            tmp = self.data_dir / f".{SERVER_FILE}.{os.getpid()}"
            tmp.write_text(json.dumps({"url": self.url, "pid": os.getpid()}))
            os.replace(tmp, self.data_dir / SERVER_FILE)

    def __exit__(self, *exc: object) -> None:
        if self.server is None:
            return
        try:
            (self.data_dir / SERVER_FILE).unlink(missing_ok=True)
            self.server.stop()
        finally:
            self.server = None
            self._unlock()

    def _try_lock(self) -> bool:
        fd = os.open(self.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _shared_url(self) -> str | None:
        """The URL in ``server.json`` if its owner is alive and the server answers."""
        try:
            record = json.loads((self.data_dir / SERVER_FILE).read_text())
            os.kill(int(record["pid"]), 0)
            client = redis.Redis.from_url(record["url"], socket_connect_timeout=0.5, socket_timeout=0.5)
            try:
                client.ping()
            finally:
                client.close()
            return str(record["url"])
        except (OSError, ValueError, KeyError, TypeError, redis.RedisError):
            return None
