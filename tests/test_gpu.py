"""The learner on a GPU (``device: cuda``): a PPO update and a boosting detection run on the
device, with actors (rollouts) on the CPU, and agree with the same update on the CPU; what the
learner publishes and checkpoints are CPU tensors. bench/gpu_check.sh runs this file on a GPU
machine; without a CUDA device only the refusal test runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nitro.actors.rollout import rollout
from nitro.config import NitroConfig
from nitro.learners import learner_device, make_learner
from nitro.scaling.detector import detect_on_batch

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason=f"no CUDA device here (torch {torch.__version__}, "
                                f"CUDA build {torch.version.cuda or 'none'}): run bench/gpu_check.sh on a GPU machine")


def _learners(env_id: str, **config):
    """The same learner (same seed, same config) on the CPU and on the GPU."""
    cpu = make_learner(NitroConfig.load({"env_id": env_id, "device": "cpu", **config}))
    gpu = make_learner(NitroConfig.load({"env_id": env_id, "device": "cuda", **config}))
    return cpu, gpu


def _batches(learner, env_id: str, n: int, steps: int, **kw) -> list[dict[str, np.ndarray]]:
    weights = {k: v.numpy() for k, v in learner.weights().items()}
    return [rollout(weights, env_id, seed=i, n_steps=steps, **kw).batch for i in range(n)]


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is here: the refusal needs a machine without one")
def test_cuda_without_a_gpu_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no CUDA GPU here") as err:
        make_learner(NitroConfig.load({"env_id": "Hopper-v5", "device": "cuda"}))
    assert "\n" not in str(err.value)
    assert learner_device("cpu") == torch.device("cpu")


@needs_cuda
def test_an_mlp_update_and_its_detection_run_on_the_gpu_as_on_the_cpu():
    config = {"ppo": {"epochs": 2, "minibatch_size": 128}}
    cpu, gpu = _learners("Hopper-v5", **config)
    for a, b in zip(cpu.weights().values(), gpu.weights().values()):  # the same initial networks
        assert torch.equal(a, b)
    batches = _batches(cpu, "Hopper-v5", 2, 256)
    results = [learner.update(batches) for learner in (cpu, gpu)]
    assert all(p.device.type == "cuda" for p in gpu.policy_parameters())
    assert gpu.trained_batch.obs.device.type == "cuda"
    assert results[0].sgd_steps == results[1].sgd_steps == 8
    for name, a in cpu.weights().items():
        b = gpu.weights()[name]
        assert b.device.type == "cpu"  # what actors receive
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=name)
    detections = [detect_on_batch(learner, subset_size=256, steps=20, seed=3) for learner in (cpu, gpu)]
    assert all(d.status in ("ok", "lambda_min_nonnegative", "lambda_min_zero") for d in detections), detections
    for key in ("lambda_max", "lambda_min"):
        assert getattr(detections[1], key) == pytest.approx(getattr(detections[0], key), rel=1e-2, abs=1e-6), key


@needs_cuda
def test_an_atari_update_trains_uint8_frames_on_the_gpu_and_checkpoints_to_the_cpu():
    env_id = "ALE/Qbert-v5"
    cpu, gpu = _learners(env_id, ppo={"epochs": 1, "minibatch_size": 64})
    batches = _batches(cpu, env_id, 2, 128, n_envs=4)
    result = gpu.update(batches)
    assert result.sgd_steps == 4 and np.isfinite(result.diagnostics["kl"])
    assert gpu.trained_batch.obs.dtype == torch.uint8 and gpu.trained_batch.obs.device.type == "cuda"
    detection = detect_on_batch(gpu, subset_size=128, steps=10, seed=0)
    assert detection.status != "error" and detection.n_hvp >= 1, detection
    tensors, meta = gpu.state_dict()
    assert all(t.device.type == "cpu" for t in tensors.values())
    cpu.load_state_dict(tensors, meta)  # a GPU checkpoint resumes on the CPU
    for name, value in gpu.weights().items():
        assert torch.equal(cpu.weights()[name], value), name
    cpu_result = cpu.update(batches)  # and the resumed learner trains
    assert cpu_result.sgd_steps == 4
