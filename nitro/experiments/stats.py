"""An experiment's numbers: the same rows as ``nitro compare``, their mean ± 95% CI over seeds, and
each entry's ratio to a reference entry with a bootstrap 95% CI (arch's). The field's statistics
(IQM, probability of improvement, performance profiles: rliable) are in ``aggregate``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nitro.experiments.cells import Cell, cell_run_id

if TYPE_CHECKING:
    from nitro.experiments.spec import ExperimentSpec


def experiment_rows(tracking_uri: str, spec: ExperimentSpec, cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """``compare_runs(tracking_uri, spec.name)`` rows (exactly what ``nitro compare --experiment
    <name>`` prints), restricted to this spec's cells, each with its cell's ``cell``, ``label``
    and ``variant`` added. Sorted as compare sorts them."""
    from nitro.tracking.compare import compare_runs

    by_run = {cell_run_id(spec.name, c): c for c in cells}
    rows = []
    for row in compare_runs(tracking_uri, spec.name):
        cell = by_run.get(row.get("nitro_run_id") or "")
        if cell is None:
            continue
        row = {**row, "cell": cell.key, "label": cell.label, "variant": dict(cell.variant)}
        rows.append(row)
    return rows


def finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


LATE_EVALUATIONS = 5


def late_return(history: Sequence[Mapping[str, Any]], k: int = LATE_EVALUATIONS) -> float:
    """The mean of a run's last ``k`` evaluation returns (``eval_return_mean`` in round order:
    whole episodes, mean action; all of them where it has fewer), NaN where it has none. A run's
    last evaluation alone says where its policy happened to stand that round, and between one
    evaluation and the next a return can swing by thousands; the late return reads its last rounds."""
    evals = [float(h["eval_return_mean"]) for h in sorted(history, key=lambda h: h["round"])
             if finite(h.get("eval_return_mean"))]
    return _mean(evals[-k:])


def return_spend_area(history: Sequence[Mapping[str, Any]], budget_usd: float) -> float:
    """The area under a run's return-vs-spend curve divided by its budget: the mean return its money
    bought along the way, in return units. The curve is the report's figure: each evaluation's return
    (whole episodes, mean action) at the cumulative spend of its round, straight between evaluations;
    the first one (round 0's, the initialised policy) holds from $0 and the last one to the budget,
    since money a run left unspent bought it nothing better (past the budget, to its last spend). NaN
    where the run has no evaluation."""
    points = [(float(h["spend_total_usd"]), float(h["eval_return_mean"]))
              for h in sorted(history, key=lambda h: h["round"])
              if finite(h.get("eval_return_mean")) and finite(h.get("spend_total_usd"))]
    if not points:
        return math.nan
    spend = np.array([x for x, _ in points])
    ret = np.array([y for _, y in points])
    end = max(float(budget_usd), float(spend[-1]))
    area = ret[0] * spend[0] + float(np.sum((spend[1:] - spend[:-1]) * (ret[1:] + ret[:-1]) / 2))
    return float((area + ret[-1] * (end - spend[-1])) / end)


SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("env", "env"),
    ("algo", "algo"),
    ("label", "scaler"),
    ("n", "seeds"),
    ("final_return", "final eval return (mean ± 95% CI)"),
    ("late_return", f"last {LATE_EVALUATIONS} evals' return (mean ± 95% CI)"),
    ("total_spend_usd", "total spend USD (mean ± 95% CI)"),
    ("rounds_done", "rounds (mean)"),
    ("env_steps_total", "env steps (mean)"),
)


def summarize(rows: Sequence[Mapping[str, Any]], labels: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Per (env, algo, label): mean ± 95% CI over seeds of the compare rows' ``final_return``,
    ``late_return`` (where the rows have it: the report adds it) and ``total_spend_usd``, and the
    means of ``rounds_done`` and ``env_steps_total``."""
    from nitro.tracking.plots import mean_ci95

    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["env"]), str(r["algo"]), str(r["label"])), []).append(r)
    order = {lab: i for i, lab in enumerate(labels or [])}

    def group_order(kv: tuple[tuple[str, str, str], Any]) -> tuple[str, str, int, str]:
        (env, algo, label), _ = kv
        return env, algo, order.get(label, 1 << 30), label

    out = []
    for (env, algo, label), rs in sorted(groups.items(), key=group_order):
        fr = [float(r["final_return"]) for r in rs if finite(r.get("final_return"))]
        lr = [float(r["late_return"]) for r in rs if finite(r.get("late_return"))]
        sp = [float(r["total_spend_usd"]) for r in rs if finite(r.get("total_spend_usd"))]
        rd = [float(r["rounds_done"]) for r in rs if finite(r.get("rounds_done"))]
        st = [float(r["env_steps_total"]) for r in rs if finite(r.get("env_steps_total"))]
        pre = [r for r in rs if finite(r.get("pretrain_usd"))]
        (fr_mean, fr_ci), (lr_mean, lr_ci), (sp_mean, sp_ci) = mean_ci95(fr), mean_ci95(lr), mean_ci95(sp)
        out.append({
            "env": env, "algo": algo, "label": label, "n": len(rs),
            "final_return_mean": fr_mean, "final_return_ci95": fr_ci,
            "late_return_mean": lr_mean, "late_return_ci95": lr_ci,
            "total_spend_usd_mean": sp_mean, "total_spend_usd_ci95": sp_ci,
            "rounds_done_mean": _mean(rd), "env_steps_total_mean": _mean(st),
            "final_return_values": fr, "late_return_values": lr, "total_spend_usd_values": sp,
            **_pretrain_means(pre),
        })
    return out


def _pretrain_means(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The group's mean pre-training record (None each where no run of it used a pre-trained
    scheduler): what its scheduler cost before the runs, beside what the runs spent."""
    out: dict[str, float | None] = {}
    for key in ("pretrain_episodes", "pretrain_env_steps", "pretrain_usd"):
        vals = [float(r[key]) for r in rows if finite(r.get(key))]
        out[f"{key}_mean"] = sum(vals) / len(vals) if vals else None
    return out


def _pretrain_cell(s: Mapping[str, Any]) -> str:
    if s.get("pretrain_usd_mean") is None:
        return "-"
    return (f"{s['pretrain_usd_mean']:.4f} ({s['pretrain_episodes_mean']:.0f} episodes, "
            f"{s['pretrain_env_steps_mean']:.0f} env steps)")


def mean_pm(mean: float, half: float | None, fmt: str) -> str:
    """Mean ± 95% half-width; a single seed has no interval and says so."""
    if not finite(mean):
        return "-"
    return f"{mean:{fmt}} ± {half:{fmt}}" if finite(half) else f"{mean:{fmt}} (n=1)"


PRETRAIN_SUMMARY_HEADER = "pre-training USD, projected (episodes, env steps)"


def format_summary(summary: Sequence[Mapping[str, Any]], *, markdown: bool = True) -> str:
    """The summary table; with a pre-training column when a group used a pre-trained scheduler."""
    pretrained = any(s.get("pretrain_usd_mean") is not None for s in summary)
    headers = [h for _, h in SUMMARY_COLUMNS] + ([PRETRAIN_SUMMARY_HEADER] if pretrained else [])
    cells = [[
        s["env"], s["algo"], s["label"], str(s["n"]),
        mean_pm(s["final_return_mean"], s["final_return_ci95"], ".2f"),
        mean_pm(s.get("late_return_mean", math.nan), s.get("late_return_ci95"), ".2f"),
        mean_pm(s["total_spend_usd_mean"], s["total_spend_usd_ci95"], ".4f"),
        f"{s['rounds_done_mean']:.1f}" if finite(s["rounds_done_mean"]) else "-",
        f"{s['env_steps_total_mean']:.0f}" if finite(s["env_steps_total_mean"]) else "-",
        *([_pretrain_cell(s)] if pretrained else []),
    ] for s in summary]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def fmt(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(c) for c in cells)])


MIN_SEEDS_FOR_CI = 3  # a bootstrap of 1-2 seeds per arm draws from 1-3 means: no interval at all


def ratio_ci(a: Sequence[float], b: Sequence[float], seed: int = 0, draws: int = 10_000) -> dict[str, float]:
    """mean(a) / mean(b) with a percentile-bootstrap 95% CI over seeds from arch's
    ``IndependentSamplesBootstrap``: each arm resampled on its own (the arms' seeds are not paired:
    the same seed diverges once the scalers differ). NaN where an arm is empty or not finite; the
    bounds are NaN where an arm has fewer than ``MIN_SEEDS_FOR_CI`` seeds."""
    from arch.bootstrap import IndependentSamplesBootstrap

    a_arr, b_arr = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    nan = {"ratio": math.nan, "lo": math.nan, "hi": math.nan}
    if not (len(a_arr) and len(b_arr)) or not (np.isfinite(a_arr).all() and np.isfinite(b_arr).all()):
        return nan
    if min(len(a_arr), len(b_arr)) < MIN_SEEDS_FOR_CI:
        return {**nan, "ratio": float(a_arr.mean() / b_arr.mean())}
    lo, hi = _percentile_ci(IndependentSamplesBootstrap(a_arr, b_arr, seed=seed), draws)
    return {"ratio": float(a_arr.mean() / b_arr.mean()), "lo": lo, "hi": hi}


def _percentile_ci(bootstrap: Any, draws: int) -> tuple[float, float]:
    """The 95% percentile interval of mean(a) / mean(b) over an arch bootstrap of (a, b)."""
    def ratio(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.array([x.mean() / y.mean()])

    with np.errstate(divide="ignore", invalid="ignore"):  # a resample of b may average 0
        lo, hi = bootstrap.conf_int(ratio, reps=draws, method="percentile", size=0.95)[:, 0]
    return float(lo), float(hi)


def paired_ratio_ci(a: Sequence[float], b: Sequence[float], seed: int = 0,
                    draws: int = 10_000) -> dict[str, float]:
    """mean(a) / mean(b) of paired scores (``a[i]`` and ``b[i]`` from one seed) with a
    percentile-bootstrap 95% CI from arch's ``IIDBootstrap``, which resamples the pairs, so what a
    seed shares between the arms (its start, its host) stays paired. NaN where the arms differ in
    length, are empty, not finite, or ``b``'s mean is not above 0 (no ratio of returns there); the
    bounds are NaN under ``MIN_SEEDS_FOR_CI`` pairs."""
    from arch.bootstrap import IIDBootstrap

    a_arr, b_arr = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    nan = {"ratio": math.nan, "lo": math.nan, "hi": math.nan}
    if (len(a_arr) != len(b_arr) or not len(a_arr) or not (np.isfinite(a_arr).all() and np.isfinite(b_arr).all())
            or b_arr.mean() <= 0):
        return nan
    point = float(a_arr.mean() / b_arr.mean())
    if len(a_arr) < MIN_SEEDS_FOR_CI:
        return {**nan, "ratio": point}
    lo, hi = _percentile_ci(IIDBootstrap(a_arr, b_arr, seed=seed), draws)
    return {"ratio": point, "lo": lo, "hi": hi}


def ratios_against(summary: Sequence[Mapping[str, Any]], reference: str) -> list[dict[str, Any]]:
    """Per (env, algo), every other label's final return, late return and total spend as ratios
    to ``reference``'s (``ratio_ci``); empty where the reference has no finished seeds."""
    out = []
    for ref in (s for s in summary if s["label"] == reference and s["final_return_values"]):
        for s in summary:
            if (s["env"], s["algo"]) != (ref["env"], ref["algo"]) or s["label"] == reference:
                continue
            out.append({"env": s["env"], "algo": s["algo"], "label": s["label"], "reference": reference,
                        "n": len(s["final_return_values"]), "n_reference": len(ref["final_return_values"]),
                        "return": ratio_ci(s["final_return_values"], ref["final_return_values"]),
                        "late_return": ratio_ci(s.get("late_return_values", []), ref.get("late_return_values", [])),
                        "spend": ratio_ci(s["total_spend_usd_values"], ref["total_spend_usd_values"])})
    return out


def format_ratio(r: Mapping[str, float] | None) -> str:
    """One ``ratio_ci`` as ``ratio (lo-hi)``; says so where there are too few seeds for an interval."""
    if not r or not finite(r["ratio"]):
        return "-"
    if not finite(r["lo"]):
        return f"{r['ratio']:.2f} (no CI: under {MIN_SEEDS_FOR_CI} seeds)"
    return f"{r['ratio']:.2f} ({r['lo']:.2f}-{r['hi']:.2f})"


def format_ratios(ratios: Sequence[Mapping[str, Any]]) -> str:
    """The ratio table, Markdown."""
    lines = ["| scaler | against | seeds | final return ratio (95% CI) "
             f"| last {LATE_EVALUATIONS} evals' return ratio (95% CI) "
             "| spend ratio (95% CI) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['reference']} | {r['n']} / {r['n_reference']} | {format_ratio(r['return'])} "
              f"| {format_ratio(r.get('late_return'))} | {format_ratio(r['spend'])} |" for r in ratios]
    return "\n".join(lines)


def time_to_threshold(history: Sequence[Mapping[str, Any]], threshold: float, clock: str = "round_billed_s") -> float:
    """Seconds on the run's billed clock (``clock``: each round's seconds, summed in round order, the
    round of the evaluation included) at its first evaluation (whole episodes, mean action) at or
    above ``threshold``; inf where none reached it."""
    elapsed = 0.0
    for h in sorted(history, key=lambda h: h["round"]):
        elapsed += float(h[clock]) if finite(h.get(clock)) else 0.0
        if finite(h.get("eval_return_mean")) and float(h["eval_return_mean"]) >= threshold:
            return elapsed
    return math.inf


def threshold_table(times: Mapping[str, Sequence[float]], threshold: float,
                    reference: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Per label (its runs' ``time_to_threshold``s): how many reached ``threshold``, their mean time,
    and the mean time's ratio to ``reference``'s (``ratio_ci``) where every run of both reached it (a
    run that never did has no time to average). Markdown lines and the records."""
    ref = list(times.get(reference, []))
    lines = [f"Time to the threshold ({threshold:g}, fixed before any cell ran): seconds on the billed clock "
             "until a run's first evaluation at or above it; ratio to "
             f"`{reference}` (below 1: sooner) only where every run of both reached it.", "",
             "| scaler | reached | mean time of those that reached (s) | ratio (95% CI) |", "|---|---|---|---|"]
    records = []
    for label, ts in times.items():
        reached = [t for t in ts if math.isfinite(t)]
        whole = len(reached) == len(ts) and ref and all(math.isfinite(t) for t in ref)
        ratio = ratio_ci(ts, ref) if whole and label != reference else None
        records.append({"label": label, "threshold": threshold, "reached": len(reached), "n": len(ts),
                        "times_s": list(ts), "ratio": ratio})
        lines.append(f"| {label} | {len(reached)} of {len(ts)} | {f'{_mean(reached):.0f}' if reached else '-'} | "
                     f"{format_ratio(ratio) if ratio else '-'} |")
    return [*lines, ""], records


def round_costs(history: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """A budget run's rounds, read from its ledger: the mean spend and billed seconds of a round at
    the actors its scaler asked for (what one more such round costs), and the rounds the cap held
    under them (some launched, fewer than wanted; the final evaluation round, with none, is not
    one), with the money they took and its share of the run's spend."""
    def spend(h: Mapping[str, Any]) -> float:
        return float(h["spend_round_usd"]) if finite(h.get("spend_round_usd")) else 0.0

    launched = [(h, float(h.get("actors_launched", 0)), float(h.get("actors_wanted", 0))) for h in history]
    full = [h for h, n, wanted in launched if n > 0 and n >= wanted]
    capped = [h for h, n, wanted in launched if 0 < n < wanted]
    total, capped_usd = sum(spend(h) for h in history), sum(spend(h) for h in capped)
    billed = [float(h["round_billed_s"]) for h in full if finite(h.get("round_billed_s"))]
    return {"full_round_usd": _mean([spend(h) for h in full]) if full else math.nan,
            "full_round_billed_s": _mean(billed) if billed else math.nan,
            "capped_rounds": float(len(capped)), "capped_usd": capped_usd,
            "capped_share": capped_usd / total if total > 0 else 0.0}


def round_cost_table(runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]) -> list[str]:
    """Per label (its runs' histories): the mean of ``round_costs`` over its runs."""
    lines = ["What a round costs, from the cells' ledgers (mean over runs): a round at the actors asked for, its "
             "spend and its seconds on the billed clock; and the rounds the budget cap held under them (the cap "
             "reserves each decision's worst case, so every arm runs fewer over the end of its money).", "",
             "| scaler | a full round (USD) | a full round (billed s) | capped rounds | their spend (USD) | "
             "share of the spend |", "|---|---|---|---|---|---|"]
    for label, histories in runs.items():
        costs = [round_costs(h) for h in histories]
        mean = {key: _mean([c[key] for c in costs]) for key in costs[0]}  # a label's group has runs
        lines.append(f"| {label} | {mean['full_round_usd']:.7f} | {mean['full_round_billed_s']:.2f} | "
                     f"{mean['capped_rounds']:.1f} | {mean['capped_usd']:.5f} | {mean['capped_share']:.0%} |")
    return [*lines, ""]
