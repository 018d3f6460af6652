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

from nitro.config import ConfigError, NitroConfig
from nitro.run.failures import resume_command
from nitro.run.rundir import CheckpointError, RunDir
from nitro.run.stopping import stop_reason

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


def newest_good_state(run_dir: RunDir) -> tuple[int, dict] | None:
    """(round, state without its tensors) of the newest checkpoint that is whole, read without
    setting anything aside (``RunDir.load_newest_good`` does that, on resume)."""
    for k in reversed(run_dir.rounds()):
        if run_dir.check(k).ok:
            try:
                return k, run_dir.read_data(k)
            except CheckpointError:
                continue
    return None


def run_config(run_dir: RunDir) -> NitroConfig | None:
    try:
        return NitroConfig.from_yaml(run_dir.config_file)
    except (ConfigError, OSError):
        return None


def run_info(home: str | Path, run_id: str) -> RunInfo:
    run_dir = RunDir(home, run_id)
    path = run_dir.path
    modified = max((p.stat().st_mtime for p in path.rglob("*")), default=path.stat().st_mtime)
    config = run_config(run_dir)
    last = run_dir.latest_round()
    if last is None:
        return RunInfo(run_id, NOT_STARTED, 0, config.rounds if config else None, None, 0.0,
                       resume_command(run_id, home), modified)
    good = newest_good_state(run_dir)
    if good is None:
        return RunInfo(run_id, STOPPED, last + 1, config.rounds if config else None, None, 0.0,
                       resume_command(run_id, home), modified)
    state = good[1]
    history = state.get("history") or []
    done = config is not None and bool(history) and stop_reason(
        config, history[-1], int(state["next_round"]), int(history[-1].get("actors_launched", 1))) is not None
    return RunInfo(
        run_id, FINISHED if done else STOPPED, int(state["next_round"]), config.rounds if config else None,
        _last_return(history), _spent(state.get("ledger") or {}), None if done else resume_command(run_id, home),
        modified,
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
        lines.append(f"{r.run_id:<{width}}  {r.status:<11}  {rounds:>9}  {ret:>9}  {spend:>9}  "
                     f"{r.resume or ''}".rstrip())
    return "\n".join(lines)


def verify_run(home: str | Path, run_id: str) -> tuple[list[str], bool]:
    """``nitro verify``: each checkpoint of the run checked against its digest, one line each, and
    what a resume would do; (lines, whether every checkpoint is whole). Changes nothing."""
    run_dir = RunDir(home, run_id)
    run_dir.require_config()
    checks = run_dir.verify()
    lines = [f"round {c.round:>5}  {'ok' if c.ok else 'DAMAGED'}  {_size(c.bytes):>9}  {c.path}"
             + (f"  ({c.reason})" if not c.ok else "") for c in checks]
    good = [c.round for c in checks if c.ok]
    bad_newer = [c.round for c in checks if not c.ok and (not good or c.round > good[-1])]
    if not checks:
        lines.append("no checkpoint: a resume starts from round 0")
    elif bad_newer:
        lines.append(f"a resume sets aside round(s) {', '.join(map(str, bad_newer))} and continues after "
                     + (f"round {good[-1]}" if good else "nothing (round 0)"))
    else:
        lines.append(f"a resume continues after round {good[-1]}")
    def named(pattern: str) -> list[str]:
        return sorted(p.name for p in run_dir.checkpoints.glob(pattern)) if run_dir.checkpoints.is_dir() else []

    replaced = named(".round-*.replaced")
    if replaced:
        lines.append(f"an interrupted re-save left {', '.join(replaced)}: a resume restores or deletes it")
    aside = named("round-*.bad*")
    if aside:
        lines.append(f"set aside earlier: {', '.join(aside)}")
    return lines, all(c.ok for c in checks)


def run_status(home: str | Path, run_id: str) -> str:
    """``nitro status``: the run's state, its checkpoints and what they hold on disk, and the bound
    retention sets on it."""
    run_dir = RunDir(home, run_id)
    run_dir.require_config()
    info = run_info(home, run_id)
    config = run_config(run_dir)
    checks = run_dir.verify()
    rounds = f"{info.rounds_done}/{info.rounds}" if info.rounds is not None else str(info.rounds_done)
    ret = "-" if info.last_return is None else f"{info.last_return:.1f}"
    lines = [f"run {run_id}: {info.status}, {rounds} rounds, last return {ret}, spend ${info.spend_usd:.4f}"]
    if config is not None:
        keep = config.checkpoint
        sizes = [c.bytes for c in checks if c.ok]
        bound = (keep.keep_last + keep.keep_best) * (max(sizes) if sizes else 0)
        checkpoint_rounds = ", ".join(str(c.round) + ("" if c.ok else " (DAMAGED)") for c in checks) or "none"
        lines.append(f"checkpoints: rounds {checkpoint_rounds}"
                     f"; kept: the newest {keep.keep_last} and the best {keep.keep_best} by evaluation return "
                     f"(checkpoint.keep_last / keep_best), at most {_size(bound)} at their present size")
    lines.append(f"on disk: {_size(run_dir.disk_bytes())} in {run_dir.path}")
    if info.resume:
        lines.append(f"resume: {info.resume}")
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
