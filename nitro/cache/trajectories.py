"""The trajectory cache: a run's keys in Redis, by round, every key with a TTL, every wait with a deadline.

``TrajectoryCache`` implements the key layout of docs/ARCHITECTURE.md::

    nitro:{run_id}:r{round:05d}:weights                   published once (SET NX)
    nitro:{run_id}:r{round:05d}:batch:{invocation_id}     one actor's batch (SET NX)
    nitro:{run_id}:r{round:05d}:done                      list of invocation ids (RPUSH / BLPOP)
    nitro:{run_id}:r{round:05d}:episode:{invocation_id}   the episode it left unfinished (nitro/actors/episodes.py)
    nitro:{run_id}:r{round:05d}:summary:{invocation_id}   its ActorSummary as JSON (billing a round that died)

(the braces are placeholders, not Redis hash tags). A batch write, its episode snapshot and its
RPUSH happen in one Lua script, so a duplicate delivery is neither stored nor enqueued twice.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field

import redis

from nitro.cache.urls import CacheKeyMissingError

# KEYS[1] batch key, KEYS[2] done list, KEYS[3] episode key (optional); ARGV[1] payload,
# ARGV[2] invocation id, ARGV[3] ttl (s), ARGV[4] episode snapshot (with KEYS[3]).
_PUT_BATCH_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) then
  if KEYS[3] then
    redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[3])
  end
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


def _stored(value: bytes | str | None) -> bytes | None:
    """A value as stored: the cache's clients never decode responses, so a str means a misbuilt client."""
    if isinstance(value, str):
        raise TypeError("the trajectory cache needs a Redis client with decode_responses=False")
    return value


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

    def episode_key(self, round_idx: int, invocation_id: str) -> str:
        return f"{self.round_prefix(round_idx)}:episode:{invocation_id}"

    def summary_key(self, round_idx: int, invocation_id: str) -> str:
        return f"{self.round_prefix(round_idx)}:summary:{invocation_id}"

    def started_key(self, round_idx: int, invocation_id: str) -> str:
        return f"{self.round_prefix(round_idx)}:started:{invocation_id}"

    # -- weights -------------------------------------------------------------------------------

    def publish_weights(self, round_idx: int, payload: bytes) -> str:
        """Write the round's weights once (SET NX EX); publishing the same round again is a no-op."""
        return self.publish_weights_once(round_idx, payload)[0]

    def publish_weights_once(self, round_idx: int, payload: bytes) -> tuple[str, bool]:
        """``publish_weights``, and whether these bytes were stored (False: an earlier attempt's stay)."""
        key = self.weights_key(round_idx)
        return key, bool(self.client.set(key, payload, nx=True, ex=self.ttl_s))

    def fetch_weights(self, key: str) -> bytes:
        data = _stored(self.client.get(key))
        if data is None:
            raise CacheKeyMissingError(f"weights key {key!r} is missing or expired (published? TTL {self.ttl_s}s?)")
        return data

    # -- batches -------------------------------------------------------------------------------

    def put_batch(self, round_idx: int, invocation_id: str, payload: bytes,
                  episode: bytes | None = None) -> tuple[str, bool]:
        """Store one actor's batch (and the snapshot of the episode it left unfinished, under
        ``episode_key``) and announce it, atomically. ``stored`` is False for a duplicate
        delivery: the first batch and snapshot stay and the id is not enqueued again."""
        key = self.batch_key(round_idx, invocation_id)
        keys = [key, self.done_key(round_idx)]
        args: list[bytes | str | int] = [payload, invocation_id, self.ttl_s]
        if episode is not None:
            keys.append(self.episode_key(round_idx, invocation_id))
            args.append(episode)
        stored = self._put_batch(keys=keys, args=args)
        return key, bool(int(stored))

    def fetch(self, key: str) -> bytes | None:
        """The value under a key this cache named (a batch, an episode snapshot); None if it expired."""
        return _stored(self.client.get(key))

    def get_batch(self, round_idx: int, invocation_id: str) -> bytes | None:
        return _stored(self.client.get(self.batch_key(round_idx, invocation_id)))

    # -- summaries -----------------------------------------------------------------------------

    def put_summary(self, round_idx: int, invocation_id: str, summary_json: str) -> None:
        """An actor's summary, kept so that a learner killed mid-round can still bill the
        invocation on resume (Lambda bills it whether or not the learner saw the answer)."""
        self.client.set(self.summary_key(round_idx, invocation_id), summary_json, ex=self.ttl_s)

    def mark_started(self, round_idx: int, invocation_id: str) -> None:
        """Note, just before it is invoked, that an invocation planned to start only when its
        inputs are ready did start: a resumed run bills it even without a summary, and never bills
        one that never started."""
        self.client.set(self.started_key(round_idx, invocation_id), b"1", ex=self.ttl_s)

    def started(self, round_idx: int, invocation_ids: list[str]) -> set[str]:
        """The ids among ``invocation_ids`` that ``mark_started`` marked."""
        out: set[str] = set()
        for i in range(0, len(invocation_ids), 64):
            chunk = invocation_ids[i : i + 64]
            values = self.client.mget([self.started_key(round_idx, x) for x in chunk])
            out.update(inv for inv, v in zip(chunk, values) if v is not None)
        return out

    def get_summaries(self, round_idx: int, invocation_ids: list[str]) -> dict[str, bytes]:
        """The stored summaries among ``invocation_ids`` (an id without one is left out)."""
        out: dict[str, bytes] = {}
        for i in range(0, len(invocation_ids), 64):
            chunk = invocation_ids[i : i + 64]
            values = self.client.mget([self.summary_key(round_idx, x) for x in chunk])
            out.update({inv: v for inv, v in zip(chunk, map(_stored, values)) if v is not None})
        return out

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
                for inv, data in zip(chunk, map(_stored, values)):
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
