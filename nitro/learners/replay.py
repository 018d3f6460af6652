"""IMPACT's circular replay buffer, and its batches as checkpoint tensors.

Each stored batch is trained on at most K times (``replay_max_reuse``), counting the update in
which it arrived, then evicted; batches are handed out round-robin in arrival order; when the
buffer is full the oldest batch is overwritten. A checkpoint holds the buffer's bookkeeping always
and its batches only while they total at most a size limit (a full Hopper buffer is ~1 MB; Atari
frames are not): a learner resumed without them starts with an empty buffer and replays less than
an uninterrupted run would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nitro.validation import BatchError

log = logging.getLogger("nitro")


@dataclass
class _Entry:
    seq: int  # arrival number (0, 1, 2, ... over the buffer's life)
    uses: int  # times trained on so far
    batch: Mapping[str, np.ndarray]


class ReplayBuffer:
    """At most ``capacity`` batches; each is trained on at most ``max_reuse`` (K) times, then evicted.

    * ``add(batch, uses=0)``: store a batch that has already been trained on ``uses`` times (the
      learner adds a fresh batch with ``uses=1``: the update it arrived in is its first use). If
      that already reaches K it is not stored. When full, the OLDEST batch is overwritten (the
      circular buffer), counted in ``n_dropped`` if it still had uses left.
    * ``take(n)``: up to n distinct batches, round-robin in arrival order starting after the last
      batch handed out; each gets one use, and a batch reaching K uses is evicted
      (``n_exhausted``). Returns [] when the buffer is empty.
    * ``admits(batch)``: whether ``check`` (``nitro.validation.check_batch`` for the learner's env)
      accepts it; a batch that fails is never stored nor restored (``n_rejected``), so a bad batch
      cannot come back through replay.
    """

    def __init__(self, capacity: int, max_reuse: int, check: Callable[[Mapping[str, np.ndarray]], None] | None = None):
        if capacity < 1 or max_reuse < 1:
            raise ValueError("ReplayBuffer: capacity and max_reuse must be >= 1")
        self.capacity, self.max_reuse = int(capacity), int(max_reuse)
        self.check = check
        self.n_rejected = 0
        self._entries: list[_Entry] = []  # in arrival order
        self._next_seq = 0
        self._cursor = -1  # arrival number of the last batch handed out
        self.n_added = self.n_exhausted = self.n_dropped = self.n_replays = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def remaining_uses(self) -> int:
        return sum(self.max_reuse - e.uses for e in self._entries)

    def uses(self) -> list[tuple[int, int]]:
        """(arrival number, uses) of every stored batch, oldest first."""
        return [(e.seq, e.uses) for e in self._entries]

    def admits(self, batch: Mapping[str, np.ndarray]) -> bool:
        if self.check is None:
            return True
        try:
            self.check(batch)
        except BatchError as exc:
            self.n_rejected += 1
            log.warning("replay buffer: rejected a batch: %s", exc)
            return False
        return True

    def add(self, batch: Mapping[str, np.ndarray], uses: int = 0) -> int:
        """Store ``batch``; returns its arrival number, or -1 when ``check`` rejects it."""
        if not self.admits(batch):
            return -1
        seq = self._next_seq
        self._next_seq += 1
        self.n_added += 1
        if uses >= self.max_reuse:
            self.n_exhausted += 1
            return seq
        if len(self._entries) >= self.capacity:
            self._entries.pop(0)
            self.n_dropped += 1  # every stored batch has a use left (spent ones are evicted at once)
        self._entries.append(_Entry(seq, int(uses), batch))
        return seq

    def take(self, n: int) -> list[Mapping[str, np.ndarray]]:
        if n <= 0 or not self._entries:
            return []
        after = [e for e in self._entries if e.seq > self._cursor]
        before = [e for e in self._entries if e.seq <= self._cursor]
        chosen = (after + before)[:n]
        for e in chosen:
            e.uses += 1
            self.n_replays += 1
        self._cursor = chosen[-1].seq
        spent = {id(e) for e in chosen if e.uses >= self.max_reuse}
        self.n_exhausted += len(spent)
        self._entries = [e for e in self._entries if id(e) not in spent]
        return [e.batch for e in chosen]

    # -- checkpoints ------------------------------------------------------------------------------

    def bookkeeping(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity, "max_reuse": self.max_reuse, "entries": [list(u) for u in self.uses()],
            "next_seq": self._next_seq, "cursor": self._cursor, "n_added": self.n_added,
            "n_exhausted": self.n_exhausted, "n_dropped": self.n_dropped, "n_replays": self.n_replays,
        }

    def batches(self) -> dict[int, Mapping[str, np.ndarray]]:
        return {e.seq: e.batch for e in self._entries}

    def restore(self, book: dict[str, Any], batches: dict[int, dict[str, np.ndarray]] | None) -> int:
        """Inverse of ``bookkeeping``/``batches``. Entries whose batch is missing are dropped;
        returns how many uses were lost that way."""
        self._next_seq, self._cursor = int(book["next_seq"]), int(book["cursor"])
        for k in ("n_added", "n_exhausted", "n_dropped", "n_replays"):
            setattr(self, k, int(book[k]))
        self._entries, lost = [], 0
        for seq, uses in book["entries"]:
            if batches is not None and int(seq) in batches and self.admits(batches[int(seq)]):
                self._entries.append(_Entry(int(seq), int(uses), batches[int(seq)]))
            else:
                lost += self.max_reuse - int(uses)
        while len(self._entries) > self.capacity:
            self._entries.pop(0)
        return lost


def replay_tensors(buffer: ReplayBuffer, max_bytes: int) -> tuple[dict[str, torch.Tensor], bool, int]:
    """(``replay.{seq}.{key}`` tensors of the buffer's batches, whether they are included, their
    total size in bytes): none are included when they total more than ``max_bytes``."""
    stored = buffer.batches()
    nbytes = sum(np.asarray(a).nbytes for b in stored.values() for a in b.values())
    keep = nbytes <= int(max_bytes)
    tensors: dict[str, torch.Tensor] = {}
    if keep:
        for seq, b in stored.items():
            for key, arr in b.items():
                tensors[f"replay.{seq}.{key}"] = torch.from_numpy(np.ascontiguousarray(arr).copy())
    return tensors, keep, int(nbytes)


def replay_batches(tensors: Mapping[str, torch.Tensor]) -> dict[int, dict[str, np.ndarray]]:
    """Inverse of ``replay_tensors``: the stored batches by arrival number (other keys ignored)."""
    batches: dict[int, dict[str, np.ndarray]] = {}
    for k, v in tensors.items():
        if k.startswith("replay."):
            _, seq, key = k.split(".", 2)
            batches.setdefault(int(seq), {})[key] = v.cpu().numpy().copy()
    return batches
