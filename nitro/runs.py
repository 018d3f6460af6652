"""The runs under a home directory, read from their files alone (no Redis, no MLflow, no Prefect):
``nitro runs`` prints them, so a user whose run died finds its id and the command that resumes it.

A run directory (``<home>/runs/<run id>/``) holds ``config.yaml`` (written when the run opens)
and ``checkpoints/round-NNNNN/`` (one per completed round, whose state holds the per-round history
and the ledger). A run is

* ``finished`` when its last checkpoint's round stopped it (round limit, target reward, budget),
* ``stopped`` when it did not: it failed, was killed, or is running right now,
* ``not started`` when it has no checkpoint yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from nitro.checkpoint import CheckpointError, latest_round, load_checkpoint
from nitro.config import ConfigError, NitroConfig
from nitro.stopping import stop_reason
from nitro.failures import resume_command

FINISHED, STOPPED, NOT_STARTED = "finished", "stopped", "not started"


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    status: str
    rounds_done: int
    rounds: int | None
    last_return: float | None  # the last evaluation's mean return, else the last training return
    spend_usd: float
    resume: str | None  # the command that continues it; None when it finished
    modified: float  # when its directory last changed (for ordering)


def list_runs(home: str | Path) -> list[RunInfo]:
    """Every run under ``home``, oldest first."""
    root = Path(home) / "runs"
    dirs = [d for d in root.iterdir() if (d / "config.yaml").exists()] if root.is_dir() else []
    return sorted((run_info(home, d.name) for d in dirs), key=lambda r: (r.modified, r.run_id))


def run_info(home: str | Path, run_id: str) -> RunInfo:
    path = Path(home) / "runs" / run_id
    modified = max((p.stat().st_mtime for p in path.rglob("*")), default=path.stat().st_mtime)
    try:
        config: NitroConfig | None = NitroConfig.from_yaml(path / "config.yaml")
    except (ConfigError, OSError):
        config = None
    last = latest_round(home, run_id)
    if last is None:
        return RunInfo(run_id, NOT_STARTED, 0, config.rounds if config else None, None, 0.0,
                       resume_command(run_id, home), modified)
    try:
        _, state = load_checkpoint(home, run_id, last)
    except CheckpointError:
        return RunInfo(run_id, STOPPED, last + 1, config.rounds if config else None, None, 0.0,
                       resume_command(run_id, home), modified)
    history = state.get("history") or []
    done = config is not None and bool(history) and stop_reason(
        config, history[-1], int(state["next_round"]), int(history[-1].get("actors_launched", 1))) is not None
    return RunInfo(
        run_id, FINISHED if done else STOPPED, int(state["next_round"]), config.rounds if config else None,
        _last_return(history), _spent(state.get("ledger") or {}), None if done else resume_command(run_id, home), modified,
    )


def _last_return(history: list[dict]) -> float | None:
    for key in ("eval_return_mean", "train_return_mean"):
        values = [r[key] for r in history if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        if values:
            return float(values[-1])
    return None


def _spent(ledger: dict) -> float:
    rounds = ledger.get("rounds") or []
    return float(rounds[-1]["cumulative"]) if rounds else 0.0


def format_runs(runs: list[RunInfo]) -> str:
    """A table, one run a line; the resume command for those that did not finish."""
    if not runs:
        return "no runs"
    width = max(len(r.run_id) for r in runs)
    lines = [f"{'run':<{width}}  {'status':<11}  {'rounds':>9}  {'return':>9}  {'spend':>9}  resume"]
    for r in runs:
        rounds = f"{r.rounds_done}/{r.rounds}" if r.rounds is not None else str(r.rounds_done)
        ret = "-" if r.last_return is None else f"{r.last_return:.1f}"
        spend = f"${r.spend_usd:.4f}"
        lines.append(f"{r.run_id:<{width}}  {r.status:<11}  {rounds:>9}  {ret:>9}  {spend:>9}  {r.resume or ''}".rstrip())
    return "\n".join(lines)
