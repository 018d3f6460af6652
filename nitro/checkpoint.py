"""Per-round checkpoints of a training run, as data only (safetensors + JSON, never pickle).

A checkpoint is a nested state (dicts, lists, numbers, strings, tensors) such as a torch
optimizer's ``state_dict()``. Tensors go to ``state.safetensors``; the rest, with a placeholder
where each tensor was, goes to ``state.json``. Writing is atomic: a round directory appears only
once both files are complete, so a crash mid-write leaves the previous checkpoint as the latest.

Layout: ``<home>/runs/<run_id>/checkpoints/round-00007/{state.json,state.safetensors}``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

INFLIGHT_FILE = "inflight.json"
FENCE_FILE = "lease_token"  # the highest lease token that has written the run's checkpoints
_TENSOR = "__tensor__"
_INTKEYS = "__intkeys__"
_NDARRAY = "__ndarray__"


class CheckpointError(RuntimeError):
    pass


def _split(state: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(state, torch.Tensor):
        tensors[path] = state.detach().cpu().contiguous()
        return {_TENSOR: path}
    if isinstance(state, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(state))
        return {_NDARRAY: path}
    if isinstance(state, dict):
        if state and all(isinstance(k, int) for k in state):
            return {_INTKEYS: {str(k): _split(v, tensors, f"{path}/{k}") for k, v in state.items()}}
        return {str(k): _split(v, tensors, f"{path}/{k}") for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_split(v, tensors, f"{path}/{i}") for i, v in enumerate(state)]
    if isinstance(state, (np.integer, np.floating, np.bool_)):
        return state.item()
    return state


def _join(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        if set(tree) == {_NDARRAY}:
            return tensors[tree[_NDARRAY]].numpy()
        if set(tree) == {_INTKEYS}:
            return {int(k): _join(v, tensors) for k, v in tree[_INTKEYS].items()}
        return {k: _join(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_join(v, tensors) for v in tree]
    return tree


def run_dir(home: str | Path, run_id: str) -> Path:
    return Path(home) / "runs" / run_id


def checkpoint_dir(home: str | Path, run_id: str) -> Path:
    return run_dir(home, run_id) / "checkpoints"


def save_checkpoint(home: str | Path, run_id: str, round_idx: int, state: dict[str, Any]) -> Path:
    """Write the state of a completed round atomically; returns its directory."""
    root = checkpoint_dir(home, run_id)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{round_idx:05d}"
    tmp = root / f".round-{round_idx:05d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    tree = _split(state, tensors, "s")
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps(tree))
    if final.exists():  # a re-run of the same round (should not happen, but never leave two)
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def fence_token(home: str | Path, run_id: str) -> int:
    """The highest lease token that has written this run's checkpoints (0: none yet)."""
    try:
        return int((run_dir(home, run_id) / FENCE_FILE).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def save_fenced_checkpoint(home: str | Path, run_id: str, round_idx: int, state: dict[str, Any], token: int) -> Path:
    """``save_checkpoint`` by the holder of lease ``token`` (nitro/lease.py), which it records in
    the state; refused (CheckpointError) when a writer with a higher token has written the run."""
    newest = fence_token(home, run_id)
    if newest > token:
        raise CheckpointError(f"run {run_id}: checkpoint of round {round_idx} refused: lease token {token} is "
                              f"older than token {newest}, which has written this run since")
    path = run_dir(home, run_id) / FENCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if newest < token:
        path.write_text(str(int(token)))
    return save_checkpoint(home, run_id, round_idx, {**state, "lease_token": int(token)})


def latest_round(home: str | Path, run_id: str) -> int | None:
    root = checkpoint_dir(home, run_id)
    if not root.is_dir():
        return None
    rounds = [int(p.name.split("-")[1]) for p in root.glob("round-*") if (p / "state.json").exists()]
    return max(rounds) if rounds else None


def load_checkpoint(home: str | Path, run_id: str, round_idx: int | None = None) -> tuple[int, dict[str, Any]]:
    """Load the given round's state, or the latest one. Raises CheckpointError if there is none."""
    if round_idx is None:
        round_idx = latest_round(home, run_id)
        if round_idx is None:
            raise CheckpointError(f"run {run_id!r} has no checkpoint under {checkpoint_dir(home, run_id)}")
    path = checkpoint_dir(home, run_id) / f"round-{round_idx:05d}"
    try:
        tree = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "state.safetensors"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from None
    return round_idx, _join(tree, tensors)


def save_inflight(home: str | Path, run_id: str, round_idx: int, invocation_ids: list[str]) -> str:
    """Record, before any of them is invoked, the invocations round ``round_idx`` is about to
    start; returns the id of this attempt at the round. If the learner dies before the round's
    checkpoint, the resumed run bills these (Lambda bills them whether or not anyone waits for
    the answer); a checkpointed round makes the record stale (its round is below the next one)."""
    attempt = os.urandom(6).hex()
    path = run_dir(home, run_id) / INFLIGHT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"round": int(round_idx), "attempt": attempt, "invocations": list(invocation_ids)}))
    os.replace(tmp, path)
    return attempt


def load_inflight(home: str | Path, run_id: str) -> dict[str, Any] | None:
    """The last ``save_inflight`` record of a run ({round, attempt, invocations}), or None."""
    path = run_dir(home, run_id) / INFLIGHT_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"round", "attempt", "invocations"} <= set(record) else None


def prune_checkpoints(home: str | Path, run_id: str, keep: int) -> None:
    """Keep the newest ``keep`` round checkpoints."""
    root = checkpoint_dir(home, run_id)
    rounds = sorted(root.glob("round-*"))
    for old in rounds[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
