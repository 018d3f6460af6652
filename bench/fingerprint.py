"""Fixed-seed runs, round by round: does a change keep the engine's behaviour?

    .venv/bin/python bench/fingerprint.py --out bench/results/fingerprint_before.json
    .venv/bin/python bench/fingerprint.py --compare bench/results/fingerprint_before.json \
        --out bench/results/fingerprint_after.json

Runs a few short training runs through the real CLI (`nitro train`, its own temporary Prefect API,
local actors, local Redis), one per update mode and scaler kind, and keeps every per-round metric
that does not depend on the clock: returns, steps, actor counts, the detector's eigenvalues and the
learner's diagnostics. Spend and seconds are left out: they are measured time. A run repeats to the
digit only on one CPU model (docs/decisions.md), so compare fingerprints taken on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> overrides: one run per update mode (sync PPO with the detector, Stellaris, IMPACT learning
# while acting and synchronously) and a seeded random scaler
RUNS: dict[str, list[str]] = {
    "ppo-nitro": ["rounds=6", "scaler.name=nitro", "eval.every_rounds=3", "eval.episodes=2"],
    "ppo-random": ["rounds=5", "scaler.name=random", "scaler.i_min=2", "scaler.i_max=6",
                   "detector.enabled=false", "eval.every_rounds=4", "eval.episodes=2"],
    "ppo-stellaris": ["rounds=4", "scaler.name=fixed", "scaler.fixed_actors=4", "learner.mode=stellaris",
                      "eval.every_rounds=3", "eval.episodes=2"],
    "impact-sync": ["rounds=4", "algo=impact", "impact.asynchronous=false", "scaler.name=fixed",
                    "scaler.fixed_actors=4", "eval.every_rounds=3", "eval.episodes=2"],
}
TIMED = ("spend", "_s", "seconds", "orchestration", "round_lambda", "round_billed")


def clock_free(name: str) -> bool:
    return not any(part in name for part in TIMED)


def run_one(name: str, overrides: list[str], home: Path) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PREFECT_HOME": str(home / "prefect")}
    env.pop("PREFECT_API_URL", None)
    cmd = [str(ROOT / ".venv" / "bin" / "nitro"), "train", "--run-id", name, f"home={home}",
           f"tracking.mlflow_uri=sqlite:///{home}/mlflow.db", *overrides]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        sys.exit(f"fingerprint: {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    return read_metrics(f"sqlite:///{home}/mlflow.db", name)


def read_metrics(uri: str, run_name: str) -> dict[str, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.tags.get("nitro.run_id") == run_name or r.info.run_name == run_name]
    if len(runs) != 1:
        sys.exit(f"fingerprint: expected one MLflow run for {run_name}, found {len(runs)}")
    rounds: dict[str, dict[str, float]] = {}
    for key in sorted(runs[0].data.metrics):
        if not clock_free(key):
            continue
        for m in client.get_metric_history(runs[0].info.run_id, key):
            rounds.setdefault(str(m.step), {})[key] = m.value
    return rounds


def compare(before: dict, after: dict) -> list[str]:
    """Every clock-free value that differs, as lines; empty when the runs are identical."""
    diffs = []
    for run in sorted(set(before) | set(after)):
        b, a = before.get(run, {}), after.get(run, {})
        for step in sorted(set(b) | set(a), key=int):
            for key in sorted(set(b.get(step, {})) | set(a.get(step, {}))):
                x, y = b.get(step, {}).get(key), a.get(step, {}).get(key)
                same = x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))
                if not same:
                    diffs.append(f"{run} round {step} {key}: {x} -> {y}")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="a fingerprint to compare against")
    parser.add_argument("--only", action="append", help="run only these names")
    args = parser.parse_args()
    from nitro.experiments.machine import machine_info

    result: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="nitro-fingerprint-") as tmp:
        for name, overrides in RUNS.items():
            if args.only and name not in args.only:
                continue
            result[name] = run_one(name, overrides, Path(tmp) / name)
    Path(args.out).write_text(json.dumps({"machine": machine_info(), "load_avg": os.getloadavg(),
                                          "runs": result}, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(Path(args.compare).read_text())["runs"]
        diffs = compare({k: v for k, v in before.items() if k in result}, result)
        print("\n".join(diffs[:50]) or "identical: every clock-free metric of every round")
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
