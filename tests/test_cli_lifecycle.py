"""The `nitro` command as a user runs it, in a subprocess, with its own local Redis and its own
actor workers: what it says when it starts, what it says when a component dies under it, what it
leaves behind when it is killed, how it resumes, and `nitro runs`.

The test of a ``kill -9`` runs `nitro` as a user does with no Prefect server configured: it starts
its own temporary Prefect API, which must die with it. The others are not about that server: they
point `nitro` at the session's Prefect API (``PREFECT_API_URL``, the ``prefect_api`` fixture), as a
user with a `prefect server` does, instead of starting one per command.

A test kills only processes that descend from the `nitro` process it started itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.run.rundir import RunDir
from nitro.tracking.metrics import ROUND_METRICS
from tests.support.templates import nitro_home, prefect_home

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 3  # a round before the one killed (or cut off) and one after it


def _env(tmp_path: Path, api: str | None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "NITRO_REDIS_URL", "MLFLOW_TRACKING_URI")
    }
    env["PREFECT_HOME"] = str(prefect_home(tmp_path / "prefect"))  # without ``api``: its temporary server's database
    if api:
        env["PREFECT_API_URL"] = api
    return env


def _config(home: Path) -> list[str]:
    return [f"rounds={ROUNDS}", "steps_per_actor=256", "scaler.name=fixed", "scaler.fixed_actors=2",
            "backend.workers=2", "detector.subset_size=64", "eval.every_rounds=0", "round_deadline_s=20",
            f"home={nitro_home(home)}"]


def _nitro(tmp_path: Path, *args: str, api: str | None = None) -> subprocess.Popen:
    """`nitro <args>` against the Prefect API ``api``; without one, `nitro` starts its own temporary one."""
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=tmp_path, env=_env(tmp_path, api),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"nitro did not finish in {timeout_s:.0f}s\n{out}\n{err[-3000:]}")
    return proc.returncode, out, err


def _kill_tree(proc: subprocess.Popen) -> None:
    """Clean-up after a failed test: this process and what descends from it, nothing else."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"nitro exited ({proc.returncode}) before {what}\n{out}\n{err[-3000:]}")
        time.sleep(0.01)
    _kill_tree(proc)
    out, err = proc.communicate()  # what the run said it was doing: the next failure says where it was
    pytest.fail(f"timed out waiting for {what} ({timeout_s:.0f} s)\n{out[-2000:]}\n{err[-3000:]}")


def _inflight_round(home: Path, run_id: str) -> int | None:
    try:
        return int(json.loads((RunDir(home, run_id).path / "inflight.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return None


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _kill_mid_round_1(proc: subprocess.Popen, home: Path, run_id: str, grace_s: float,
                      within_s: float = 240.0) -> str:
    """SIGKILL a `nitro train` while round 1's invocations are in flight (they are recorded just
    before they are invoked, at most ``within_s`` after the start), assert that every process it
    started dies within ``grace_s``, and return their names as they were before the kill."""
    try:
        _wait_for(lambda: _inflight_round(home, run_id) == 1, proc, "round 1's invocations", within_s)
        started = _descendants(proc)
        names = _names(started)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=grace_s)
        assert not alive, f"still running after the CLI was killed: {_names(alive)}"
        return names
    finally:
        _kill_tree(proc)


def _names(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(" ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            pass
    return "; ".join(out)


def _one_mlflow_run_with_one_value_per_step(home: Path) -> str:
    client = MlflowClient(tracking_uri=f"sqlite:///{home.resolve()}/mlflow.db")
    exp_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    runs = client.search_runs(exp_ids, run_view_type=ViewType.ALL)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    for name in ROUND_METRICS:
        steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, name)]
        assert sorted(steps) == list(range(ROUNDS)), (name, steps)
    return runs[0].info.run_id


def test_train_says_where_the_run_is_and_runs_lists_it(tmp_path, prefect_api):
    home = tmp_path / "home"
    code, out, err = _finish(_nitro(tmp_path, "train", *_config(home), "rounds=1", api=prefect_api))
    assert code == 0, err[-3000:]
    lines = out.splitlines()
    run_id = lines[0].removeprefix("nitro: starting run ")
    assert run_id.startswith("run-") and len(run_id) == 16, lines[0]
    assert f"state:  {home}/runs/{run_id}" in out and f"resume: nitro resume {run_id} --home {home}" in out
    assert "started a local Redis" in (RunDir(home, run_id).log_file).read_text()

    code, out, _ = _finish(_nitro(tmp_path, "runs", "--home", str(home)))
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["run", "status", "rounds", "return", "spend", "resume"]
    assert row.split()[:3] == [run_id, "finished", "1/1"] and "nitro resume" not in row


def test_sigkill_mid_round_leaves_nothing_behind_and_resume_bills_the_round(tmp_path):
    home, run_id = tmp_path / "home", "killed"
    names = _kill_mid_round_1(_nitro(tmp_path, "train", "--run-id", run_id, *_config(home)), home, run_id, grace_s=10)
    assert "redis-server" in names and "uvicorn" in names and "nitro.actors.local" in names, names
    killed_round = _inflight_round(home, run_id)
    assert killed_round == 1 and not (RunDir(home, run_id).checkpoints / "round-00001").exists()

    code, out, _ = _finish(_nitro(tmp_path, "runs", "--home", str(home)))
    row = next(line for line in out.splitlines() if line.startswith(run_id))
    assert row.split()[1:3] == ["stopped", f"1/{ROUNDS}"] and row.endswith(f"nitro resume {run_id} --home {home}")

    code, out, err = _finish(_nitro(tmp_path, "resume", run_id, "--home", str(home)))
    assert code == 0, err[-3000:]
    assert f"{ROUNDS} rounds" in out
    _one_mlflow_run_with_one_value_per_step(home)
    _, state = RunDir(home, run_id).load()
    interrupted = [r for r in state["ledger"]["rounds"] if r["interrupted"]]
    assert [(r["round_idx"], r["n_requests"]) for r in interrupted] == [(1, 2)], interrupted
    assert float(interrupted[0]["total"]) > 0
    spends = [r["spend_round_usd"] for r in state["history"]]
    assert float(state["ledger"]["rounds"][-1]["cumulative"]) == pytest.approx(sum(spends))


def _redis_of(proc: subprocess.Popen) -> psutil.Process | None:
    for p in _descendants(proc):
        try:
            if "redis-server" in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            pass
    return None


def test_a_prefect_database_the_temporary_server_cannot_open_ends_in_one_line_at_once(tmp_path):
    """Its server's start failing for another reason than its port is reported with the reason
    (Prefect's own start would try again until its 90 s timeout), and the run set up beside it
    closes with nothing left running."""
    env = _env(tmp_path, None)
    env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{tmp_path}/no-such-dir/prefect.db"
    argv = [sys.executable, "-m", "cli.main", "train", "--run-id", "no-db", *_config(tmp_path / "home")]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, psutil.Process] = {}  # its server, Redis and actor workers, as they come
    names: set[str] = set()
    while proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            children = _descendants(proc)
            seen.update((p.pid, p) for p in children)
            # every poll: a child caught between fork and exec still shows its parent's command line
            names.update(_names(children).split("; "))
        time.sleep(0.05)
    code, _out, err = _finish(proc, timeout_s=60)
    line = err.strip().splitlines()[-1]
    assert code == 1 and line.startswith("nitro: error: Prefect API failed:"), err[-3000:]
    assert "unable to open database file" in line and "temporary-server.log" in line, line
    started = " ".join(names)
    assert "uvicorn" in started and "redis-server" in started, names  # the run set up beside the server's start
    assert not [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], names


def test_redis_dying_mid_run_ends_in_one_line_and_the_run_resumes(tmp_path, prefect_api):
    home, run_id = tmp_path / "home", "redis-died"
    proc = _nitro(tmp_path, "train", "--run-id", run_id, *_config(home), api=prefect_api)
    try:
        _wait_for(lambda: (RunDir(home, run_id).checkpoints / "round-00000").exists(), proc, "round 0's checkpoint")
        redis = _redis_of(proc)
        assert redis is not None
        redis.kill()
        code, out, err = _finish(proc, timeout_s=120)
    finally:
        _kill_tree(proc)
    assert code == 1
    lines = err.strip().splitlines()
    last = lines[-1]
    assert last.startswith("nitro: error: Redis at redis://127.0.0.1:"), last
    assert f"Resume with: nitro resume {run_id} --home {home}" in last and "Traceback" not in err
    assert len(lines) <= 20, err  # no pages of tracebacks: those are in the run's log file
    assert "Traceback" in (RunDir(home, run_id).log_file).read_text()

    code, out, err = _finish(_nitro(tmp_path, "resume", run_id, "--home", str(home), api=prefect_api))
    assert code == 0, err[-3000:]
    assert f"{ROUNDS} rounds" in out
    _one_mlflow_run_with_one_value_per_step(home)


def test_two_resumers_started_together_one_runs_the_other_names_the_holder(tmp_path, prefect_api):
    home, run_id = tmp_path / "home", "two-resumers"
    proc = _nitro(tmp_path, "train", "--run-id", run_id, *_config(home), api=prefect_api)
    try:
        _wait_for(lambda: _inflight_round(home, run_id) == 1, proc, "round 1's invocations")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _kill_tree(proc)
    resumers = [_nitro(tmp_path, "resume", run_id, "--home", str(home), api=prefect_api) for _ in range(2)]
    try:
        finished = [_finish(p) for p in resumers]
    finally:
        for p in resumers:
            _kill_tree(p)
    codes = sorted(code for code, _, _ in finished)
    assert codes[0] == 0 and codes[1] != 0, [(c, e[-2000:]) for c, _, e in finished]
    (winner,) = [p for p, (code, _, _) in zip(resumers, finished) if code == 0]
    (_, _, err), = [f for f in finished if f[0] != 0]
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith(f"nitro: error: run {run_id} is held by another writer: host ")
        and f"pid {winner.pid}, since" in last
    ), last
    assert f"nitro resume {run_id} --home {home}" in last and "Traceback" not in err
    _one_mlflow_run_with_one_value_per_step(home)
    # the ledger bills each round's two actors once, and the killed round's two once
    _, state = RunDir(home, run_id).load()
    rounds = state["ledger"]["rounds"]
    assert sorted((r["round_idx"], r["n_requests"]) for r in rounds) == sorted(
        [(k, 2) for k in range(ROUNDS)] + [(1, 2)]
    )
    assert sum(h["actors_launched"] for h in state["history"]) == 2 * ROUNDS
