"""The history and the ledger's rounds in shared blocks (nitro/run/rowblocks.py): what a checkpoint
writes as the run grows, what a resume reads back, and what damage and pruning do to the blocks."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import torch

from nitro.run.engine import APPEND_ONLY
from nitro.run.rowblocks import ROWS, ROWS_PER_BLOCK
from nitro.run.rundir import RunDir


def _row(k: int, tag: str = "a") -> dict:
    return {"round": float(k), "return": np.float32(k / 2), "eval": math.nan if k % 3 else float(k), "tag": tag}


def _cost(k: int) -> dict:
    return {"round_idx": k, "total": f"0.{k:04d}"}


class Run:
    """A run's checkpoints as ``checkpoint_run`` writes them: rows appended, save, prune."""

    def __init__(self, home, history=(), ledger=(), keep_last=3):
        self.dir = RunDir(home, "r")
        self.history, self.ledger, self.keep_last = list(history), list(ledger), keep_last

    def round(self, k: int, tag: str = "a") -> None:
        self.history.append(_row(k, tag))
        self.ledger.append(_cost(k))
        state = {"w": torch.full((4,), float(k)), "history": list(self.history),
                 "ledger": {"format": "x", "rounds": list(self.ledger)}}
        self.dir.save(k, state, eval_return=None, append_only=APPEND_ONLY)
        self.dir.prune(self.keep_last, 0)


def _blocks(home) -> dict[str, int]:
    """Each block file and the inode it was written to."""
    return {p.name: p.stat().st_ino for p in (home / "runs/r/checkpoints/rows").glob("*.json")}


def _expected(rounds, tag="a") -> list:
    return json.loads(json.dumps([{**_row(k, tag), "return": k / 2} for k in rounds]))


def test_each_block_is_written_once_and_a_checkpoint_holds_only_the_rows_after_its_blocks(tmp_path):
    run = Run(tmp_path)
    seen: dict[str, int] = {}
    for k in range(3 * ROWS_PER_BLOCK + 5):
        before = _blocks(tmp_path)
        run.round(k)
        after = _blocks(tmp_path)
        assert {n: i for n, i in after.items() if n in before} == before  # nothing rewritten
        assert len(after) - len(before) == (4 if (k + 1) % ROWS_PER_BLOCK == 0 else 0)  # 2 lists, 2 copies
        seen |= after
        tree = json.loads((run.dir.round_dir(k) / "state.json").read_text())
        assert len(tree["history"][ROWS]["tail"]) == (k + 1) % ROWS_PER_BLOCK
        assert len(tree["history"][ROWS]["blocks"]) == (k + 1) // ROWS_PER_BLOCK
    assert _blocks(tmp_path) == seen  # pruning deleted none: the newest checkpoint names them all
    k, state = RunDir(tmp_path, "r").load_newest_good()
    assert k == 3 * ROWS_PER_BLOCK + 4
    assert json.loads(json.dumps(state["history"])) == _expected(range(k + 1))
    assert state["ledger"] == {"format": "x", "rounds": [_cost(i) for i in range(k + 1)]}
    assert torch.equal(state["w"], torch.full((4,), float(k)))
    assert RunDir(tmp_path, "r").read_data(k)["history"][-1]["round"] == k  # without torch, as `nitro runs` reads it


def test_a_resumed_writer_reuses_the_blocks_on_disk(tmp_path):
    run = Run(tmp_path)
    for k in range(ROWS_PER_BLOCK + 3):
        run.round(k)
    before = _blocks(tmp_path)
    _, state = RunDir(tmp_path, "r").load()
    resumed = Run(tmp_path, state["history"], state["ledger"]["rounds"])  # new row objects, the same rows
    resumed.round(ROWS_PER_BLOCK + 3)
    assert _blocks(tmp_path) == before


def test_a_resume_and_a_verify_read_each_block_once(tmp_path, monkeypatch):
    """A resume checks the checkpoint's blocks, then loads their rows: each block's file is read
    once for both. ``verify`` reads a block that several checkpoints share once."""
    run = Run(tmp_path, keep_last=4)
    for k in range(2 * ROWS_PER_BLOCK + 3):
        run.round(k)
    reads: list[str] = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: (reads.append(p.name), read_bytes(p))[1])
    for resume in (lambda d: d.load(), lambda d: d.load_newest_good(), lambda d: d.verify()):
        reads.clear()
        resume(RunDir(tmp_path, "r"))
        blocks = [name for name in reads if name.endswith(".json")]
        assert len(blocks) == len(set(blocks)) == 4, reads  # 2 blocks of the history, 2 of the ledger


def test_one_damaged_copy_of_a_block_loses_nothing_and_two_make_the_resume_fall_back(tmp_path, caplog):
    run = Run(tmp_path, keep_last=5)
    for k in range(ROWS_PER_BLOCK + 2):
        run.round(k)
    name = json.loads((run.dir.round_dir(ROWS_PER_BLOCK + 1) / "digest.json").read_text())["blocks"][0]
    rows = tmp_path / "runs/r/checkpoints/rows"
    (rows / f"{name}.json").write_bytes(b"[]")
    assert all(c.ok for c in run.dir.verify())
    assert len(RunDir(tmp_path, "r").load()[1]["history"]) == ROWS_PER_BLOCK + 2
    (rows / f"{name}.copy.json").unlink()
    (check,) = [c for c in run.dir.verify() if c.round == ROWS_PER_BLOCK + 1]
    assert not check.ok and check.reason == (
        f"rows block {name[:12]} is damaged in both copies (does not match its name, no such file or directory)")
    with caplog.at_level(logging.WARNING, logger="nitro"):
        k, state = RunDir(tmp_path, "r").load_newest_good()
    # Every checkpoint that names the block is set aside; the one before the block was written is whole.
    assert k == ROWS_PER_BLOCK - 2 and len(state["history"]) == ROWS_PER_BLOCK - 1
    assert "falling back to round" in caplog.text


def test_a_resume_that_falls_back_writes_its_own_blocks_and_pruning_keeps_those_set_aside_checkpoints_name(tmp_path):
    run = Run(tmp_path, keep_last=2 * ROWS_PER_BLOCK)
    for k in range(2 * ROWS_PER_BLOCK + 1):
        run.round(k)
    first = _blocks(tmp_path)
    for k in range(ROWS_PER_BLOCK + 6, 2 * ROWS_PER_BLOCK + 1):  # the newer checkpoints damaged
        (run.dir.round_dir(k) / "state.json").write_text("{}")
    k, state = RunDir(tmp_path, "r").load_newest_good()
    assert k == ROWS_PER_BLOCK + 5
    resumed = Run(tmp_path, state["history"], state["ledger"]["rounds"], keep_last=3)
    for k in range(ROWS_PER_BLOCK + 6, 2 * ROWS_PER_BLOCK + 1):
        resumed.round(k, tag="b")  # the rounds run again, differently
    again = _blocks(tmp_path)
    assert set(first) < set(again)  # the set-aside checkpoints still name the first run's second block
    assert len(set(again) - set(first)) == 2  # the rerun's second history block, two copies (the ledger's is alike)
    newest = RunDir(tmp_path, "r").load()[1]["history"]
    rerun = range(ROWS_PER_BLOCK + 6, 2 * ROWS_PER_BLOCK + 1)
    assert newest == _expected(range(ROWS_PER_BLOCK + 6)) + _expected(rerun, "b")
    for aside in run.dir.checkpoints.glob("round-*.bad"):
        for path in aside.iterdir():
            path.unlink()
        aside.rmdir()
    # A user deletes the checkpoints set aside; the next writer's first prune looks at every block.
    Run(tmp_path, resumed.history, resumed.ledger, keep_last=3).round(2 * ROWS_PER_BLOCK + 1, tag="b")
    named = set(json.loads((run.dir.round_dir(2 * ROWS_PER_BLOCK + 1) / "digest.json").read_text())["blocks"])
    first_only = {n for n in first if n.split(".")[0] not in named}
    assert len(first_only) == 2 and set(_blocks(tmp_path)) == set(again) - first_only
