"""A run's folder, and its per-round checkpoints as data only (safetensors + JSON, never pickle).

``RunDir(home, run_id)`` owns ``<home>/runs/<run_id>/``::

    config.yaml                                the run's whole config, written when the run opens
    checkpoints/round-00007/state.json         one folder per kept round: the state as JSON with a
    checkpoints/round-00007/state.safetensors  placeholder where each tensor was, the tensors, and
    checkpoints/round-00007/digest.json        the SHA-256 of both and of its blocks (and its evaluation return)
    checkpoints/rows/<sha256>.json             64 rows of the history or the ledger, shared (nitro.run.rowblocks)
    checkpoints/round-00005.bad                a damaged checkpoint set aside by a resume (never deleted)
    checkpoints/.round-00007.replaced          round 7's previous copy while a resume re-saves it
    inflight.json                              the invocations of the round in flight (for billing)
    lease_token                                the highest lease token that has written checkpoints
    nitro.log                                  the CLI's log of the run

A checkpoint is a nested state (dicts, lists, numbers, strings, tensors) such as a torch
optimizer's ``state_dict()``. It is written file -> fsync -> digest -> fsync -> rename -> fsync of
the folder: a round's folder appears only complete and on disk, so a crash or a full disk mid-write
leaves the previous checkpoint as the newest. A resume checks the newest against its digest and
falls back to the newest good one (``load_newest_good``); ``prune`` keeps the newest ``keep_last``
and the ``keep_best`` by evaluation return.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nitro.run.crashes import crash_point
from nitro.run.durable import fsync_dir, sha256_of, write_bytes_durably, write_durably
from nitro.run.rowblocks import BLOCKS_FOLDER, RowBlocks
from nitro.run.treedata import join_tensors, split_tensors

if TYPE_CHECKING:
    import torch

log = logging.getLogger("nitro")

CONFIG_FILE = "config.yaml"
INFLIGHT_FILE = "inflight.json"
FENCE_FILE = "lease_token"
LOG_FILE = "nitro.log"
DIGEST_FILE = "digest.json"
DIGEST_FORMAT = "nitro.checkpoint/1"


class CheckpointError(RuntimeError):
    """A run or its checkpoint is missing or unreadable; the message is one line."""


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is unreadable: {' '.join(str(exc).split())[:200]}")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount); nothing partial was kept."""

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass(frozen=True)
class CheckpointCheck:
    """One checkpoint as ``verify`` found it."""

    round: int
    path: Path
    ok: bool
    reason: str  # why it is damaged ("" when ok)
    bytes: int
    eval_return: float | None


class RunDir:
    """One run's folder (see the module docstring)."""

    def __init__(self, home: str | Path, run_id: str):
        self.home = Path(home)
        self.run_id = run_id
        self.path = self.home / "runs" / run_id
        self.blocks = RowBlocks(self.checkpoints / BLOCKS_FOLDER)
        self._saved: dict[int, float | None] = {}  # round -> evaluation return, of checkpoints this writer wrote

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def log_file(self) -> Path:
        return self.path / LOG_FILE

    def round_dir(self, round_idx: int) -> Path:
        return self.checkpoints / f"round-{round_idx:05d}"

    def _replaced_dir(self, round_idx: int) -> Path:
        return self.checkpoints / f".round-{round_idx:05d}.replaced"

    def restore_replaced(self) -> list[int]:
        """Finish re-saves that stopped between their two renames: each round whose folder is gone
        (or has no ``state.json``) while its replaced folder is whole gets that folder back; a
        replaced folder beside a whole round is deleted. Returns the rounds restored."""
        restored = []
        for replaced in sorted(self.checkpoints.glob(".round-*.replaced")) if self.checkpoints.is_dir() else []:
            k = int(replaced.name[len(".round-"):-len(".replaced")])
            final = self.round_dir(k)
            if (final / "state.json").exists():
                shutil.rmtree(replaced, ignore_errors=True)
            elif (replaced / "state.json").exists():
                shutil.rmtree(final, ignore_errors=True)
                os.replace(replaced, final)
                restored.append(k)
        return restored

    # -- checkpoints --------------------------------------------------------------------------------

    def save(self, round_idx: int, state: dict[str, Any], token: int | None = None,
             eval_return: float | None = None, append_only: Sequence[str] = ()) -> Path:
        """Write the state of a completed round durably (the module docstring); returns its folder.
        With ``token`` (the writer's lease token, ``nitro.cache.lease``), the state records it and
        the write is refused (CheckpointError) when a writer with a higher token has written the
        run since. ``eval_return``: the round's evaluation return, which ``prune`` keeps the best
        by. ``append_only``: the paths ("history", "ledger/rounds") of lists that only grow at
        their end, stored in shared blocks (``nitro.run.rowblocks``). A write that fails
        (CheckpointWriteError) leaves no partial checkpoint behind."""
        if token is not None:
            newest = self.fence_token()
            if newest > token:
                raise CheckpointError(f"run {self.run_id}: checkpoint of round {round_idx} refused: lease token "
                                      f"{token} is older than token {newest}, which has written this run since")
            state = {**state, "lease_token": int(token)}
        final = self.round_dir(round_idx)
        tmp = self.checkpoints / f".round-{round_idx:05d}.tmp-{os.getpid()}"
        try:
            if token is not None and self.fence_token() < token:
                self.path.mkdir(parents=True, exist_ok=True)
                write_durably(self.path / FENCE_FILE, str(int(token)))
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            from safetensors.torch import save as safetensors_bytes

            blocks: list[str] = []
            for key in append_only:
                state = self._with_blocks(state, key, blocks)
            tensors: dict[str, torch.Tensor] = {}
            tree = split_tensors(state, tensors)
            # Serialised in memory and written by Python, so a full disk is an OSError with its errno.
            files = {"state.safetensors": safetensors_bytes(tensors), "state.json": json.dumps(tree).encode()}
            for name, data in files.items():
                write_bytes_durably(tmp / name, data)
                crash_point("mid-checkpoint", round_idx)
            if eval_return is not None and not math.isfinite(eval_return):
                eval_return = None
            digest = {"format": DIGEST_FORMAT, "round": int(round_idx), "eval_return": eval_return,
                      "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
                      "blocks": sorted(set(blocks))}
            write_bytes_durably(tmp / DIGEST_FILE, json.dumps(digest).encode())
            fsync_dir(tmp)
            if final.exists():
                # A re-save of the same round (a resume's bill): the old folder is renamed away, never
                # deleted first, so a stop between the two renames leaves it for a resume to restore.
                replaced = self._replaced_dir(round_idx)
                shutil.rmtree(replaced, ignore_errors=True)
                os.replace(final, replaced)
                os.replace(tmp, final)
                fsync_dir(self.checkpoints)
                shutil.rmtree(replaced, ignore_errors=True)
            else:
                os.replace(tmp, final)
                fsync_dir(self.checkpoints)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(exc.errno, f"checkpoint of round {round_idx} not written to {self.checkpoints}: "
                                                  f"{exc.strerror or exc}") from exc
        except BaseException:  # a stop (SIGTERM) mid-write leaves no temporary folder either
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._saved[round_idx] = eval_return
        return final

    def _with_blocks(self, state: dict[str, Any], key: str, blocks: list[str],
                     below: str | None = None) -> dict[str, Any]:
        """``state`` with the list at ``key`` (a path such as "ledger/rounds") stored as blocks and
        a tail, the blocks it names added to ``blocks``; ``state`` itself is not changed. ``below``:
        the part of ``key`` still to follow from ``state`` (all of it at first)."""
        head, _, rest = (key if below is None else below).partition("/")
        if not isinstance(state, dict) or head not in state:
            return state
        if rest:
            return {**state, head: self._with_blocks(state[head], key, blocks, rest)}
        stored, names = self.blocks.seal(key, state[head])
        blocks.extend(names)
        return {**state, head: stored}

    def fence_token(self) -> int:
        """The highest lease token that has written this run's checkpoints (0: none yet)."""
        try:
            return int((self.path / FENCE_FILE).read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def rounds(self) -> list[int]:
        """The rounds that have a checkpoint folder (damaged or not), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name[len("round-"):]) for p in self.checkpoints.glob("round-*")
                      if p.name[len("round-"):].isdigit() and (p / "state.json").exists())

    def latest_round(self) -> int | None:
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def check(self, round_idx: int) -> CheckpointCheck:
        """Whether round ``round_idx``'s checkpoint is whole: its files match their digest (a
        checkpoint written before digests existed: both files parse)."""
        path = self.round_dir(round_idx)
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0
        try:
            digest = json.loads((path / DIGEST_FILE).read_text())
        except FileNotFoundError:
            digest = None
        except (OSError, ValueError) as exc:
            return CheckpointCheck(round_idx, path, False, f"{DIGEST_FILE} unreadable: {exc}", size, None)
        if digest is None:  # written before digests: it is good if it loads
            try:
                self.read(round_idx)
            except CheckpointError as exc:
                return CheckpointCheck(round_idx, path, False, str(exc), size, None)
            return CheckpointCheck(round_idx, path, True, "", size, None)
        for name, expected in digest.get("files", {}).items():
            try:
                actual = sha256_of(path / name)
            except OSError as exc:
                return CheckpointCheck(round_idx, path, False, f"{name}: {exc.strerror or exc}", size, None)
            if actual != expected:
                return CheckpointCheck(round_idx, path, False, f"{name} does not match its digest", size, None)
        for name in digest.get("blocks", []):
            if reason := self.blocks.damage(name):
                return CheckpointCheck(round_idx, path, False, reason, size, None)
        return CheckpointCheck(round_idx, path, True, "", size, digest.get("eval_return"))

    def verify(self) -> list[CheckpointCheck]:
        """Every checkpoint of the run, checked (``nitro verify``), oldest first; a block that
        several checkpoints share is read once."""
        with self.blocks.remembering():
            return [self.check(k) for k in self.rounds()]

    def read(self, round_idx: int) -> dict[str, Any]:
        """Round ``round_idx``'s state as stored, unchecked; CheckpointError if it cannot be read."""
        from safetensors.torch import load_file

        path = self.round_dir(round_idx)
        tree = self._tree(round_idx)
        try:
            tensors = load_file(str(path / "state.safetensors"))
        except Exception as exc:  # safetensors raises its own error type for a damaged header
            raise _unreadable(path, exc) from None
        return join_tensors(tree, tensors)

    def read_data(self, round_idx: int) -> dict[str, Any]:
        """Round ``round_idx``'s state without its tensors (each keeps its placeholder): the
        history, the ledger and the counters, read without loading torch. Unchecked; CheckpointError
        if it cannot be read."""
        return join_tensors(self._tree(round_idx), None)

    def _tree(self, round_idx: int) -> Any:
        """Round ``round_idx``'s ``state.json`` with its blocks' rows in place: the state with a
        placeholder per tensor."""
        path = self.round_dir(round_idx) / "state.json"
        try:
            tree = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise _unreadable(path, exc) from None
        try:
            return self.blocks.resolve(tree)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _unreadable(path, exc) from None

    def load(self, round_idx: int | None = None) -> tuple[int, dict[str, Any]]:
        """(round, state) of the given round, or of the newest one, checked against its digest;
        CheckpointError if there is none or it is damaged."""
        if round_idx is None:
            round_idx = self.latest_round()
            if round_idx is None:
                raise CheckpointError(f"run {self.run_id!r} has no checkpoint under {self.checkpoints}")
        with self.blocks.remembering():  # the check reads each block, the load takes its rows
            checked = self.check(round_idx)
            if not checked.ok:
                raise CheckpointError(f"checkpoint {checked.path} is damaged: {checked.reason}")
            return round_idx, self.read(round_idx)

    def load_newest_good(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint that is whole, (round, state); each damaged one newer than it is
        set aside (renamed ``round-NNNNN.bad``, never deleted) with one line naming it and the round
        the run falls back to. None when the run has no checkpoint (or none whole)."""
        for k in self.restore_replaced():
            log.warning("run %s: the re-save of round %d's checkpoint was interrupted; its previous copy is "
                        "restored", self.run_id, k)
        for k in reversed(self.rounds()):
            with self.blocks.remembering():  # the check reads each block, the load takes its rows
                checked = self.check(k)
                if checked.ok:
                    try:
                        return k, self.read(k)
                    except CheckpointError as exc:
                        checked = CheckpointCheck(k, checked.path, False, str(exc), checked.bytes, None)
            aside = self.set_aside(k)
            older = [r for r in self.rounds() if r < k]
            log.warning("run %s: checkpoint of round %d is damaged (%s); set aside as %s; %s", self.run_id, k,
                        checked.reason, aside.name, f"falling back to round {older[-1]}" if older else
                        "no older checkpoint: the run starts from round 0")
        return None

    def set_aside(self, round_idx: int) -> Path:
        """Rename a damaged checkpoint out of the way (``round-NNNNN.bad``, then ``.bad-2``, ...)."""
        path = self.round_dir(round_idx)
        aside, n = path.with_name(path.name + ".bad"), 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.bad-{n}")
        os.replace(path, aside)
        return aside

    def prune(self, keep_last: int, keep_best: int = 0) -> list[int]:
        """Delete the checkpoints that are neither among the newest ``keep_last`` nor among the
        ``keep_best`` with the highest evaluation return, and any temporary folder a crashed write
        left, then the blocks no checkpoint names any more; returns the rounds deleted. The newest
        is always kept: a resume needs it. A checkpoint this writer wrote counts as whole without
        reading it again (a resume checks every checkpoint it loads)."""
        rounds = self.rounds()
        keep = set(rounds[-max(1, keep_last):])
        scored = [(ret, k) for k in rounds if k not in keep and (ret := self._return_if_whole(k)) is not None]
        keep |= {k for _, k in sorted(scored, reverse=True)[:keep_best]}
        deleted = [k for k in rounds if k not in keep]
        their_blocks = self.blocks.named_by(map(self.round_dir, deleted), DIGEST_FILE)
        for k in deleted:
            shutil.rmtree(self.round_dir(k), ignore_errors=True)
            self._saved.pop(k, None)
        mine = f".tmp-{os.getpid()}"
        for leftover in self.checkpoints.glob(".round-*.tmp-*") if self.checkpoints.is_dir() else []:
            if not leftover.name.endswith(mine):
                shutil.rmtree(leftover, ignore_errors=True)
        if not deleted:
            return deleted
        kept = [p for p in self.checkpoints.iterdir() if p.name.startswith("round-") or p.name.endswith(".replaced")]
        if (named := self.blocks.named_by(kept, DIGEST_FILE)) is not None:
            self.blocks.collect(named, their_blocks)
        return deleted

    def _return_if_whole(self, round_idx: int) -> float | None:
        checked = None if round_idx in self._saved else self.check(round_idx)
        return self._saved[round_idx] if checked is None else checked.eval_return if checked.ok else None

    def disk_bytes(self) -> int:
        """What the run's folder holds on disk, checkpoints set aside included."""
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else 0

    # -- the round in flight ------------------------------------------------------------------------

    def save_inflight(self, round_idx: int, invocation_ids: list[str], *, attempt: str | None = None,
                      if_started: Sequence[str] = ()) -> str:
        """Record, before any of them is invoked, the invocations round ``round_idx`` is about to
        start; returns the id of this attempt at the round (``attempt``: keep one already recorded
        for the round). If the learner dies before the round's checkpoint, the resumed run bills
        these (Lambda bills them whether or not anyone waits for the answer), and of
        ``if_started`` (invocations that start only once their inputs are ready, Stellaris's
        gradient jobs) those that answered or were marked started; a checkpointed round makes the
        record stale (its round is below the next one)."""
        attempt = attempt or os.urandom(6).hex()
        self.path.mkdir(parents=True, exist_ok=True)
        write_durably(self.path / INFLIGHT_FILE,
                      json.dumps({"round": int(round_idx), "attempt": attempt, "invocations": list(invocation_ids),
                                  "if_started": list(if_started)}))
        return attempt

    def inflight(self) -> dict[str, Any] | None:
        """The last ``save_inflight`` record ({round, attempt, invocations, if_started}), or None."""
        try:
            record = json.loads((self.path / INFLIGHT_FILE).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and {"round", "attempt", "invocations"} <= set(record) else None

    # -- the config -----------------------------------------------------------------------------------

    def save_config(self, config_yaml: str) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(config_yaml)
        return self.path / CONFIG_FILE

    def require_config(self) -> Path:
        """The run's config file; CheckpointError naming the known runs when the run is unknown."""
        if not self.config_file.exists():
            runs = self.home / "runs"
            known = sorted(p.name for p in runs.glob("*") if (p / CONFIG_FILE).exists())
            hint = f"; known runs: {', '.join(known[-10:])}" if known else f"; no runs under {runs}"
            raise CheckpointError(f"unknown run id {self.run_id!r}{hint}")
        return self.path / CONFIG_FILE
