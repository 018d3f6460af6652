"""Which term of goodput's model holds: its price line, its noise scale, its progress model.

Reads a goodput study's report (``docs/results/goodput-study``: ``results.json``, ``runs.csv``
and the rounds file, as ``nitro experiment`` wrote them) and per task prints and writes
``bench/results/goodput_terms.json``:

- **prices**: a full round's cost at each fixed count of the grid (the spec's ``best_of``), from
  those cells' own ledgers (``round_costs``; the median over seeds, whose hosts differ in pace),
  and per seed the grid's own line c0 + c1 N through its four counts (least squares; every arm of
  a seed ran on one host) against the line goodput fitted in that seed's run (``goodput/c0_usd`` +
  ``goodput/c1_usd`` x N, its last fit): fitted over measured per N, the median over such seeds;
- **noise scale**: goodput's smoothed phi of the policy loss (``goodput/phi``), each run's median
  over its second half, then the median and range over its runs;
- **progress model**: at that phi and the measured prices, the model's progress per dollar of each
  fixed count over the grid's smallest, e(N S) / C(N) over e(n0 S) / C(n0) with e(B) = B / (B + phi)
  (``nitro.scaling.noise.efficiency``), beside the realised ratio at equal money: the late return's
  gain over the seed's round-0 evaluation, fixed-N over fixed-n0, paired by seed, with a paired
  bootstrap CI. And the phi at which the model gives the realised ratio; none where the realised
  ratio is below what any phi gives (phi = 0: a bigger round's samples help as much as a smaller
  one's, so C(n0) N / (C(N) n0) is the model's floor) or above its ceiling (C(n0) / C(N));
- **the choice**: goodput's mean actors per round, its share of rounds above I_min; and the count
  goodput's own decision (``nitro.scaling.goodput.choose_count``) would choose at the measured phi
  with the grid's own line, among the grid's range of counts, per seed with a fit (near
  B* = sqrt(phi c0 / c1) in samples, c1 per sample; the smallest count where c0 is not positive).

The model reads phi only through goodput's runs (their rounds keep ``goodput/*`` from the report of
2026-11-29 on; earlier cells' reports did not keep them), so a task without such a run has the
prices and the realised ratios alone.

    python bench/goodput_terms.py                      # docs/results/goodput-study
    python bench/goodput_terms.py docs/results/goodput-study

No training runs here: it only reads a report, so it may run beside a study.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, machine

from nitro.experiments.report import json_safe
from nitro.experiments.restats import read_runs, read_spec
from nitro.experiments.rounds import read_rounds
from nitro.experiments.stats import finite, format_ratio, paired_ratio_ci, round_costs
from nitro.scaling.goodput import choose_count
from nitro.scaling.noise import efficiency
from nitro.scaling.prices import Line

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REPORT = ROOT / "docs" / "results" / "goodput-study"
GOODPUT = "goodput"


def grid_counts(results: dict[str, Any], grid: list[str]) -> dict[str, int]:
    """Each grid entry's fixed actor count, from one of its runs' cell config in ``results.json``."""
    counts: dict[str, int] = {}
    for run in results["runs"]:
        if run["label"] in grid:
            counts.setdefault(run["label"], int(results["configs"][run["cell"]]["scaler"]["fixed_actors"]))
    return counts


def implied_phi(target: float, n: int, n0: int, steps: int) -> float | str:
    """The phi at which e(n S) / e(n0 S) equals ``target``: it runs from 1 (phi = 0) to n / n0
    (phi without bound); a target outside says which end it passed."""
    if target <= 1:
        return "below the floor"
    if target >= n / n0:
        return "above the ceiling"
    return n0 * n * steps * (target - 1) / (n - n0 * target)


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


def _gain(run: dict[str, Any]) -> float:
    """A run's late return above its seed's round-0 evaluation."""
    return float(run["late_return"]) - float(run["start_return"])


def task_terms(env: str, rows: list[dict[str, Any]], rounds: dict[str, list[dict[str, float]]],
               counts: dict[str, int], steps: int, i_min: int) -> dict[str, Any]:
    """The four terms for one task (the module's docstring)."""
    runs = [r for r in rows if r["env"] == env and r.get("status", "FINISHED") == "FINISHED"]
    by_label: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        by_label.setdefault(r["label"], {})[int(r["seed"])] = r
    cost = {label: {seed: round_costs(rounds[r["run_name"]])["full_round_usd"]
                    for seed, r in by_label.get(label, {}).items()} for label in counts}
    measured = {label: _median(list(cost[label].values())) for label in counts}

    phis, actors, above = [], [], []
    own: list[dict[str, Any]] = []  # per seed with a fit: the grid's line on its host, goodput's, their ratio
    for seed, r in sorted(by_label.get(GOODPUT, {}).items()):
        history = rounds[r["run_name"]]
        launched = [h["actors_launched"] for h in history if finite(h.get("actors_launched"))
                    and h["actors_launched"] > 0]
        actors += [float(np.mean(launched))] if launched else []
        above += [float(np.mean([n > i_min for n in launched]))] if launched else []
        fit = [h for h in history if finite(h.get("goodput/c0_usd")) and finite(h.get("goodput/c1_usd"))]
        run_phi = _median([h["goodput/phi"] for h in history[len(history) // 2:] if finite(h.get("goodput/phi"))])
        if finite(run_phi):
            phis.append(run_phi)
        grid = {counts[label]: cost[label][seed] for label in counts if finite(cost[label].get(seed))}
        if fit and len(grid) >= 2:
            c0_fit, c1_fit = fit[-1]["goodput/c0_usd"], fit[-1]["goodput/c1_usd"]
            n = np.array(sorted(grid), dtype=float)
            c1_grid, c0_grid = (float(v) for v in np.polyfit(n, [grid[int(k)] for k in n], 1))
            lo, hi = min(counts.values()), max(counts.values())
            best = (choose_count(lo, run_phi, steps, Line(c0_grid, c1_grid), lo, hi, switch_gain=0.0).best
                    if finite(run_phi) else math.nan)
            own.append({"seed": seed, "grid_c0_usd": c0_grid, "grid_c1_usd": c1_grid, "fit_c0_usd": c0_fit,
                        "fit_c1_usd": c1_fit, "phi": run_phi,
                        "model_best_actors_on_grid_line": best,
                        "fitted_over_measured": {int(k): (c0_fit + c1_fit * k) / grid[int(k)] for k in n}})
    c0 = _median([o["fit_c0_usd"] for o in own])
    c1 = _median([o["fit_c1_usd"] for o in own])
    phi = _median(phis)

    ordered = sorted(counts, key=lambda lab: counts[lab])
    base = ordered[0]
    n0, cost0 = counts[base], measured[base]
    per_count = []
    for label in ordered:
        n, cost = counts[label], measured[label]
        seeds = sorted(set(by_label.get(label, {})) & set(by_label.get(base, {})))
        realised = paired_ratio_ci([_gain(by_label[label][k]) for k in seeds],
                                   [_gain(by_label[base][k]) for k in seeds])
        model = (efficiency(n * steps, phi) / cost) / (efficiency(n0 * steps, phi) / cost0) if finite(phi) else math.nan
        target = realised["ratio"] * cost / cost0 if finite(realised["ratio"]) else math.nan
        per_count.append({
            "label": label, "actors": n, "seeds": len(seeds), "round_usd_measured": cost,
            "round_usd_fitted": c0 + c1 * n if finite(c0) else math.nan,
            "fitted_over_measured": _median([o["fitted_over_measured"][n] for o in own
                                             if n in o["fitted_over_measured"]]),
            "model_progress_per_usd_ratio": model, "realised_gain_ratio": realised,
            "implied_phi": implied_phi(target, n, n0, steps) if finite(target) and n != n0 else None,
        })
    return {"env": env, "steps_per_actor": steps, "base": base, "goodput_runs": len(by_label.get(GOODPUT, {})),
            "goodput_runs_with_fit": len(own), "c0_usd": c0, "c1_usd": c1,
            "phi_median": phi, "phi_range": [min(phis), max(phis)] if phis else None,
            "goodput_mean_actors": _median(actors), "goodput_share_above_i_min": _median(above),
            "per_seed_lines": own, "per_count": per_count}


def print_terms(t: dict[str, Any]) -> None:
    phi = (f"phi median {t['phi_median']:,.0f} samples (runs' medians {t['phi_range'][0]:,.0f} to "
           f"{t['phi_range'][1]:,.0f})" if t["phi_range"] else "phi: no goodput run keeps it")
    print(f"\n{t['env']}: {t['goodput_runs']} goodput runs, {t['goodput_runs_with_fit']} with their fits; {phi}; "
          f"goodput's mean actors {t['goodput_mean_actors']:.1f}, rounds above I_min "
          f"{t['goodput_share_above_i_min']:.0%}")
    for o in t["per_seed_lines"]:
        print(f"  seed {o['seed']}: goodput's price line c0 ${o['fit_c0_usd']:.7f} + c1 ${o['fit_c1_usd']:.7f} x N; "
              f"the grid's on its host c0 ${o['grid_c0_usd']:.7f} + c1 ${o['grid_c1_usd']:.7f} x N; at phi "
              f"{o['phi']:,.0f} that line's best count {o['model_best_actors_on_grid_line']:.0f}")
    print("  count  seeds  round USD (measured)  fitted/measured  model progress/$ vs base  "
          "realised gain vs base (95% CI)  implied phi")
    for c in t["per_count"]:
        implied = c["implied_phi"]
        shown = "-" if implied is None else implied if isinstance(implied, str) else f"{implied:,.0f}"
        print(f"  {c['actors']:>5}  {c['seeds']:>5}  {c['round_usd_measured']:>20.7f}  "
              f"{c['fitted_over_measured']:>15.2f}  {c['model_progress_per_usd_ratio']:>24.2f}  "
              f"{format_ratio(c['realised_gain_ratio']):>30}  {shown}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", nargs="?", default=str(DEFAULT_REPORT))
    args = parser.parse_args(argv)
    report = Path(args.report)
    spec = read_spec(report)
    if not spec.best_of or spec.budget_usd is None:
        print(f"{report}: the spec names no grid (best_of) or no budget; nothing to compare", file=sys.stderr)
        return 2
    results = json.loads((report / "results.json").read_text())
    counts = grid_counts(results, spec.best_of)
    config = next(iter(results["configs"].values()))
    steps, i_min = int(config["steps_per_actor"]), int(config["scaler"]["i_min"])
    rows = read_runs(report, spec.budget_usd)
    rounds = read_rounds(report)
    terms = [task_terms(env, rows, rounds, counts, steps, i_min) for env, _ in spec.tasks]
    for t in terms:
        print_terms(t)
    out = RESULTS / "goodput_terms.json"
    out.write_text(json.dumps(json_safe({"report": str(report.relative_to(ROOT)) if report.is_relative_to(ROOT)
                                         else str(report), "tasks": terms, "machine": machine()}), indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
