"""Where does boosting pay? The numbers that cut across the boost studies' reports.

Reads the experiment reports (``docs/results/<name>/``, written by ``nitro experiment``: the
summary and runs from ``results.json``, the rounds from ``rounds.csv`` or ``rounds.csv.gz``) and,
per report, env and matrix entry, prints and writes:

- the final return (mean ± 95% t-interval over seeds) and its ratio to ``fixed`` with a
  percentile-bootstrap 95% CI (``nitro.experiments.stats.ratio_ci``), and the same ratio for the
  mean of each run's last five evaluations (``late_return``), which a swing at the last one moves less;
- the probability that a seed's late return beats a seed of ``fixed``'s (rliable's probability of
  improvement, ``nitro.experiments.aggregate``, with its stratified-bootstrap 95% CI);
- what an actor adds to the bill (``marginal_cost``: its own invocation in its round, and the
  update on its samples in the next), and from it how many more samples a dollar buys in a
  64-actor round than in an 8-actor one. This is the mechanism the studies turn on: when the
  update's time grows with the round's samples, a boosted round's samples cost about what a plain
  round's do, and boosting only moves samples between rounds;
- the same samples-per-dollar ratio fitted to each run on its own (``per_run_ratio``): the bill
  scales with the host's pace, and a task's seeds may have run on hosts of different pace, which a
  fit pooled over them mixes; the ratio of one run's own fit does not depend on its host's pace;
- env steps bought per dollar;
- per probe report (``docs/results/<name>/``, written by ``nitro probe``): Spearman's rho of R_k
  against a boost's gain, with its CI (``probe.json``), and the mean gain over the branches
  (``branches.csv``).

    python bench/boost_study.py                         # the boost-* reports that exist
    python bench/boost_study.py docs/results/hopper-lambda docs/results/boost-constant-steps

No training runs here: it only reads reports, so it may run beside a study.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
from _common import RESULTS, machine

from nitro.experiments.aggregate import format_estimate, improvement_probability
from nitro.experiments.probe import read_branches
from nitro.experiments.rounds import read_rounds
from nitro.experiments.stats import LATE_EVALUATIONS, format_ratio, late_return, mean_pm, ratios_against

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REPORTS = ("hopper-lambda", "boost-equal-money", "boost-constant-steps", "boost-stellaris", "boost-paper-terms")
DEFAULT_PROBES = ("hopper-probe", "probe-hopper", "probe-hopper-constant-steps", "probe-walker2d",
                  "probe-walker2d-constant-steps")


def marginal_cost(runs_rounds: list[list[dict]]) -> dict:
    """What an actor adds to the bill: spend_k = a + b x actors_k + c x actors_(k-1), least squares
    over the rounds of the given runs (each run's first and last rounds left out; the last also pays
    for the final evaluation). A round's actors are billed in it (b), and the update on their samples
    in the next round (c), so an actor's marginal cost is m = b + c, and a dollar buys
    (64 / (a + 64 m)) / (8 / (a + 8 m)) times the samples in a 64-actor round that it does in an
    8-actor one (> 1: boosted samples are cheaper). NaN where the actor counts never vary."""
    x, y = [], []
    for rounds in runs_rounds:
        rs = sorted(rounds, key=lambda r: r["round"])
        for prev, cur in itertools.pairwise(rs[1:-1]):
            vals = (cur.get("actors_launched"), prev.get("actors_launched"), cur.get("spend_round_usd"))
            if all(v is not None and math.isfinite(v) for v in vals):
                x.append([1.0, vals[0], vals[1]])
                y.append(vals[2])
    nan = {"a": math.nan, "per_actor": math.nan, "rounds": len(y), "samples_per_usd_64_over_8": math.nan}
    if len(y) < 4 or np.linalg.matrix_rank(np.asarray(x)) < 3:
        return nan
    (a, b, c), *_ = np.linalg.lstsq(np.asarray(x), np.asarray(y), rcond=None)
    m = b + c
    return {"a": float(a), "per_actor": float(m), "rounds": len(y),
            "samples_per_usd_64_over_8": float((64 / (a + 64 * m)) / (8 / (a + 8 * m)))}


def per_run_ratio(runs_rounds: list[list[dict]]) -> dict:
    """``marginal_cost``'s 64-actor / 8-actor samples-per-dollar ratio fitted to each run alone:
    the median over the runs whose actor counts vary, with the lowest and highest. A host k times
    slower bills a, b and c k times over, which leaves one run's ratio unchanged; a fit pooled over
    runs from hosts of different pace does not."""
    ratios = sorted(r for r in (marginal_cost([rounds])["samples_per_usd_64_over_8"] for rounds in runs_rounds)
                    if math.isfinite(r))
    if not ratios:
        return {"median": math.nan, "low": math.nan, "high": math.nan, "runs": 0}
    return {"median": float(np.median(ratios)), "low": ratios[0], "high": ratios[-1], "runs": len(ratios)}


def study(report_dir: Path) -> dict:
    """The report's own summary (mean ± CI per entry) and its ratios to ``fixed``, with each
    entry's samples per dollar and marginal cost from its finished runs' rounds."""
    results = json.loads((report_dir / "results.json").read_text())
    rounds = read_rounds(report_dir)
    summary = [s for s in results["summary"] if not s.get("sensitivity") and s["final_return_values"]]
    vs_fixed = {(r["env"], r["label"]): r for r in ratios_against(summary, "fixed")}
    out: dict = {"experiment": results["experiment"], "machine": results.get("machine", {}).get("cpu"),
                 "compare": results["spec"]["compare"], "budget_usd": results["spec"].get("budget_usd"),
                 "rounds": results["spec"].get("rounds"), "groups": []}
    def finished(env: str, label: str) -> list[dict]:
        return [r for r in results["runs"] if r["env"] == env and r["label"] == label
                and r.get("status") == "FINISHED" and not r.get("variant")]

    def late(runs: list[dict]) -> list[float]:
        return [v for v in (late_return(rounds[r["run_name"]]) for r in runs) if math.isfinite(v)]

    for s in summary:
        runs = finished(s["env"], s["label"])
        ratio = vs_fixed.get((s["env"], s["label"]), {})
        runs_rounds = [rounds[r["run_name"]] for r in runs]
        mine, fixed = late(runs), late(finished(s["env"], "fixed"))
        improvement = (improvement_probability(mine, fixed).as_dict()
                       if mine and fixed and s["label"] != "fixed" else None)
        out["groups"].append({
            "env": s["env"], "label": s["label"], "seeds": len(s["final_return_values"]),
            "final_return": s["final_return_mean"], "final_return_ci95": s["final_return_ci95"],
            "vs_fixed": ratio.get("return"), "late_return": s.get("late_return_mean"),
            "late_vs_fixed": ratio.get("late_return"), "late_improvement_over_fixed": improvement,
            "spend_usd": s["total_spend_usd_mean"], "rounds_done": s["rounds_done_mean"],
            "env_steps_per_usd": s["env_steps_total_mean"] / s["total_spend_usd_mean"],
            "cost": marginal_cost(runs_rounds), "ratio_per_run": per_run_ratio(runs_rounds),
        })
    return out


def probe(report_dir: Path) -> dict:
    """A probe report's rho (R_k against the gain at mean action) and its mean gain ± 95% CI."""
    from nitro.tracking.plots import mean_ci95

    results = json.loads((report_dir / "probe.json").read_text())
    gains = [r["gain"] for r in read_branches(report_dir) if math.isfinite(r["gain"])]
    mean, ci = mean_ci95(gains) if gains else (math.nan, math.nan)
    spec = results["spec"]
    return {"probe": spec["name"], "env": spec["base"]["env_id"], "machine": results.get("machine", {}).get("cpu"),
            "horizon": spec["horizon"], "seeds": len(spec["seeds"]), "branches": len(gains),
            "minibatches": (spec["base"].get("ppo") or {}).get("minibatches"),
            "rho_R_gain": results["correlations"].get("hessian_R~gain"), "gain_mean": mean, "gain_ci95": ci}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="*", help="report directories (default: the boost studies under docs/results)")
    args = parser.parse_args()
    dirs = [Path(p) for p in args.reports] or [ROOT / "docs/results" / n for n in DEFAULT_REPORTS]
    studies = [study(d) for d in dirs if (d / "results.json").exists()]
    if not studies:
        sys.exit("no report with a results.json among: " + ", ".join(map(str, dirs)))
    print(f"| study | env | scaler | seeds | final return | vs fixed (95% CI) | last {LATE_EVALUATIONS} evals vs fixed "
          f"| P(last {LATE_EVALUATIONS} evals > fixed's) (95% CI) | spend | rounds | env steps/$ "
          "| $ per actor, marginal | $ per round, fixed part "
          "| samples/$, 64-actor / 8-actor round | the same, per run: median (range) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in studies:
        for g in s["groups"]:
            c, pr = g["cost"], g["ratio_per_run"]
            per_run = f"{pr['median']:.2f} ({pr['low']:.2f}-{pr['high']:.2f})" if pr["runs"] else "-"
            final = mean_pm(g["final_return"], g["final_return_ci95"], ".0f")
            print(f"| {s['experiment']} | {g['env']} | {g['label']} | {g['seeds']} | {final} "
                  f"| {format_ratio(g['vs_fixed'])} | {format_ratio(g['late_vs_fixed'])} "
                  f"| {format_estimate(g['late_improvement_over_fixed'], '.2f')} | {g['spend_usd']:.4f} "
                  f"| {g['rounds_done']:.0f} | {g['env_steps_per_usd']:.3g} | {c['per_actor']:.2e} | {c['a']:.2e} "
                  f"| {c['samples_per_usd_64_over_8']:.2f} | {per_run} |")
    probes = [probe(ROOT / "docs/results" / n) for n in DEFAULT_PROBES
              if (ROOT / "docs/results" / n / "probe.json").exists()]
    print("\n| probe | env | horizon | seeds | branches | ppo.minibatches | rho, R_k vs gain (95% CI) | mean gain |")
    print("|---|---|---|---|---|---|---|---|")
    for p in probes:
        c = p["rho_R_gain"] or {}
        print(f"| {p['probe']} | {p['env']} | {p['horizon']} | {p['seeds']} | {p['branches']} "
              f"| {p['minibatches'] or '-'} | {c.get('rho', math.nan):+.2f} "
              f"({c.get('ci_low', math.nan):+.2f} to {c.get('ci_high', math.nan):+.2f}) "
              f"| {p['gain_mean']:+.1f} ± {p['gain_ci95']:.1f} |")
    out = RESULTS / "boost_study.json"
    out.write_text(json.dumps({"machine": machine(), "studies": studies, "probes": probes}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
