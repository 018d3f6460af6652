"""`nitro train` with ``backend.kind=ray``, as a user runs it: a local Ray started with the run, a
``kill -9`` mid-round that leaves no Ray process behind, and a resume that completes the run.

The helpers are tests/test_cli_lifecycle.py's; a test kills only what descends from its own
`nitro` process. The Prefect API is the session's: the temporary one that `nitro` starts without
one, and its death with the run, are tests/test_cli_lifecycle.py's subject.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nitro.run.rundir import RunDir
from tests.test_cli_lifecycle import (
    ROUNDS,
    _config,
    _finish,
    _inflight_round,
    _kill_mid_round_1,
    _nitro,
    _one_mlflow_run_with_one_value_per_step,
)

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _ray_config(home: Path) -> list[str]:
    # backend.workers=2: the local Ray's CPUs. A fresh Ray worker imports torch and the envs on its
    # first task, which on a loaded 2-core host can take minutes: the invocation deadline (120 s by
    # default) is wide here, so that only an actor that really fails fails the test.
    return [*_config(home), "backend.kind=ray", "backend.timeout_s=240"]


def _failed_actors(home: Path, run_id: str) -> list[str]:
    """The run log's lines for actors that failed (``nitro.run.engine`` logs each with its reason)."""
    return [line for line in RunDir(home, run_id).log_file.read_text().splitlines() if " failed: " in line]


def test_sigkill_of_a_ray_run_leaves_no_ray_process_and_the_run_resumes(tmp_path, prefect_api):
    home, run_id = tmp_path / "home", "ray-killed"
    # the reaper gets 15 s: it ends Ray's agents before it ends itself. Round 1 may start as late as
    # Ray's start plus round 0's invocation deadline (backend.timeout_s, above).
    names = _kill_mid_round_1(_nitro(tmp_path, "train", "--run-id", run_id, *_ray_config(home), api=prefect_api),
                              home, run_id, grace_s=15, within_s=420)
    assert "raylet" in names and "gcs_server" in names and "nitro.actors.ray_reaper" in names, names
    assert "nitro.actors.local" not in names  # no local pool beside Ray
    assert _inflight_round(home, run_id) == 1 and not (RunDir(home, run_id).checkpoints / "round-00001").exists()

    code, out, err = _finish(_nitro(tmp_path, "resume", run_id, "--home", str(home), api=prefect_api))
    assert code == 0, err[-3000:]
    assert f"{ROUNDS} rounds" in out
    _one_mlflow_run_with_one_value_per_step(home)
    _, state = RunDir(home, run_id).load()
    interrupted = [r for r in state["ledger"]["rounds"] if r["interrupted"]]
    assert [(r["round_idx"], r["n_requests"]) for r in interrupted] == [(1, 2)], interrupted
    trained = [h for h in state["history"] if h.get("actors_launched")]
    failed = {int(h["round"]): h["actors_failed"] for h in state["history"] if h.get("actors_failed")}
    assert trained and not failed, (failed, _failed_actors(home, run_id))
