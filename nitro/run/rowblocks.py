"""Rows that only grow, stored once: a run's history and its ledger's rounds in its checkpoints.

A run's history gains a row every round and never changes an older one. Written whole into every
checkpoint, it made each checkpoint cost more than the last: with Humanoid's state, a save took
20 ms with 10 rounds of history, 164 ms with 1,000, 0.84 s with 5,000 and 3.3 s with 20,000 (a
week of 30 s rounds), against 18-32 ms at every size stored as below (bench/checkpoint_growth.py).
Each full block of ``ROWS_PER_BLOCK`` rows is written once, to ``checkpoints/rows/<sha256>.json``,
named by the SHA-256 of its bytes, and a checkpoint holds the names of its blocks and the rows
after them::

    {"__rows__": {"blocks": ["9f2c...", "41ab..."], "tail": [{"round": 128.0, ...}, ...]}}

* A block is on disk (fsync, rename) before the checkpoint that first names it, and the
  checkpoint's ``digest.json`` lists the blocks it names: checking a checkpoint checks its blocks
  (their bytes against their names), and pruning keeps every block a kept checkpoint names.
* Each block is written twice (``<sha256>.json`` and ``<sha256>.copy.json``). Checkpoints share a
  block where each had its own copy of the history before, so one damaged file must not damage
  them all; reading takes the copy whose bytes match the name.
* A resume that falls back to an older checkpoint and runs the rounds again writes the blocks
  whose rows differ under their own names; nothing is overwritten.
* Which blocks this process wrote is remembered by the rows' identity (the same row objects in the
  same order), so a checkpoint costs its tail and its new block, not the run's length. The rows
  handed in must therefore not change once a checkpoint has stored them, which is what a history
  is; a row's object replaced by another (a restored history) is written again, once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from nitro.run.durable import fsync_dir, write_bytes_durably
from nitro.run.treedata import split_tensors

ROWS = "__rows__"
ROWS_PER_BLOCK = 64
BLOCKS_FOLDER = "rows"
COPIES = ("", ".copy")  # each block is written twice: one damaged copy loses nothing


class RowBlocks:
    """One run's blocks folder, and the blocks this process has written or found there."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._known: dict[str, list[tuple[tuple[Any, ...], str]]] = {}  # key -> per block: (its rows, its name)
        self._swept = False  # whether ``collect`` has looked at every file in the folder yet
        self._remembered: dict[str, bytes] | None = None  # inside ``remembering``: the blocks read whole

    @contextlib.contextmanager
    def remembering(self) -> Iterator[None]:
        """Within it, each block is read and hashed once, however often it is asked for (a
        resume checks a checkpoint's blocks, then loads their rows); forgotten at its end."""
        self._remembered = {}
        try:
            yield
        finally:
            self._remembered = None

    def seal(self, key: str, rows: Sequence[Any]) -> tuple[dict, list[str]]:
        """``rows`` as a checkpoint stores them (the placeholder above) and the names of the blocks
        it names. Each full block not written yet for these rows is written now. Rows hold data
        only (numbers, strings, lists, dicts; numpy scalars become Python's), never tensors."""
        full = len(rows) // ROWS_PER_BLOCK
        known = self._known.setdefault(key, [])
        del known[full:]
        wrote = False
        for i in range(full):
            block = tuple(rows[i * ROWS_PER_BLOCK:(i + 1) * ROWS_PER_BLOCK])
            if i < len(known) and all(a is b for a, b in zip(known[i][0], block)):
                continue
            tensors: dict[str, Any] = {}
            data = json.dumps(split_tensors(list(block), tensors, f"{key}/block-{i}")).encode()
            if tensors:
                raise TypeError(f"{key}: rows stored in blocks hold data only, not tensors ({', '.join(tensors)})")
            name = hashlib.sha256(data).hexdigest()
            wrote |= self._write(name, data)
            entry = (block, name)
            if i < len(known):
                known[i] = entry
            else:
                known.append(entry)
        if wrote:
            fsync_dir(self.folder)
        names = [name for _, name in known]
        return {ROWS: {"blocks": names, "tail": list(rows[full * ROWS_PER_BLOCK:])}}, names

    def _paths(self, name: str) -> list[Path]:
        return [self.folder / f"{name}{copy}.json" for copy in COPIES]

    def _write(self, name: str, data: bytes) -> bool:
        """Both copies of the block on disk (written, or found whole); whether a file was written."""
        wrote = False
        for path in self._paths(name):
            try:
                if path.read_bytes() == data:
                    continue
            except FileNotFoundError:
                pass
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            write_bytes_durably(tmp, data)
            os.replace(tmp, path)
            wrote = True
        return wrote

    def read(self, name: str) -> bytes:
        """The block's bytes, from a copy that matches its name; ValueError if none does."""
        if self._remembered is not None and name in self._remembered:
            return self._remembered[name]
        reasons = []
        for path in self._paths(name):
            try:
                data = path.read_bytes()
            except OSError as exc:
                reasons.append(str(exc.strerror or exc).lower())
                continue
            if hashlib.sha256(data).hexdigest() == name:
                if self._remembered is not None:
                    self._remembered[name] = data
                return data
            reasons.append("does not match its name")
        raise ValueError(f"rows block {name[:12]} is damaged in both copies ({', '.join(reasons)})")

    def damage(self, name: str) -> str:
        """Why neither copy of the block is whole; "" when one is."""
        try:
            self.read(name)
        except ValueError as exc:
            return str(exc)
        return ""

    def resolve(self, tree: Any) -> Any:
        """``tree`` with each placeholder replaced by its rows, read from the blocks; ValueError
        if a block has no whole copy."""
        if isinstance(tree, dict):
            if set(tree) == {ROWS}:
                rows: list[Any] = []
                for name in tree[ROWS]["blocks"]:
                    rows.extend(json.loads(self.read(name)))
                return rows + [self.resolve(r) for r in tree[ROWS]["tail"]]
            return {k: self.resolve(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [self.resolve(v) for v in tree]
        return tree

    def named_by(self, checkpoints: Iterable[Path], digest_file: str) -> set[str] | None:
        """The blocks that ``checkpoints`` (folders, each with its ``digest_file``) name; None if
        a digest cannot be read (the blocks it names are unknown)."""
        named: set[str] = set()
        for folder in checkpoints:
            try:
                named.update(json.loads((folder / digest_file).read_text()).get("blocks", []))
            except FileNotFoundError:  # a checkpoint from before digests names no block
                continue
            except (OSError, ValueError, AttributeError, TypeError):
                return None
        return named

    def collect(self, named: set[str], candidates: set[str] | None) -> list[str]:
        """Delete the ``candidates`` (the blocks of deleted checkpoints) that are not ``named`` by
        a checkpoint still there; returns the names deleted. With ``candidates`` None, and on the
        first call, every block in the folder is a candidate, and what a stopped write left goes."""
        if not self.folder.is_dir():
            return []
        if candidates is None or not self._swept:
            self._swept = True
            candidates = set()
            for path in self.folder.iterdir():
                if path.name.startswith(".") and ".tmp-" in path.name:
                    if not path.name.endswith(f".tmp-{os.getpid()}"):
                        path.unlink(missing_ok=True)
                elif path.suffix == ".json":
                    candidates.add(path.name.split(".")[0])
        deleted = candidates - named
        for name in deleted:
            for path in self._paths(name):
                path.unlink(missing_ok=True)
        for known in self._known.values():  # a deleted block is written again if rows need it
            for i, (_, name) in enumerate(known):
                if name in deleted:
                    del known[i:]
                    break
        return sorted(deleted)
