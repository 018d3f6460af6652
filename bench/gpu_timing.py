"""One PPO update and one boosting detection of an Atari and a Humanoid learner, timed on the CPU
and on the GPU (``device: cuda``), on the same batches (issue 49, item 4). bench/gpu_check.sh runs it.

The batches are what a round of the nitro preset trains on: ``--actors`` actors x the preset's
steps_per_actor (Atari: 8 x 128 steps, each actor over envs_per_actor games; Humanoid: 8 x 256),
rolled out once on the CPU, as actors are, on the preset's networks: Humanoid's are 2x64 since
2026-11-30, and the files recorded before that timed 2x256. Each device gets a fresh learner from
the same seed, one untimed update (CUDA's start-up, cuDNN's algorithm search), then timed updates
and detections (``detector.subset_size`` samples, ``detector.lanczos_steps`` Hessian-vector
products): medians of ``--gpu-repeats`` on the GPU, of ``--cpu-repeats`` on the CPU, whose runs
are long enough to be steady. The CPU learner runs ``learner_threads`` torch threads, as a run's learner does, and every
core (``--cpu-threads learner,all``, the default).

Usage:  python bench/gpu_timing.py [--device cpu] [--out PATH]
        (--device cpu: the CPU alone, a dry run on a machine without a GPU; the default PATH is
        bench/results/gpu_timing_<card>.json, the card's name in it)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "disable")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from nitro.actors.rollout import games_for, rollout
from nitro.config import NitroConfig
from nitro.envs import env_spec, make_env
from nitro.learners import make_learner
from nitro.scaling.detector import detect_on_batch

ENVS = ("ALE/Qbert-v5", "Humanoid-v5")
RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """Where this ran: the CPU, its cores and load, torch and CUDA, the GPU (no nitro.experiments
    import: a bare GPU machine has only what bench/gpu_check.sh installs)."""
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "cpu": cpu,
            "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "cuda_build": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cudnn=torch.backends.cudnn.version(), tf32_cudnn=torch.backends.cudnn.allow_tf32,
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return info


def batches_for(config: NitroConfig, actors: int) -> list[dict]:
    """``actors`` actor batches of the run's shape, rolled out on the CPU from the learner's
    initial weights."""
    learner = make_learner(config.model_copy(update={"device": "cpu"}))
    weights = {k: v.numpy() for k, v in learner.weights().items()}
    spec = env_spec(config.env_id)
    env = (games_for(config.env_id, config.envs_per_actor, config.steps_per_actor) if spec.is_atari
           else make_env(config.env_id))  # one env for every actor: each rollout reseeds it
    return [rollout(weights, config.env_id, seed=i, n_steps=config.steps_per_actor, n_envs=config.envs_per_actor,
                    arch=config.model.architecture(), env=env).batch for i in range(actors)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_device(config: NitroConfig, batches: list[dict], device: str, threads: int, repeats: int) -> dict:
    """Median seconds of an update and of a detection on ``device`` (untimed warm-up first)."""
    torch.set_num_threads(threads)
    learner = make_learner(config.model_copy(update={"device": device}))
    samples = sum(len(b["rewards"]) for b in batches)
    start = time.perf_counter()
    warm = learner.update(batches)
    sync(device)
    first_s = time.perf_counter() - start
    updates, detections, hvps = [], [], 0
    for r in range(repeats):
        start = time.perf_counter()
        learner.update(batches)
        sync(device)
        updates.append(time.perf_counter() - start)
        start = time.perf_counter()
        det = detect_on_batch(learner, subset_size=config.detector.subset_size, steps=config.detector.lanczos_steps,
                              seed=r)
        sync(device)
        detections.append(time.perf_counter() - start)
        hvps = det.n_hvp
    update_s, detect_s = statistics.median(updates), statistics.median(detections)
    return {
        "env": config.env_id, "device": device, "torch_threads": threads, "samples": samples,
        "sgd_steps": warm.sgd_steps, "epochs": config.ppo.epochs, "minibatch_size": config.ppo.minibatch_size,
        "first_update_s": round(first_s, 4), "update_s": [round(x, 4) for x in updates],
        "update_s_median": round(update_s, 4), "samples_per_s": round(samples / update_s, 1),
        "sgd_samples_per_s": round(samples * config.ppo.epochs / update_s, 1),
        "detect_s": [round(x, 4) for x in detections], "detect_s_median": round(detect_s, 4),
        "detect_subset": min(config.detector.subset_size, samples), "detect_hvps": hvps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "both"], default="both",
                        help="both: CPU and GPU (the default); cpu: a dry run without a GPU")
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--gpu-repeats", type=int, default=3)
    parser.add_argument("--cpu-repeats", type=int, default=1)
    parser.add_argument("--cpu-threads", default="learner,all", help="'learner' (config.torch_threads()), 'all' "
                        "(every core), or both comma-separated")
    parser.add_argument("--envs", default=",".join(ENVS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit(f"no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
                 "run with --device cpu for a dry run")
    devices = ["cuda", "cpu"] if args.device == "both" else [args.device]  # the GPU's rows first
    started, load_at_start = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    card = torch.cuda.get_device_name(0) if "cuda" in devices else "cpu"
    path = args.out or RESULTS / f"gpu_timing_{re.sub(r'[^a-z0-9]+', '-', card.lower()).strip('-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def write() -> dict:
        """The results so far (written after every row: a run cut short keeps what it measured)."""
        speedups = {}
        for env_id in args.envs.split(","):
            by = {(r["device"], r["torch_threads"]): r for r in rows if r["env"] == env_id}
            gpu = by.get(("cuda", 1))
            for (device, threads), row in by.items():
                if gpu is not None and device == "cpu":
                    speedups[f"{env_id} gpu vs cpu x{threads}"] = {
                        "update": round(row["update_s_median"] / gpu["update_s_median"], 2),
                        "detection": round(row["detect_s_median"] / gpu["detect_s_median"], 2)}
        out = {"benchmark": "gpu_timing", "machine": {**machine(), "load_avg_at_start": load_at_start},
               "rows": rows, "speedups": speedups, "wall_s": round(time.perf_counter() - started, 1),
               "notes": "batches rolled out once on the CPU (the actors' side); each device: a fresh learner from "
                        "seed 0, one untimed update, then timed updates and detections (medians); cuDNN "
                        "convolutions at torch's default precision (TF32 where the card has it)"}
        path.write_text(json.dumps(out, indent=1) + "\n")
        return out

    for env_id in args.envs.split(","):
        config = NitroConfig.load({"env_id": env_id, "seed": 0})
        t0 = time.perf_counter()
        batches = batches_for(config, args.actors)
        print(f"{env_id}: {args.actors} actor batches of {config.steps_per_actor} steps rolled out in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        for device in devices:
            thread_counts = [1] if device == "cuda" else sorted({
                config.torch_threads() if t == "learner" else os.cpu_count() or 1
                for t in args.cpu_threads.split(",")})
            for threads in thread_counts:
                repeats = args.gpu_repeats if device == "cuda" else args.cpu_repeats
                row = time_device(config, batches, device, threads, repeats)
                rows.append(row)
                write()
                print(f"  {device:4s} {threads:2d} thread(s): update {row['update_s_median']:.3f} s "
                      f"({row['samples_per_s']:.0f} samples/s, {row['sgd_steps']} SGD steps), "
                      f"detection {row['detect_s_median']:.3f} s ({row['detect_hvps']} HVPs on "
                      f"{row['detect_subset']} samples)", flush=True)
    out = write()
    print(json.dumps(out["speedups"], indent=1))
    print(f"wrote {path} in {out['wall_s']} s")


if __name__ == "__main__":
    main()
