"""Where the test suite's time goes, file by file (issue 46: the suite in at most ten minutes).

``run CHECKOUT``: the README's test command (``pytest -q -n 4``; ``--serial`` for a checkout from
before the suite ran side by side, whose README says ``pytest -q``) in ``CHECKOUT`` (a clone with
its own ``.venv``, set up by its ``setup.sh``), with a JUnit report; writes the suite's wall time, the
load averages before and after, and per test file the tests, the failures and the seconds its
tests took (setup, call and teardown summed; with ``-n 4`` four run at once, so the files add up to
more than the wall; module-scoped fixtures count in the test that sets them up) to
``bench/results/suite_files_<commit>.json``.

``compare BEFORE.json AFTER.json``: the two side by side, file by file, slowest first.

Usage:  python bench/suite_files.py run /tmp/iso
        python bench/suite_files.py compare bench/results/suite_files_50ff08a.json bench/results/suite_files_<new>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine

RESULTS = Path(__file__).resolve().parent / "results"


def run(checkout: Path, out_dir: Path, serial: bool = False) -> Path:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True,
                            check=True).stdout.strip()
    report = Path(f"/tmp/suite-{commit}.xml")
    load_before = os.getloadavg()
    print(f"suite of {commit} in {checkout} (load {load_before[0]:.1f}) ...", flush=True)
    start = time.monotonic()
    command = ["python", "-m", "pytest", "-q"] + ([] if serial else ["-n", "4"])
    done = subprocess.run([str(checkout / ".venv/bin/python"), *command[1:], "-p", "no:cacheprovider",
                           f"--junitxml={report}"], cwd=checkout, capture_output=True, text=True)
    if not report.exists():
        said = f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        raise SystemExit(f"pytest wrote no report (exit {done.returncode}):\n{said}")
    wall = time.monotonic() - start
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    files: dict[str, dict[str, float]] = defaultdict(lambda: {"tests": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        path = "/".join(name[: next((i + 1 for i, part in enumerate(name) if part.startswith("test_")), len(name))])
        entry = files[path + ".py"]
        entry["tests"] += 1
        entry["seconds"] += float(case.get("time", 0))
        entry["failed"] += int(case.find("failure") is not None or case.find("error") is not None)
        entry["skipped"] += int(case.find("skipped") is not None)
    result = {
        "commit": commit,
        "command": " ".join(command),
        "summary": summary,
        "wall_s": round(wall, 1),
        "files": {k: {**v, "seconds": round(v["seconds"], 1)} for k, v in
                  sorted(files.items(), key=lambda kv: -kv[1]["seconds"])},
        "machine": machine(load_before=[round(x, 2) for x in load_before],
                           load_after=[round(x, 2) for x in os.getloadavg()]),
    }
    out = out_dir / f"suite_files_{commit}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{summary}; wall {wall / 60:.1f} min -> {out}")
    return out


def compare(before_path: Path, after_path: Path) -> None:
    before, after = (json.loads(p.read_text()) for p in (before_path, after_path))
    names = sorted(set(before["files"]) | set(after["files"]),
                   key=lambda n: -max(before["files"].get(n, {}).get("seconds", 0),
                                      after["files"].get(n, {}).get("seconds", 0)))
    print(f"{'file':<36} {before['commit']:>14} {after['commit']:>14}   (test seconds, tests)")
    for name in names:
        cells = []
        for side in (before, after):
            entry = side["files"].get(name)
            cells.append(f"{entry['seconds']:8.1f} ({entry['tests']:3d})" if entry else f"{'-':>14}")
        print(f"{name:<36} {cells[0]:>14} {cells[1]:>14}")
    for side in (before, after):
        print(f"{side['commit']}: wall {side['wall_s'] / 60:.1f} min, {side['summary']}, "
              f"load {side['machine']['load_before'][0]} -> {side['machine']['load_after'][0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("checkout", type=Path)
    p_run.add_argument("--out-dir", type=Path, default=RESULTS)
    p_run.add_argument("--serial", action="store_true", help="pytest -q, without xdist's -n 4")
    p_cmp = sub.add_parser("compare")
    p_cmp.add_argument("before", type=Path)
    p_cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.checkout.resolve(), args.out_dir, args.serial)
    else:
        compare(args.before, args.after)


if __name__ == "__main__":
    main()
