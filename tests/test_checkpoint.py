import json

import numpy as np
import pytest
import torch

from nitro.checkpoint import CheckpointError, latest_round, load_checkpoint, prune_checkpoints, save_checkpoint


def test_round_trip_nested_state(tmp_path):
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    opt.zero_grad()
    opt.param_groups[0]["params"][0].sum().backward()
    opt.step()
    state = {"optim": opt.state_dict(), "window": [1.5, None, 2.0], "rng": np.arange(4), "name": "x", "n": 3}
    save_checkpoint(tmp_path, "run1", 0, state)
    save_checkpoint(tmp_path, "run1", 1, {**state, "n": 4})
    assert latest_round(tmp_path, "run1") == 1
    k, loaded = load_checkpoint(tmp_path, "run1")
    assert k == 1 and loaded["n"] == 4 and loaded["window"] == [1.5, None, 2.0]
    assert np.array_equal(loaded["rng"], np.arange(4))
    assert set(loaded["optim"]["state"]) == {0}  # int keys survive
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    torch.optim.Adam([torch.nn.Parameter(torch.ones(3))]).load_state_dict(loaded["optim"])
    # data only: the JSON half is plain JSON, the tensors are safetensors
    files = sorted(p.name for p in (tmp_path / "runs/run1/checkpoints/round-00001").iterdir())
    assert files == ["state.json", "state.safetensors"]
    json.loads((tmp_path / "runs/run1/checkpoints/round-00001/state.json").read_text())


def test_missing_and_partial(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path, "nope")
    save_checkpoint(tmp_path, "r", 0, {"a": 1})
    (tmp_path / "runs/r/checkpoints/.round-00001.tmp-1").mkdir()  # a crash mid-write
    assert latest_round(tmp_path, "r") == 0
    for i in range(1, 5):
        save_checkpoint(tmp_path, "r", i, {"a": i})
    prune_checkpoints(tmp_path, "r", keep=2)
    assert sorted(p.name for p in (tmp_path / "runs/r/checkpoints").glob("round-*")) == ["round-00003", "round-00004"]
