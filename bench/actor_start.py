"""What a fresh actor process costs before its first invocation, with and without PyTorch.

    python bench/actor_start.py --before /tmp/nitro-before   # a checkout of the commit to compare with
    python bench/actor_start.py --before /tmp/nitro-before --trials 20 --env ALE/Qbert-v5

A local pool's worker, a Ray worker and a Lambda cold start each import what the run's pool preloads
(``nitro.actors.preload.warm_modules_for``) before they take an invocation. Each trial starts a fresh
``python`` that imports those modules and builds the acting policy from published weights, as the
first invocation does, once for each arm, alternated: ``after`` (this checkout) and ``before``
(``--before``, a checkout of an earlier commit whose pool preloads ``nitro.actors.rollout``, which
imported PyTorch then). It reports each arm's wall and CPU seconds (user + system, the process and
its threads) and whether PyTorch was imported.

Writes bench/results/actor_start_<env>.json. Run it alone on a quiet machine; it records the load
averages before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, ROOT, machine

# Run in the fresh process: import what the pool preloads, then build the acting policy from weights
# as ``nitro.actors.rollout.rollout`` does on an invocation. Prints wall and CPU seconds, and torch.
PROBE = """
import os, resource, sys, time
start = time.perf_counter()
import importlib
import nitro
assert nitro.__file__.startswith(sys.argv[4]), (nitro.__file__, sys.argv[4])  # this arm's checkout
for module in sys.argv[2].split(","):
    importlib.import_module(module)
from nitro.actors.rollout import rollout
rollout(open(sys.argv[1], "rb").read(), sys.argv[3], 0, 8)
usage = resource.getrusage(resource.RUSAGE_SELF)
print(time.perf_counter() - start, usage.ru_utime + usage.ru_stime, "torch" in sys.modules)
"""


def weights_file(env_id: str, path: Path) -> Path:
    from nitro.envs import env_spec
    from nitro.models.networks import build_policy
    from nitro.serialization import dumps_tensors

    policy = build_policy(env_spec(env_id), seed=0)
    path.write_bytes(dumps_tensors(policy.state_dict(), {"format": "nitro.policy/1", "env_id": env_id}))
    return path


def one(tree: Path, modules: str, weights: Path, env_id: str) -> tuple[float, float, bool]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MUJOCO_GL": "disable"}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE, str(weights), modules, env_id, str(tree)], env=env, cwd=tree,
                         capture_output=True, text=True, timeout=300)
    outside = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"the probe failed in {tree}:\n{out.stderr[-2000:]}")
    _inside, cpu, torch = out.stdout.split()
    return outside, float(cpu), torch == "True"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the commit to compare with")
    ap.add_argument("--env", default="Hopper-v5")
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from nitro.actors.preload import warm_modules_for
    from nitro.config import NitroConfig

    load_before = os.getloadavg()
    weights = weights_file(args.env, Path(f"/tmp/actor-start-{os.getpid()}.weights"))
    arms = {"after": (ROOT, ",".join(warm_modules_for(NitroConfig.load(overrides=[f"env_id={args.env}"])))),
            "before": (args.before.resolve(), "nitro.actors.rollout")}
    runs: dict[str, list[tuple[float, float, bool]]] = {name: [] for name in arms}
    try:
        for tree, modules in arms.values():
            one(tree, modules, weights, args.env)  # untimed: the page cache holds both trees' files
        for trial in range(args.trials):
            for name, (tree, modules) in arms.items():
                runs[name].append(one(tree, modules, weights, args.env))
            print(f"trial {trial + 1}/{args.trials}: " + ", ".join(
                f"{name} {runs[name][-1][0]:.2f} s wall, {runs[name][-1][1]:.2f} s CPU" for name in arms), flush=True)
    finally:
        weights.unlink(missing_ok=True)

    summary = {name: {"wall_s_median": statistics.median(r[0] for r in rs),
                      "cpu_s_median": statistics.median(r[1] for r in rs),
                      "imports_torch": all(r[2] for r in rs), "runs": rs,
                      "modules": arms[name][1]} for name, rs in runs.items()}
    ratio_wall = summary["after"]["wall_s_median"] / summary["before"]["wall_s_median"]
    ratio_cpu = summary["after"]["cpu_s_median"] / summary["before"]["cpu_s_median"]
    for name, s in summary.items():
        print(f"{name:>6}: {s['wall_s_median']:.2f} s wall, {s['cpu_s_median']:.2f} s CPU (medians of "
              f"{args.trials}), PyTorch imported: {s['imports_torch']}; modules {s['modules']}")
    print(f"after / before: wall {ratio_wall:.2f}x, CPU {ratio_cpu:.2f}x")
    out = {"env_id": args.env, "trials": args.trials, "arms": summary, "after_over_before_wall": ratio_wall,
           "after_over_before_cpu": ratio_cpu,
           "machine": machine(loadavg_before=load_before, loadavg_after=os.getloadavg())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"actor_start_{args.env.replace('/', '_')}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
