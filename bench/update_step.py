"""PPO's update with the minibatch loss eager and compiled (``learner_compile``), side by side.

    python bench/update_step.py                                  # Hopper, Walker2d, Humanoid
    python bench/update_step.py --envs Hopper-v5 --updates 4 --out update_step_hopper.json

For each env, two child processes in turn share one fresh inductor cache: the first compiles from
nothing (a user's first run on a machine), the second finds the kernels cached (every later run).
Each builds an eager and a compiled learner from one seed, rolls out 8 batches of 256 steps with
the start weights (a round of the ``nitro`` preset, its networks too: Humanoid's are 2x64 since
2026-11-30, and bench/results/update_step.json timed 2x256), and times the first compiled update
(the compile included), then ``--updates`` updates of each, alternating eager and compiled, on the same
batches. Also: how far the compiled gradients are from the eager ones on one minibatch (float32
rounding: the kernels sum in another order). Run it alone on a quiet host. Writes
bench/results/update_step.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import RESULTS, ROOT, machine

sys.path.insert(0, str(ROOT))


def one_env(env_id: str, updates: int) -> dict:
    """Measured in this process (the caller sets TORCHINDUCTOR_CACHE_DIR)."""
    import torch

    from nitro.actors.rollout import rollout
    from nitro.config import NitroConfig
    from nitro.envs import env_spec
    from nitro.learners import PPOLearner

    cfg = NitroConfig.load(overrides=[f"env_id={env_id}"])
    torch.set_num_threads(cfg.torch_threads())  # as a run's learner
    spec, arch = env_spec(env_id), cfg.model.architecture()
    eager = PPOLearner(spec, cfg.ppo, seed=0, arch=arch)
    compiled = PPOLearner(spec, cfg.ppo, seed=0, arch=arch, compile_loss=True)
    weights = {k: v.numpy() for k, v in eager.weights().items()}
    batches = [rollout(weights, env_id, i, cfg.steps_per_actor, arch=arch).batch for i in range(8)]

    data = compiled.prepare(batches)
    rows = torch.arange(cfg.ppo.minibatch_size)
    t = time.perf_counter()
    got = compiled.compute_gradients(data, rows)  # the first call compiles
    first_call_s = time.perf_counter() - t
    want = eager.compute_gradients(eager.prepare(batches), rows)
    rel = max(float((got.tensors[k] - want.tensors[k]).norm() / want.tensors[k].norm().clamp_min(1e-12))
              for k in want.tensors)

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    steps = 0
    for _ in range(updates + 1):  # the first pair warms the allocator and the statistics
        for name, learner in (("eager", eager), ("compiled", compiled)):
            t = time.perf_counter()
            result = learner.update(batches)
            times[name].append(time.perf_counter() - t)
            steps = result.sgd_steps
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {"env": env_id, "torch_threads": torch.get_num_threads(), "first_call_s": first_call_s,
            "gradient_max_relative_difference": rel,
            "sgd_steps": steps, "update_s": times, "median_update_s": med,
            "ms_per_step": {k: 1e3 * v / steps for k, v in med.items()},
            "compiled_over_eager": med["compiled"] / med["eager"],
            "still_compiled": compiled.minibatch_loss.compiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", default="Hopper-v5,Walker2d-v5,Humanoid-v5")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--out", default="update_step.json", help="file under bench/results/")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this env, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_env(args.one, args.updates)))
        return

    load_before = os.getloadavg()
    runs = []
    for env_id in args.envs.split(","):
        with tempfile.TemporaryDirectory(prefix="nitro-inductor-") as cache:
            for cache_state in ("cold", "warm"):
                child = subprocess.run([sys.executable, __file__, "--one", env_id, "--updates", str(args.updates)],
                                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}, check=True,
                                       capture_output=True, text=True)
                run = {"cache": cache_state, **json.loads(child.stdout.strip().splitlines()[-1])}
                runs.append(run)
                ms = run["ms_per_step"]
                print(f"{env_id} ({cache_state} cache): first compiled call {run['first_call_s']:.1f} s; "
                      f"update {run['median_update_s']['eager']:.3f} s eager, "
                      f"{run['median_update_s']['compiled']:.3f} s compiled ({run['compiled_over_eager']:.2f}x; "
                      f"{ms['eager']:.2f} vs {ms['compiled']:.2f} ms a step); gradients within "
                      f"{run['gradient_max_relative_difference']:.1e}", flush=True)
    report = {"runs": runs, "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "machine": machine()}
    out = RESULTS / args.out
    out.write_text(json.dumps(report, indent=1))
    print(f"load average before {load_before}, after {report['load_average_after']}; wrote {out}")


if __name__ == "__main__":
    main()
