"""A report's per-round data: one CSV row per run and round, the only copy of it in the report.

The experiment report writes it (``rounds.csv``, or ``rounds.csv.gz`` when the table is larger
than ``GZIP_ABOVE_BYTES``, so that a long study's report stays small in git); carrying a finished
cell from a report (``carry.py``) and ``bench/boost_study.py`` read it back. Values round-trip
exactly: the writer writes a float's shortest repr, the reader parses it back; an empty field is a
metric the round did not log, ``nan`` one it logged as NaN.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROUNDS_CSV = "rounds.csv"
ROUNDS_CSV_GZ = "rounds.csv.gz"
GZIP_ABOVE_BYTES = 1_000_000
RUN_COLUMNS = ("run_name", "label", "env", "algo", "seed")  # which run a row belongs to, not what it measured


def write_rounds(out_dir: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> Path:
    """The rows as CSV in ``out_dir``, gzip-compressed above ``GZIP_ABOVE_BYTES``; the other
    name's file, left by an earlier report of another size, is removed. Returns the path written."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    data = buf.getvalue().encode()
    big = len(data) > GZIP_ABOVE_BYTES
    gz, plain = out_dir / ROUNDS_CSV_GZ, out_dir / ROUNDS_CSV
    path, stale = (gz, plain) if big else (plain, gz)
    path.write_bytes(gzip.compress(data, mtime=0) if big else data)  # mtime 0: the same rows, the same bytes
    stale.unlink(missing_ok=True)
    return path


def rounds_path(report_dir: str | Path) -> Path:
    """The report's rounds file (``rounds.csv.gz`` or ``rounds.csv``); FileNotFoundError if neither."""
    for name in (ROUNDS_CSV_GZ, ROUNDS_CSV):
        path = Path(report_dir) / name
        if path.exists():
            return path
    raise FileNotFoundError(f"no {ROUNDS_CSV} or {ROUNDS_CSV_GZ} in {report_dir}")


def read_rounds(report_dir: str | Path) -> dict[str, list[dict[str, float]]]:
    """Per run name, its rounds in file order: ``round`` as an int, every metric the round logged as
    a float (the rows ``build_report`` wrote, less the columns that name the run)."""
    path = rounds_path(report_dir)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    runs: dict[str, list[dict[str, float]]] = {}
    for row in csv.DictReader(io.StringIO(text, newline="")):
        runs.setdefault(row["run_name"], []).append(
            {k: int(v) if k == "round" else float(v) for k, v in row.items() if k not in RUN_COLUMNS and v != ""})
    return runs
