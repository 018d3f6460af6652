"""The fault suite: a real `nitro` run, in a subprocess, faulted the ways a week-long run is, and
resumed until it finishes. What must hold every time: the run finishes after each fault with one
`nitro resume`; every round's metric is in MLflow exactly once; no batch is lost; the final
weights equal those of the same run unfaulted (the run is deterministic: fixed actors, seeds); a
fault says so in at most three lines.

Faults (``nitro.run.crashes`` names the points inside a round):

* kill -9 after the update, after the actors, after ``end_round`` and in the middle of a
  checkpoint; SIGTERM while a checkpoint is written and while a resume starts;
* the newest checkpoint damaged on disk (a truncated file): the resume sets it aside and falls back;
* the MLflow server gone for a few rounds (the run goes on and catches up), then the Prefect API
  gone (the run stops in one line; the resume runs with a new API);
* a full disk under the checkpoints (a real 24 MiB tmpfs; root only, as CI runs).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from nitro.run.rundir import RunDir
from tests.support.servers import MLFLOW, base_env, free_port, kill_group, prefect_server, spawn, wait_until
from tests.support.templates import nitro_home, prefect_home

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROUNDS = 6
# Rounds of the run that outlives its servers: the store is away for rounds 2-4, the API from round 8.
LONG = 10
# Deterministic and small: two fixed actors of 64 steps, an evaluation every other round, one
# learner thread. Every other setting as a user gets it.
CONFIG = [f"rounds={ROUNDS}", "steps_per_actor=64", "scaler.name=fixed", "scaler.fixed_actors=2",
          "backend.workers=2", "eval.every_rounds=2", "eval.episodes=1", "eval.max_steps=100"]
CHECKED = ("train_return_mean", "eval_return_mean", "env_steps", "actors_launched", "batches_missing",
           "spend_round_usd", "ppo/kl")


def nitro(tmp: Path, *args: str, api: str | None, extra: dict[str, str] | None = None) -> subprocess.Popen:
    """`nitro <args>` as a user runs it, against the Prefect API ``api`` (None: its own temporary one)."""
    env = {**base_env(), "PREFECT_HOME": str(prefect_home(tmp / "prefect")), **(extra or {})}
    if api:
        env["PREFECT_API_URL"] = api
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout_s: float = 400) -> tuple[int, str, str]:
    """Wait for ``proc`` (with a deadline) and check that nothing it started outlives it."""
    family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"nitro did not end within {timeout_s:.0f} s\n{out[-2000:]}\n{err[-3000:]}")
    _, alive = psutil.wait_procs(family, timeout=20)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    return proc.returncode, out, err


def run_to_end(tmp: Path, *args: str, api: str | None, extra: dict[str, str] | None = None) -> tuple[str, str]:
    code, out, err = finish(nitro(tmp, *args, api=api, extra=extra))
    assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    return out, err


def error_lines(err: str) -> list[str]:
    """What a user reads as the error: the lines that are not the run's own log."""
    return [line for line in err.splitlines() if line.strip() and not line[:2].isdigit()
            and not line.startswith(("nitro: starting", "nitro: resuming", "  ", "nitro: paused"))
            and " INFO " not in line]


def final_weights(home: Path, run_id: str) -> dict[str, torch.Tensor]:
    k, state = RunDir(home, run_id).load()
    assert k == ROUNDS - 1
    return state["learner"]["tensors"]


def metrics_by_step(uri: str, run_id: str) -> dict[str, dict[int, float]]:
    """Each checked metric's values by step, asserting that MLflow holds at most one per round and
    one for every round that updates (round 0 has no update, so no ``ppo/kl``)."""
    client = MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    (run,) = [
        r for r in client.search_runs(exps, run_view_type=ViewType.ALL) if r.data.tags.get("nitro.run_id") == run_id
    ]
    out = {}
    for key in CHECKED:
        history = client.get_metric_history(run.info.run_id, key)
        steps = sorted(m.step for m in history)
        assert len(steps) == len(set(steps)) and set(steps) >= set(range(1, ROUNDS)), f"{key}: steps {steps}"
        out[key] = {m.step: m.value for m in history}
    return out


def same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_api):
    """The run unfaulted: its final weights and per-round metrics."""
    tmp = tmp_path_factory.mktemp("reference")
    run_to_end(tmp, "train", "--run-id", "ref", f"home={nitro_home(tmp / 'home')}", *CONFIG, api=prefect_api)
    return final_weights(tmp / "home", "ref"), metrics_by_step(f"sqlite:///{tmp}/home/mlflow.db", "ref")


def test_kills_signals_and_a_damaged_checkpoint_lose_nothing(tmp_path, prefect_api, reference):
    home, run = nitro_home(tmp_path / "home"), "faulted"
    run_dir = RunDir(home, run)
    for i, point in enumerate(("after-update:1", "after-actors:2", "after-end-round:3", "mid-checkpoint:3")):
        args = ("train", "--run-id", run, f"home={home}", *CONFIG) if i == 0 else ("resume", run, "--home", str(home))
        code, _out, err = finish(nitro(tmp_path, *args, api=prefect_api, extra={"NITRO_CRASH_AT": point}))
        assert code == -signal.SIGKILL, f"{point}: exit {code}\n{err[-3000:]}"
    assert run_dir.latest_round() == 2  # the last kill came while round 3's checkpoint was written

    # SIGTERM while round 4's checkpoint is being written: one line, no partial checkpoint
    proc = nitro(tmp_path, "resume", run, "--home", str(home), api=prefect_api,
                 extra={"NITRO_PAUSE_AT": "mid-checkpoint:4"})
    wait_until(lambda: any(p.name.startswith(".round-00004.tmp") for p in run_dir.checkpoints.iterdir()),
               300, "round 4's checkpoint under way", proc=proc)
    proc.send_signal(signal.SIGTERM)
    code, _out, err = finish(proc, timeout_s=60)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert error_lines(err) == [f"nitro: error: stopped by SIGTERM; the run keeps its last checkpoint. "
                                f"Resume with: nitro resume {run} --home {home}"], err[-3000:]
    assert run_dir.latest_round() == 3

    # SIGTERM while a resume starts (before its first round): the next resume is not held up by a lease
    def resumes() -> int:
        return run_dir.log_file.read_text(errors="replace").count("resuming after round")

    before = resumes()
    proc = nitro(tmp_path, "resume", run, "--home", str(home), api=prefect_api)
    wait_until(lambda: resumes() > before, 300, "the resume under way", proc=proc, every_s=0.05)
    proc.send_signal(signal.SIGTERM)
    code, _out, err = finish(proc, timeout_s=60)
    assert code == 128 + signal.SIGTERM and len(error_lines(err)) == 1, err[-3000:]

    # the newest checkpoint damaged on disk (a crash mid-write on a filesystem that lied, a bad disk)
    newest = run_dir.round_dir(3) / "state.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    verify = subprocess.run(
        [sys.executable, "-m", "cli.main", "verify", run, "--home", str(home)],
        cwd=tmp_path,
        env={**base_env(), "PREFECT_HOME": str(tmp_path / "prefect")},
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 1 and "a resume sets aside round(s) 3 and continues after round 2" in verify.stdout
    _out, err = run_to_end(tmp_path, "resume", run, "--home", str(home), api=prefect_api)
    warnings = [line for line in err.splitlines() if "damaged" in line]
    assert len(warnings) == 1 and "round-00003.bad" in warnings[0] and "falling back to round 2" in warnings[0]
    assert (run_dir.checkpoints / "round-00003.bad").is_dir()  # set aside, not deleted

    weights, ref_metrics = reference
    got = final_weights(home, run)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    metrics = metrics_by_step(f"sqlite:///{home}/mlflow.db", run)
    for key in ("train_return_mean", "eval_return_mean", "env_steps", "actors_launched", "ppo/kl"):
        assert metrics[key].keys() == ref_metrics[key].keys(), key  # each round logged once, as unfaulted
        assert all(same(metrics[key][k], ref_metrics[key][k]) for k in ref_metrics[key]), (key, metrics[key])
    assert all(v == 0 for v in metrics["batches_missing"].values())  # no batch lost to a kill
    # nothing billed twice: each dead attempt once in the ledger, and the rounds add up to its total
    _, state = run_dir.load()
    entries = state["ledger"]["rounds"]
    attempts_billed = [r["attempt"] for r in entries if r["interrupted"]]
    assert len(attempts_billed) == len(set(attempts_billed)) >= 3  # rounds 2, 3 (twice), 4 died in flight
    assert sum(float(r["total"]) for r in entries) == pytest.approx(float(entries[-1]["cumulative"]))
    assert not list(run_dir.checkpoints.glob(".round-*.tmp-*"))  # no write left half done
    assert len(run_dir.rounds()) <= 3 + 1  # checkpoint.keep_last + keep_best


def test_the_tracking_servers_going_away(tmp_path):
    """MLflow gone for some rounds: the run goes on and logs them when it answers again. Then the
    Prefect API gone: the run stops within the round in one line, and resumes with a new API. The
    run holds between rounds while a server stops or starts (``NITRO_PAUSE_AT``), so what it sees
    does not depend on how fast the host is."""
    home, run = tmp_path / "home", "servers"
    store = f"sqlite:///{tmp_path}/store.db"
    port = free_port()
    mlflow_args = [MLFLOW, "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port),
                   "--workers", "1", "--artifacts-destination", str(tmp_path / "mlartifacts")]
    release = tmp_path / "release"
    release.mkdir()
    store_gone, store_back, api_gone = (f"after-checkpoint:{k}" for k in (1, 4, 7))

    def mlflow_server() -> subprocess.Popen:
        log = tmp_path / f"mlflow-{len(list(tmp_path.glob('mlflow-*.log')))}.log"
        # without MLflow's job executor (huey workers the run never uses), the server starts sooner
        proc = spawn(mlflow_args, {**base_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, log)
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health"), 120, "mlflow server", log, proc)
        return proc

    def held_at(point: str) -> None:
        k = int(point.rsplit(":", 1)[1])
        wait_until(lambda: run_dir.latest_round() == k, 300, f"the run held at {point}", proc=proc)

    tracking = mlflow_server()
    with prefect_server(tmp_path) as prefect:
        proc = nitro(tmp_path, "train", "--run-id", run, f"home={home}", *CONFIG, f"rounds={LONG}",
                     f"tracking.mlflow_uri=http://127.0.0.1:{port}", api=prefect.api,
                     extra={"NITRO_PAUSE_AT": f"{store_gone},{store_back},{api_gone}",
                            "NITRO_RELEASE_DIR": str(release)})
        run_dir = RunDir(home, run)
        try:
            held_at(store_gone)
            kill_group(tracking)
            (release / store_gone).touch()  # rounds 2-4 find no store
            held_at(store_back)
            logged(run_dir, "the MLflow store does not answer", proc)  # once the client's retries give up
            tracking = mlflow_server()
            (release / store_back).touch()
            held_at(api_gone)
            logged(run_dir, "the MLflow store answers again: caught up rounds", proc)
        except BaseException:  # a held run would wait out its hold
            kill_group(proc)
            kill_group(tracking)
            raise
    # the Prefect server has stopped under the held run
    (release / api_gone).touch()
    code, _out, err = finish(proc, timeout_s=180)
    try:
        lines = error_lines(err)
        assert code == 1 and len(lines) <= 3, err[-3000:]
        assert lines[-1].startswith("nitro: error: Prefect API") and f"nitro resume {run} --home {home}" in lines[-1]
        _out, err = run_to_end(tmp_path, "resume", run, "--home", str(home), api=None)  # its own, new API
        client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
        (mlrun,) = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
                    if r.data.tags.get("nitro.run_id") == run]
        for key in CHECKED:
            steps = sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, key))
            assert steps == list(range(0 if key != "ppo/kl" else 1, LONG)), (key, steps)
    finally:
        kill_group(tracking)


def test_the_process_ends_when_an_exit_drain_hangs(tmp_path):
    """Prefect's log and event workers drain to the API at interpreter exit with no deadline (a
    ``threading._register_atexit`` hook); with the API gone that drain is minutes of retries. A
    command that is done ends within ``EXIT_DEADLINE_S`` anyway, with its exit code and one line."""
    script = (
        "import threading, time, cli.main as m\n"
        "threading._register_atexit(lambda: time.sleep(600))  # a drain that never finishes\n"
        "m.EXIT_DEADLINE_S = 1.0\n"
        "m.main = lambda: 1\n"
        "m.run()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert error_lines(done.stderr) == ["nitro: Prefect's log and event workers did not finish sending within 1 s "
                                        "(is its API gone?); exiting without them"], done.stderr


def logged(run_dir: RunDir, text: str, proc: subprocess.Popen) -> None:
    wait_until(lambda: text in run_dir.log_file.read_text(errors="replace"), 300, repr(text), proc=proc)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_full_disk_stops_the_run_in_one_line_and_the_resume_finishes(tmp_path, prefect_api):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root); test_checkpoint.py fills a disk in process")
    home, run = nitro_home(tmp_path / "home"), "disk"
    run_dir = RunDir(home, run)
    run_dir.checkpoints.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(run_dir.checkpoints)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    proc = None
    try:
        release = tmp_path / "release"
        release.mkdir()
        proc = nitro(tmp_path, "train", "--run-id", run, f"home={home}", *CONFIG, api=prefect_api,
                     extra={"NITRO_PAUSE_AT": "after-checkpoint:1", "NITRO_RELEASE_DIR": str(release)})
        wait_until(lambda: run_dir.latest_round() == 1, 300, "the run held after round 1's checkpoint", proc=proc)
        filler = run_dir.checkpoints / "filler"
        with open(filler, "wb") as f:  # the disk fills up under the run
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        (release / "after-checkpoint:1").touch()
        code, _out, err = finish(proc)
        lines = error_lines(err)
        assert code == 1 and len(lines) == 1, err[-3000:]
        assert "run folder failed" in lines[0] and "No space left on device" in lines[0]
        assert f"nitro resume {run} --home {home}" in lines[0]
        assert not list(run_dir.checkpoints.glob(".round-*"))  # nothing partial kept
        stopped_at = run_dir.latest_round()
        assert stopped_at is not None and run_dir.check(stopped_at).ok
        filler.unlink()  # the operator frees space
        run_to_end(tmp_path, "resume", run, "--home", str(home), api=prefect_api)
        assert run_dir.latest_round() == ROUNDS - 1 and all(c.ok for c in run_dir.verify())
    finally:
        if proc is not None:
            kill_group(proc)  # a run the test left held waits out its hold otherwise
        shutil.rmtree(run_dir.checkpoints / "filler", ignore_errors=True)
        subprocess.run(["umount", "-l", str(run_dir.checkpoints)], check=False)
