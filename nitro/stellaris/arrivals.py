"""A measured round's jobs as they start and land (``learner.schedule: measured``).

``Gate``: the FIFO start gate over the round's learner functions, in Redis, because both sides take
jobs from it: the round's lane tasks (the first job of each invocation) and the learner functions
themselves (each next job in line, inside the same invocation: ``nitro.stellaris.function.run_lane``).
A job is taken when it is next in line and fewer than ``lanes`` jobs are running; it is bound then
to the version published at that moment, beside the versions the running jobs hold (its live
ones). One Lua script does all of that at once, so two takers never get the same job or a
version that was superseded between reading and taking.

``InFlight``: what the parameter server's process knows of the round: the answers in the order they
came, each job as it was bound, and whether the server stopped waiting. Plain state, guarded by
``nitro.stellaris.round.StellarisLearning``'s lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nitro.cache import TrajectoryCache
from nitro.stellaris.jobs import GradientJob, actor_failed, pulling_invocation_id, snapshot_key

# KEYS: state (hash: next, published, closed, jobs), running (hash: job -> version), passed (set),
# bound (hash: job -> version), took (list: the jobs one invocation took). ARGV: job, lanes, ttl_s.
_TAKE = """
local state = redis.call('HMGET', KEYS[1], 'next', 'published', 'closed')
if state[3] == '1' then return {'closed'} end
local job = tonumber(ARGV[1])
if tonumber(state[1]) ~= job then return {'passed'} end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[2]) then return {'busy'} end
local live = redis.call('HVALS', KEYS[2])
redis.call('HSET', KEYS[2], job, state[2])
redis.call('HSET', KEYS[4], job, state[2])
redis.call('RPUSH', KEYS[5], job)
redis.call('SADD', KEYS[3], job)
local nxt = job
while redis.call('SISMEMBER', KEYS[3], nxt) == 1 do nxt = nxt + 1 end
redis.call('HSET', KEYS[1], 'next', nxt)
for i = 2, 5 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
return {'ok', state[2], unpack(live)}
"""

# KEYS: state, passed. ARGV: job, ttl_s. The job gives up: the jobs behind it no longer wait for it.
_PASS = """
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[2])
local nxt = tonumber(redis.call('HGET', KEYS[1], 'next'))
while redis.call('SISMEMBER', KEYS[2], nxt) == 1 do nxt = nxt + 1 end
redis.call('HSET', KEYS[1], 'next', nxt)
return nxt
"""


class Gate:
    """The start gate of one attempt at a measured round, under the round's prefix in the cache (so
    it carries the cache's TTL and is deleted with the round)."""

    def __init__(self, cache: TrajectoryCache, round_idx: int, attempt: str, lanes: int):
        self.cache, self.round, self.attempt, self.lanes = cache, round_idx, attempt, lanes
        base = f"{cache.round_prefix(round_idx)}:gate:{attempt}"
        self.state, self.running, self.passed, self.bound = (f"{base}:{part}" for part in
                                                              ("state", "running", "passed", "bound"))
        self.jobs_key = f"{base}:jobs"
        self._took = f"{base}:took:"
        client = cache.client
        self._take, self._pass = client.register_script(_TAKE), client.register_script(_PASS)

    def open(self, jobs: Sequence[GradientJob], version: int) -> None:
        """The round's jobs in FIFO order, none taken, ``version`` published."""
        pipe = self.cache.client.pipeline()
        pipe.delete(self.state, self.running, self.passed, self.bound, self.jobs_key)
        pipe.hset(self.state, mapping={"next": 0, "published": version, "closed": 0, "jobs": len(jobs)})
        if jobs:
            pipe.rpush(self.jobs_key, *(job.model_dump_json() for job in jobs))
        for key in (self.state, self.jobs_key):
            pipe.expire(key, self.cache.ttl_s)
        pipe.execute()

    def publish(self, version: int) -> None:
        self.cache.client.hset(self.state, "published", version)

    def close(self) -> None:
        """No job is taken any more: the parameter server stopped waiting."""
        self.cache.client.hset(self.state, "closed", 1)

    def next_job(self) -> int | None:
        """The first job that has neither been taken nor given up; None once every job has, or the
        gate closed."""
        raw_next, closed, jobs = self.cache.client.hmget(self.state, "next", "closed", "jobs")
        if raw_next is None or jobs is None or closed in (b"1", "1") or int(raw_next) >= int(jobs):
            return None
        return int(raw_next)

    def job(self, index: int) -> GradientJob:
        """The round's job ``index`` as planned (not yet bound)."""
        raw = self.cache.client.lindex(self.jobs_key, index)
        if raw is None:
            raise LookupError(f"gradient job {index} is not in the round's gate (expired?)")
        return GradientJob.model_validate_json(raw)

    def take(self, job: GradientJob, by: str) -> GradientJob | str:
        """``job`` bound to the published version if it is next in line and a learner function is
        free, recorded as taken by invocation ``by``; else why not: ``closed``, ``passed`` (the line
        is not at it: another taker has it, or it gave up) or ``busy`` (``lanes`` jobs are running)."""
        out = self._take(keys=[self.state, self.running, self.passed, self.bound, self._took + by],
                         args=[job.job, self.lanes, self.cache.ttl_s])
        status = _text(out[0])
        if status != "ok":
            return status
        version = int(out[1])
        live = sorted({int(v) for v in out[2:]} - {version})
        return job.model_copy(update={"snapshot_version": version, "snapshot_key": self.snapshot_key(version),
                                      "live_keys": [self.snapshot_key(v) for v in live]})

    def take_next(self, jobs: Sequence[GradientJob], wait_s: float, nap: Callable[[], None],
                  gave_up: Callable[[GradientJob, str], None]) -> GradientJob | None:
        """Block until the next job in line (of the round's ``jobs``) may start (its batch is in the
        cache and a learner function is free; ``nap`` between looks), take it for the invocation its
        lane starts for it and return it bound; None once every job is taken or given up, or the gate
        closed. A job that cannot start (its actor failed, or no batch or no free function within
        ``wait_s`` of its reaching the head of the line) gives up: it passes the gate, and
        ``gave_up`` gets it with the reason in one line."""
        head, since = -1, time.perf_counter()
        while (index := self.next_job()) is not None:
            job = jobs[index]
            if index != head:
                head, since = index, time.perf_counter()
            late = time.perf_counter() - since > wait_s
            reason = actor_failed(self.cache, job)
            if reason is None and self.cache.client.exists(job.batch_key):
                taken = self.take(job, by=pulling_invocation_id(self.cache.run_id, self.round, self.attempt, job.job))
                if not isinstance(taken, str) or taken == "closed":
                    return None if isinstance(taken, str) else taken
                if taken == "passed":
                    continue
                if late:  # busy all along
                    reason = f"gradient job not started: no learner function was free within {wait_s:g} s"
            elif reason is None and late:
                reason = f"gradient job not started: its batch was not in the cache within {wait_s:g} s"
            if reason is not None:
                self.give_up(index)
                gave_up(job, reason)
            else:
                nap()
        return None

    def give_up(self, job: int) -> None:
        self._pass(keys=[self.state, self.passed], args=[job, self.cache.ttl_s])

    def answered(self, job: int) -> int | None:
        """The job answered: its learner function is free (the function frees it with its answer,
        unless it failed first). Returns the version it was bound to; None if it never held a
        function. One round trip: the parameter server calls this for every answer."""
        pipe = self.cache.client.pipeline(transaction=False)
        pipe.hget(self.bound, job)
        pipe.hdel(self.running, job)
        raw, _ = pipe.execute()
        return None if raw is None else int(raw)

    def took(self, by: str) -> list[int]:
        """The jobs invocation ``by`` took, in order."""
        return [int(j) for j in self.cache.client.lrange(self._took + by, 0, -1)]

    def snapshot_key(self, version: int) -> str:
        return snapshot_key(self.cache, self.round, self.attempt, version)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class InFlight:
    """The round's answers in the order they came and, in a measured round (one with a ``gate``),
    each job as it was bound (read from the gate when its answer comes). Guarded by
    ``StellarisLearning._signal``."""

    gate: Gate | None = None
    started: dict[str, GradientJob] = field(default_factory=dict)  # invocation id -> the job as bound
    answers: list[str] = field(default_factory=list)  # invocation ids, in the order their answers came
    closed: bool = False  # the parameter server stopped waiting: no job starts any more
