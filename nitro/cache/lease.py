"""One writer per run: a lease in the run's Redis, with a fencing token.

Two processes that resume the same run (two ``nitro resume``, or the Prefect UI's Retry while a
CLI resume still runs) would each invoke every actor, write the same checkpoints and log each
step to MLflow twice. ``acquire_lease`` lets exactly one through; the other gets ``RunHeld``, whose
one line names the holder (host, pid, since when) and what to do.

* Key ``nitro:{run}:lease``: a hash of ``token`` and ``holder`` (JSON: host, pid, pid namespace,
  the holder process's start time, since when), with a TTL of ``redis.lease_ttl_s`` (60 s by
  default). The holder renews it every third of that from a thread; a holder that died (kill -9)
  stops renewing, so the lease expires and the next resume takes it. A holder on this host, in
  this pid namespace, whose process is gone (or is another process with the same pid) is taken
  over at once: that is the resume after a crash on the same machine.
* Key ``nitro:{run}:lease:token``: the last fencing token handed out; each acquisition takes the
  next one, never below the token of the run's latest checkpoint (``floor``), so tokens only grow
  even if Redis lost the key.
* Fencing: ``RunLease.check()`` (an atomic compare of the token in Redis, renewing it) comes
  before every checkpoint, ledger and MLflow write; it raises ``LeaseLost`` once another writer
  holds the run. The token travels in what is written (the checkpoint's ``lease_token``, the
  MLflow run's ``nitro.lease_token`` tag), and a checkpoint is refused below the token of the one
  already on disk (``nitro.run.rundir``), which fences a writer that paused past its lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

import psutil

log = logging.getLogger("nitro")

_ACQUIRE = """
local held = redis.call('HGET', KEYS[1], 'token')
if held and held ~= ARGV[4] then
  return {0, held, redis.call('HGET', KEYS[1], 'holder'), redis.call('PTTL', KEYS[1])}
end
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local token = math.max(last, tonumber(ARGV[3])) + 1
redis.call('SET', KEYS[2], token, 'EX', 31536000)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'token', token, 'holder', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, tostring(token)}
"""
_RENEW = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RunHeld(RuntimeError):
    """Another live writer holds the run; ``str()`` is the one line to show."""


class LeaseLost(RuntimeError):
    """This process no longer holds its run's lease: it must not write; one line."""


def lease_key(run_id: str) -> str:
    return f"nitro:{run_id}:lease"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class Holder:
    """Who holds a run: enough to name it in one line and to tell, on its host, whether it lives."""

    host: str
    pid: int
    pidns: str
    process_started: float
    since: float

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), _pid_namespace(), psutil.Process().create_time(), time.time())

    @classmethod
    def from_json(cls, text: str | bytes) -> Holder:
        d = json.loads(text)
        return cls(str(d["host"]), int(d["pid"]), str(d["pidns"]), float(d["process_started"]), float(d["since"]))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"host {self.host}, pid {self.pid}, since {since}"

    def is_dead_here(self) -> bool:
        """True only when this host and pid namespace can tell: its process is gone or is another one."""
        if self.host != socket.gethostname() or self.pidns != _pid_namespace():
            return False
        try:
            return abs(psutil.Process(self.pid).create_time() - self.process_started) > 1.0
        except psutil.NoSuchProcess:
            return True


class RunLease:
    """A held lease: ``check`` before every write, ``release`` at the end (``close`` does both)."""

    def __init__(self, client, run_id: str, token: int, ttl_s: float):
        self.client, self.run_id, self.token, self.ttl_s = client, run_id, int(token), float(ttl_s)
        self._renew, self._release = client.register_script(_RENEW), client.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def renew(self) -> bool:
        """Extend the lease by its TTL if this token still holds it; False (and ``lost``) if not."""
        held = bool(int(self._renew(keys=[lease_key(self.run_id)], args=[self.token, int(self.ttl_s * 1000)])))
        self.lost = self.lost or not held
        return held

    def check(self) -> None:
        """Raise ``LeaseLost`` unless this process still holds the run (renewing it)."""
        if self.lost or not self.renew():
            holder = self.client.hget(lease_key(self.run_id), "holder")
            who = Holder.from_json(holder).describe() if holder else "nobody (it expired)"
            raise LeaseLost(f"run {self.run_id}: this process (lease token {self.token}) no longer holds the run; "
                            f"it is held by {who}; nothing more is written by this process")

    def start_renewing(self) -> RunLease:
        """Renew every third of the TTL from a daemon thread until ``release``."""
        def loop() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    if not self.renew():
                        log.error("run %s: the lease (token %d) was taken by another writer", self.run_id, self.token)
                        return
                except Exception as exc:  # Redis away: the next fenced write reports it
                    log.warning("run %s: could not renew the lease: %s", self.run_id, exc)

        self._thread = threading.Thread(target=loop, name=f"lease-{self.run_id}", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._release(keys=[lease_key(self.run_id)], args=[self.token])
        except Exception as exc:  # the lease then expires on its own
            log.warning("run %s: could not release the lease: %s", self.run_id, exc)


def acquire_lease(client, run_id: str, ttl_s: float, *, floor: int = 0, holder: Holder | None = None,
                  home_hint: str = "") -> RunLease:
    """Take the run's lease (token above ``floor``) or raise ``RunHeld`` naming its live holder."""
    holder = holder or Holder.this_process()
    script = client.register_script(_ACQUIRE)
    keys, ttl_ms = [lease_key(run_id), lease_key(run_id) + ":token"], int(ttl_s * 1000)
    got = script(keys=keys, args=[holder.to_json(), ttl_ms, int(floor), ""])
    if int(got[0]) == 0:
        held_token, other, pttl = got[1], Holder.from_json(got[2]), int(got[3])
        if not other.is_dead_here():
            raise RunHeld(f"run {run_id} is held by another writer: {other.describe()} (lease token "
                          f"{held_token.decode() if isinstance(held_token, bytes) else held_token}); wait for it to "
                          f"finish, or stop it and resume{home_hint} once its lease expires "
                          f"(in {max(pttl, 0) / 1000:.0f} s at most, {ttl_s:g} s after its last renewal)")
        log.warning("run %s: taking over the lease of %s, whose process is gone", run_id, other.describe())
        got = script(keys=keys, args=[holder.to_json(), ttl_ms, int(floor), held_token])
        if int(got[0]) == 0:
            raise RunHeld(f"run {run_id} was just taken by another writer: {Holder.from_json(got[2]).describe()}")
    return RunLease(client, run_id, int(got[1]), ttl_s)
