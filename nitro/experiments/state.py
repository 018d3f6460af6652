"""The state of a cell, for resuming: from its checkpoints, its done marker and its saved config."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from nitro.config import RESOLVED, NitroConfig

DONE_MARKER = "experiment-cell-done.json"


def _checkpoint_state(config: NitroConfig, run_id: str) -> dict[str, Any] | None:
    from nitro.run.rundir import CheckpointError, RunDir

    if RunDir(config.home, run_id).latest_round() is None:
        return None
    try:
        return RunDir(config.home, run_id).load()[1]
    except CheckpointError:
        return None


def _history_stop(config: NitroConfig, state: Mapping[str, Any]) -> str | None:
    """The stop the engine reported after the checkpointed round (``nitro.run.engine.stop_reason`` on
    its history row; a budget stop is a round whose capped decision was 0 actors)."""
    from nitro.run.stopping import STOP_ROUNDS, stop_reason

    history = state.get("history") or []
    next_round = int(state.get("next_round", 0))
    if not history:
        return STOP_ROUNDS if next_round >= config.rounds else None
    last = history[-1]
    return stop_reason(config, last, next_round, int(last.get("actors_launched", 1)))


def cell_state(config: NitroConfig, run_id: str) -> tuple[str, int]:
    """("new" | "partial" | "done", rounds done) from the cell's checkpoints (and done marker)."""
    from nitro.run.rundir import RunDir

    state = _checkpoint_state(config, run_id)
    rounds = int(state["next_round"]) if state else 0
    if (RunDir(config.home, run_id).path / DONE_MARKER).exists():
        return "done", rounds
    if state is None:
        return "new", 0
    return ("done" if _history_stop(config, state) else "partial"), rounds


def mark_done(config: NitroConfig, run_id: str, result: Mapping[str, Any]) -> None:
    from nitro.run.rundir import RunDir

    path = RunDir(config.home, run_id).path / DONE_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(result), indent=2, default=str))


def mean_actors_per_round(config: NitroConfig, run_id: str) -> float | None:
    """Mean actors launched per round over the rounds that launched any (the budget-stop round
    launches none and is left out), from the run's latest checkpoint; None if there is none."""
    counts = actors_per_round(config, run_id)
    return sum(counts) / len(counts) if counts else None


def actors_per_round(config: NitroConfig, run_id: str) -> list[int] | None:
    """The actors launched in each round that launched any, from the run's latest checkpoint:
    what a replay cell replays. None without a checkpoint."""
    state = _checkpoint_state(config, run_id)
    return actors_launched(state.get("history") or []) if state else None


def actors_launched(history: Iterable[Mapping[str, Any]]) -> list[int]:
    """``actors_launched`` of the history rows that launched any, in round order."""
    rows = sorted(history, key=lambda r: float(r.get("round") or 0))
    return [int(r["actors_launched"]) for r in rows if float(r.get("actors_launched") or 0) > 0]


def mean_actors_launched(history: Iterable[Mapping[str, Any]]) -> float | None:
    """Mean ``actors_launched`` over the history rows that launched any; None if none did."""
    counts = actors_launched(history)
    return sum(counts) / len(counts) if counts else None


def saved_config_mismatch(config: NitroConfig, run_id: str) -> str | None:
    """A one-line reason when the cell's run directory holds a different config (the spec was
    edited after the cell started), else None."""
    from nitro.run.rundir import RunDir

    path = RunDir(config.home, run_id).config_file
    if not path.exists():
        return None
    old = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != RESOLVED}
    new = config.model_dump(mode="json", by_alias=True)
    diff = sorted(k for k in set(_flat(old)) | set(_flat(new)) if _flat(old).get(k) != _flat(new).get(k))
    if not diff:
        return None
    return (f"cell run {run_id} was started with a different config ({', '.join(diff[:4])}"
            f"{' ...' if len(diff) > 4 else ''}); rename the experiment or delete {path.parent}")


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out
