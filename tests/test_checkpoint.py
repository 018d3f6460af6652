import json
import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from nitro.run.rundir import CheckpointError, RunDir


def test_round_trip_nested_state(tmp_path):
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    opt.zero_grad()
    opt.param_groups[0]["params"][0].sum().backward()
    opt.step()
    state = {"optim": opt.state_dict(), "window": [1.5, None, 2.0], "rng": np.arange(4), "name": "x", "n": 3}
    RunDir(tmp_path, "run1").save(0, state)
    RunDir(tmp_path, "run1").save(1, {**state, "n": 4})
    assert RunDir(tmp_path, "run1").latest_round() == 1
    k, loaded = RunDir(tmp_path, "run1").load()
    assert k == 1 and loaded["n"] == 4 and loaded["window"] == [1.5, None, 2.0]
    assert np.array_equal(loaded["rng"], np.arange(4))
    assert set(loaded["optim"]["state"]) == {0}  # int keys survive
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    torch.optim.Adam([torch.nn.Parameter(torch.ones(3))]).load_state_dict(loaded["optim"])
    # data only: the JSON half is plain JSON, the tensors are safetensors
    files = sorted(p.name for p in (tmp_path / "runs/run1/checkpoints/round-00001").iterdir())
    assert files == ["digest.json", "state.json", "state.safetensors"]
    json.loads((tmp_path / "runs/run1/checkpoints/round-00001/state.json").read_text())


def test_missing_and_partial(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        RunDir(tmp_path, "nope").load()
    RunDir(tmp_path, "r").save(0, {"a": 1})
    (tmp_path / "runs/r/checkpoints/.round-00001.tmp-1").mkdir()  # a crash mid-write
    assert RunDir(tmp_path, "r").latest_round() == 0
    for i in range(1, 5):
        RunDir(tmp_path, "r").save(i, {"a": i})
    assert RunDir(tmp_path, "r").prune(keep_last=2) == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "runs/r/checkpoints").iterdir()) == ["round-00003", "round-00004"]


def _damage(path, how):
    data = path.read_bytes()
    i = len(data) // 2
    path.write_bytes(data[:i] if how == "truncate" else data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])


@pytest.mark.parametrize(("name", "how"), [("state.safetensors", "truncate"), ("state.safetensors", "flip"),
                                          ("state.json", "flip")])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_falls_back(tmp_path, caplog, name, how):
    run = RunDir(tmp_path, "r")
    for k in range(3):
        run.save(k, {"k": k, "w": torch.full((64,), float(k))})
    _damage(run.round_dir(2) / name, how)
    assert not run.check(2).ok and name in run.check(2).reason
    with pytest.raises(CheckpointError, match="damaged"):
        run.load(2)
    with caplog.at_level(logging.WARNING, logger="nitro"):
        k, state = run.load_newest_good()
    assert k == 1 and state["k"] == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    (line,) = [r.getMessage() for r in caplog.records]
    assert (
        "checkpoint of round 2 is damaged" in line and "round-00002.bad" in line and "falling back to round 1" in line
    )
    assert run.rounds() == [0, 1] and (run.checkpoints / "round-00002.bad" / name).exists()  # set aside, not deleted
    run.save(2, {"k": 22})  # the re-run round writes its checkpoint beside the one set aside
    _damage(run.round_dir(2) / "state.json", "flip")
    assert run.load_newest_good()[0] == 1 and (run.checkpoints / "round-00002.bad-2").exists()


def test_retention_keeps_the_newest_and_the_best_by_evaluation_return(tmp_path):
    run = RunDir(tmp_path, "r")
    returns = {0: 10.0, 1: None, 2: 300.0, 3: 50.0, 4: None, 5: 20.0, 6: None}
    for k, ret in returns.items():
        run.save(k, {"k": k}, eval_return=ret)
        run.prune(keep_last=2, keep_best=1)
        assert len(run.rounds()) <= 3 and run.rounds()[-1] == k  # never more than keep_last + keep_best
    assert run.rounds() == [2, 5, 6]  # round 2 is the best evaluation; 5 and 6 the newest
    assert run.prune(keep_last=1, keep_best=0) == [2, 5]


def test_verify_names_each_checkpoint_and_what_a_resume_would_do(tmp_path):
    from nitro.run.runs import run_status, verify_run

    run = RunDir(tmp_path, "r")
    run.save_config("rounds: 9\n")
    for k in range(3):
        run.save(k, {"k": k, "next_round": k + 1, "history": [], "ledger": {}})
    lines, whole = verify_run(tmp_path, "r")
    assert whole and lines[-1] == "a resume continues after round 2"
    _damage(run.round_dir(2) / "state.safetensors", "truncate")
    lines, whole = verify_run(tmp_path, "r")
    assert (
        not whole
        and "DAMAGED" in lines[2]
        and lines[-1] == "a resume sets aside round(s) 2 and continues after round 1"
    )
    assert run.rounds() == [0, 1, 2]  # verify changes nothing
    status = run_status(tmp_path, "r")
    assert "rounds 0, 1, 2 (DAMAGED)" in status and "the newest 3 and the best 1" in status, status


def test_a_re_save_stopped_between_its_renames_keeps_the_round(tmp_path, monkeypatch, caplog):
    """A resume re-saves its round (the interrupted round's bill). Stopped after the old folder is
    renamed away and before the new one takes its place, the round is not lost: verify names the
    leftover, and the next resume restores the previous copy."""
    from nitro.run import rundir as rundir_module
    from nitro.run.runs import verify_run

    run = RunDir(tmp_path, "r")
    run.save_config("rounds: 9\n")
    for k in range(2):
        run.save(k, {"k": k, "next_round": k + 1, "history": [], "ledger": {"spent": 1.0}})
    replace = os.replace

    def stop_before_the_new_folder_lands(src, dst):
        if Path(dst) == run.round_dir(1) and Path(src).name.startswith(".round-00001.tmp"):
            raise KeyboardInterrupt("SIGTERM")
        return replace(src, dst)

    monkeypatch.setattr(rundir_module.os, "replace", stop_before_the_new_folder_lands)
    with pytest.raises(KeyboardInterrupt):
        run.save(1, {"k": 1, "next_round": 2, "history": [], "ledger": {"spent": 2.0}})
    monkeypatch.undo()
    assert run.rounds() == [0]  # round 1's folder is renamed away
    lines, _ = verify_run(tmp_path, "r")
    assert lines[-1].startswith("an interrupted re-save left .round-00001.replaced"), lines

    caplog.set_level(logging.WARNING)
    k, state = run.load_newest_good()
    assert (k, state["ledger"]["spent"]) == (1, 1.0)  # the previous copy, whole
    assert "re-save of round 1's checkpoint was interrupted" in caplog.text
    assert not list(run.checkpoints.glob(".round-*")) and run.rounds() == [0, 1]

    run.save(1, {"k": 1, "next_round": 2, "history": [], "ledger": {"spent": 2.0}})  # a re-save that ends
    assert run.load(1)[1]["ledger"]["spent"] == 2.0 and not list(run.checkpoints.glob(".round-*"))


def _small_disk(path):
    """A 1 MiB tmpfs at ``path`` (root only); None where it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True)
    return path if done.returncode == 0 else None


def test_a_full_disk_fails_the_write_in_one_line_and_keeps_no_partial_checkpoint(tmp_path, monkeypatch):
    run = RunDir(tmp_path, "r")
    disk = _small_disk(run.checkpoints)
    try:
        run.save(0, {"w": torch.zeros(16)})
        if disk is None:  # no tmpfs here (not root): the write fails as a full disk makes it fail
            def full(*args, **kwargs):
                raise OSError(28, "No space left on device")

            monkeypatch.setattr("nitro.run.rundir.write_bytes_durably", full)
        with pytest.raises(OSError, match=r"not written .*No space left on device") as info:
            run.save(1, {"w": torch.zeros(400_000)})  # 1.6 MB: more than the disk holds
        assert info.value.errno == 28 and "\n" not in str(info.value)
        assert run.rounds() == [0] and not list(run.checkpoints.glob(".round-*"))
        assert run.load()[0] == 0
    finally:
        if disk is not None:
            subprocess.run(["umount", str(disk)], check=True)


def test_runs_status_and_verify_read_checkpoints_without_torch_or_mlflow(tmp_path):
    """`nitro runs`, `status` and `verify` answer in about a second: they read a checkpoint's data
    and digest, never its tensors, so they import neither torch nor MLflow (each ~2 s)."""
    import sys

    run = RunDir(tmp_path, "r")
    run.save_config("rounds: 2\n")
    run.save(0, {"next_round": 1, "weights": torch.ones(3), "ledger": {"rounds": [{"cumulative": "0.5"}]},
                 "history": [{"round": 0, "train_return_mean": 12.5, "actors_launched": 2}]})
    script = ("import sys; from cli.main import main\n"
              "codes = [main([cmd, *args, '--home', sys.argv[1]]) for cmd, args in "
              "(('runs', []), ('status', ['r']), ('verify', ['r']))]\n"
              "print(codes, sorted({'torch', 'mlflow', 'prefect.server.api'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[0, 0, 0] []", done.stdout
    assert "r  stopped" in done.stdout and "12.5" in done.stdout and "$0.5000" in done.stdout, done.stdout
