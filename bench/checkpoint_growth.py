"""What a round's checkpoint costs as the run grows: the history whole in every checkpoint, against
the history in shared blocks (nitro/run/rowblocks.py).

    python bench/checkpoint_growth.py                      # Humanoid-v5's state, 10 to 20000 rounds
    python bench/checkpoint_growth.py --env Hopper-v5 --sizes 10,1000

1. A real run of two rounds (``nitro train``'s path: Prefect, Redis, MLflow, local actors) gives a
   real checkpoint: the learner's tensors and Adam state, the scaler, a history row and a ledger
   row as the engine writes them.
2. For each size n, a history and a ledger of n rows (copies of the real rows, each its own object,
   as the engine's are), then --rounds rounds each appending one row to both and doing what
   ``checkpoint_run`` does: save, then prune (the newest 3 and the best 1). Both arms run the
   same sequence side by side in one process: ``whole`` (every list inline, as before) and
   ``blocks`` (``history`` and ``ledger/rounds`` append-only). The first save at each size is not
   timed (the blocks arm writes every block once there, as a resumed run's first checkpoint does).
3. A resume's read of the newest checkpoint (check against the digests, then load) at each size.

Writes bench/results/checkpoint_growth.json (``--out``: another name). Run it alone on a quiet
machine; it records the load averages before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time

from _common import RESULTS, isolated_home, machine, run_overrides


def real_state(env_id: str, home) -> dict:
    from cli.session import run_command
    from flows.training import train
    from nitro.config import NitroConfig
    from nitro.run.rundir import RunDir

    overrides = [f"env_id={env_id}", "rounds=2", *run_overrides(home)]
    config = NitroConfig.from_yaml(None, overrides)
    run_command(config, "growth", lambda: asyncio.run(train(overrides=overrides, run_id="growth")))
    return RunDir(config.home, "growth").load()[1]


def arm(state: dict, n: int, rounds: int, append_only: tuple[str, ...], folder) -> dict:
    from nitro.run.rundir import RunDir

    row, cost = state["history"][-1], state["ledger"]["rounds"][-1]
    history = [dict(row, round=float(i)) for i in range(n)]
    ledger = [dict(cost, round_idx=i) for i in range(n)]
    run = RunDir(folder, f"{'-'.join(append_only) or 'whole'}-{n}".replace("/", "_"))

    def checkpoint(k: int) -> tuple[float, float]:
        history.append(dict(row, round=float(k)))
        ledger.append(dict(cost, round_idx=k))
        snapshot = {**state, "history": list(history), "ledger": {**state["ledger"], "rounds": list(ledger)}}
        started = time.perf_counter()
        run.save(k, snapshot, eval_return=float(k % 7), append_only=append_only)
        saved = time.perf_counter()
        run.prune(3, 1)
        return saved - started, time.perf_counter() - saved

    checkpoint(n)  # not timed: the blocks arm writes all of its blocks here
    timed = [checkpoint(k) for k in range(n + 1, n + 1 + rounds)]
    started = time.perf_counter()
    newest = RunDir(folder, run.run_id).load_newest_good()
    load_s = time.perf_counter() - started
    assert newest is not None and len(newest[1]["history"]) == n + rounds + 1
    assert newest[1]["ledger"]["rounds"][-1]["round_idx"] == n + rounds
    blocks = run.blocks.folder
    return {
        "save_ms": 1000 * statistics.median(s for s, _ in timed),
        "prune_ms": 1000 * statistics.median(p for _, p in timed),
        "resume_load_ms": 1000 * load_s,
        "state_json_bytes": (run.round_dir(newest[0]) / "state.json").stat().st_size,
        "blocks_bytes": sum(p.stat().st_size for p in blocks.iterdir()) if blocks.is_dir() else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="Humanoid-v5")
    parser.add_argument("--sizes", default="10,100,1000,5000,20000")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="checkpoint_growth.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    home = isolated_home("checkpoint-growth")
    try:
        state = real_state(args.env, home)
        from nitro.run.engine import APPEND_ONLY

        rows = []
        for n in map(int, args.sizes.split(",")):
            for name, append_only in (("whole", ()), ("blocks", APPEND_ONLY)):
                result = {"rows": n, "arm": name, **arm(state, n, args.rounds, append_only, home / "arms")}
                rows.append(result)
                print(f"{n:>6} rows  {name:<6}  save {result['save_ms']:8.1f} ms  prune {result['prune_ms']:6.1f} ms"
                      f"  resume {result['resume_load_ms']:8.1f} ms"
                      f"  state.json {result['state_json_bytes'] / 1e3:9.1f} kB", flush=True)
        ratios = {str(n): round(next(r["save_ms"] for r in rows if r["rows"] == n and r["arm"] == "blocks")
                                / next(r["save_ms"] for r in rows if r["rows"] == n and r["arm"] == "whole"), 3)
                  for n in map(int, args.sizes.split(","))}
        print("save, blocks / whole:", ratios)
        out = RESULTS / args.out
        out.write_text(json.dumps({"env": args.env, "rounds_timed": args.rounds, "results": rows,
                                   "save_ratio_blocks_to_whole": ratios,
                                   "machine": machine(load_before=load_before, load_after=os.getloadavg())}, indent=2))
        print(f"wrote {out}")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
