"""The boostability probe: does the Hessian signal say when boosting pays? (paper §2.2, Fig. 7)

One **trunk** run trains with a plain, fixed number of actors. At each branch round k of the spec,
the trunk's state after round k-1 is **forked** into two ordinary runs, its **arms**: ``plain``
keeps the trunk's actors in round k, ``boost`` gets ``boost_actors`` in round k only
(``scaler.actors_at``); after that both run ``horizon`` more rounds with identical settings. The
two arms share everything up to round k's decision (the same update on the same batches, hence the
same R_k), so their difference at round k + horizon is what the extra samples of round k bought:

    gain_k = eval_return(boost, k + horizon) - eval_return(plain, k + horizon)

The probe reports the rank correlation (Spearman) between R_k (and S_k, the score Nitro's scaler
would give round k) and gain_k, with a 95% confidence interval, and plots both. A signal worth
paying for correlates *negatively* with R (Nitro boosts where R is low) and
positively with S_k. Beside them, phi_k: the gradient noise scale the `goodput` scaler reads
(``nitro/scaling/noise.py``), smoothed over the trunk's rounds and round k's update as the scaler
smooths it, and the boost's predicted gain from it, r - 1 with r = B_b / B_p x (phi + B_p) / (phi + B_b)
(``adascale_gain``: what one round of B_b samples is worth in rounds of B_p). r grows with phi, so
it ranks the branches as phi does; a useful phi correlates positively with the gain.

A fork copies the trunk's checkpoint of round k-1 and the cache entries it points at (the
batches round k trains on, the snapshots of the episodes round k continues) under the arm's run
id, so an arm needs nothing of the trunk afterwards and resumes like any run. The copy must be
taken before the trunk's round k deletes those entries: the flow forks from a round observer.

Plain Python; ``flows/probe.py`` orchestrates, ``cli`` has ``nitro probe``.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nitro.cache import TrajectoryCache
from nitro.config import ConfigError, NitroConfig, load_spec_model
from nitro.experiments.report import json_safe
from nitro.experiments.stats import finite
from nitro.run.rundir import RunDir
from nitro.scaling.noise import NoiseTracker, adascale_gain, measurement_from
from nitro.scaling.scalers import NitroScaler, RoundSignal

Arm = Literal["plain", "boost"]
ARMS: tuple[Arm, Arm] = ("plain", "boost")
Z975 = 1.959963984540054


class ProbeError(ConfigError):
    """A probe spec is invalid, or a fork cannot be taken; the message is one line."""


class ProbeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
                      description="MLflow experiment; run ids derive from it")
    description: str = ""
    base: dict[str, Any] = Field(default_factory=dict, description="a NitroConfig mapping")
    overrides: list[str] = Field(default_factory=list, description="dotted key=value, applied after base")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="one trunk per seed")
    branch_rounds: list[int] = Field(min_length=1, description="the rounds k at which the trunk is forked")
    horizon: int = Field(3, ge=1, description="rounds after k; the gain is read at round k + horizon")
    plain_actors: int | None = Field(None, ge=1, description="the trunk's actors per round (default scaler.i_min)")
    boost_actors: int | None = Field(None, ge=1,
                                     description="the boosted arm's actors in round k (default scaler.i_max)")
    eval_episodes: int = Field(10, ge=1, description="whole episodes per evaluation, per mode, in the arms")
    report_dir: str | None = Field(None, description="default: docs/results/<name>")

    @field_validator("branch_rounds", "seeds")
    @classmethod
    def _unique_sorted(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("duplicate values")
        return sorted(v)

    @field_validator("branch_rounds")
    @classmethod
    def _after_an_update(cls, v: list[int]) -> list[int]:
        if v[0] < 2:
            raise ValueError(f"round {v[0]}: a branch round needs an update before it (R_k), so k >= 2")
        return v

    @model_validator(mode="after")
    def _no_budget(self) -> ProbeSpec:
        for key in ("budget_usd", "rounds"):
            if self.base.get(key) is not None:
                raise ValueError(f"base.{key} is set by the probe (branch_rounds and horizon); remove it")
        return self

    @property
    def trunk_rounds(self) -> int:
        """The trunk runs rounds 0 .. last branch round - 1: each fork takes its state after k-1."""
        return max(self.branch_rounds)


def load_probe_spec(source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()) -> ProbeSpec:
    """Validate a spec from a YAML path or a mapping (raises ProbeError, one line); every run's
    config is built once here, so a bad base config fails before anything runs."""
    spec, where = load_spec_model(source, overrides, ProbeSpec, "probe spec", ProbeError)
    try:
        for seed in spec.seeds:
            trunk_config(spec, seed)
            for k in spec.branch_rounds:
                for arm in ARMS:
                    arm_config(spec, seed, k, arm)
    except ConfigError as exc:
        raise ProbeError(f"{where}: {exc}") from None
    return spec


# -- runs, ids and configs ------------------------------------------------------------------------


def _load(spec: ProbeSpec, extra: list[str]) -> NitroConfig:
    # A deep copy: NitroConfig.load applies dotted overrides in place into nested dicts of its input.
    return NitroConfig.load(copy.deepcopy(spec.base), list(spec.overrides) + extra)


def actor_counts(spec: ProbeSpec) -> tuple[int, int]:
    """(plain, boost) actors: the spec's, else the base config's I_min and I_max."""
    scaler = _load(spec, []).scaler
    return spec.plain_actors or scaler.i_min, spec.boost_actors or scaler.i_max


def _plain_run(spec: ProbeSpec, seed: int, extra: list[str]) -> NitroConfig:
    """The base config as a plain run of ``seed``: the fixed scaler at the plain actor count, no
    budget, in the probe's MLflow experiment, R and the gradient noise measured every round (the fixed
    scaler reads neither, the probe does); then ``extra``. Trunk and arms differ only there."""
    plain, _ = actor_counts(spec)
    return _load(spec, [f"seed={seed}", "scaler.name=fixed", f"scaler.fixed_actors={plain}", "budget_usd=null",
                        "detector.enabled=true", "scaler.measure_noise=true", f"tracking.experiment={spec.name}",
                        *extra])


def trunk_run_id(spec: ProbeSpec, seed: int) -> str:
    return f"{spec.name}-s{seed}-trunk"


def arm_run_id(spec: ProbeSpec, seed: int, k: int, arm: Arm) -> str:
    return f"{spec.name}-s{seed}-k{k:03d}-{arm}"


def trunk_config(spec: ProbeSpec, seed: int) -> NitroConfig:
    return _plain_run(spec, seed, [f"rounds={spec.trunk_rounds}"])


def arm_config(spec: ProbeSpec, seed: int, k: int, arm: Arm) -> NitroConfig:
    """The trunk's config, run to round k + horizon, with ``boost_actors`` in round k for ``boost``."""
    extra = [f"rounds={k + spec.horizon + 1}", f"eval.episodes={spec.eval_episodes}"]
    if arm == "boost":
        extra.append(f"scaler.actors_at={{{k}: {actor_counts(spec)[1]}}}")
    return _plain_run(spec, seed, extra)


def arm_finished(config: NitroConfig, run_id: str) -> bool:
    done = RunDir(config.home, run_id).latest_round()
    return done is not None and done >= config.rounds - 1


# -- the fork -------------------------------------------------------------------------------------


def fork(client, home: str | Path, trunk_id: str, arm_id: str, k: int, ttl_s: int) -> None:
    """Make ``arm_id`` a run that continues the trunk from its state after round k-1: the trunk's
    checkpoint of round k-1, and copies of the cache entries it points at under the arm's keys.
    Raises ProbeError when the trunk has no such checkpoint or its entries are gone (the trunk
    has run round k since: it deletes round k-1's entries at the end of round k)."""
    try:
        _, state = RunDir(home, trunk_id).load(k - 1)
    except Exception as exc:
        raise ProbeError(f"cannot fork {arm_id}: no checkpoint of round {k - 1} of {trunk_id} ({exc})") from None
    src, dst = TrajectoryCache(client, trunk_id, ttl_s), TrajectoryCache(client, arm_id, ttl_s)
    pairs = [(src.batch_key(k - 1, inv), dst.batch_key(k - 1, inv)) for inv in state["pending"]]
    prefix = src.round_prefix(k - 1)
    episodes = []
    for key in state.get("open_episodes", []):
        if not key.startswith(prefix + ":"):
            raise ProbeError(f"cannot fork {arm_id}: episode snapshot {key} is not from round {k - 1} of {trunk_id}")
        episodes.append(dst.round_prefix(k - 1) + key[len(prefix):])
    pairs += list(zip(state.get("open_episodes", []), episodes))
    pipe = client.pipeline(transaction=False)
    for a, b in pairs:
        pipe.copy(a, b, replace=True)
        pipe.expire(b, ttl_s)
    copied = pipe.execute()[0::2]
    missing = [a for (a, _), ok in zip(pairs, copied) if not ok]
    if missing:
        raise ProbeError(f"cannot fork {arm_id}: {len(missing)} cache entries of round {k - 1} of {trunk_id} are gone "
                         f"(e.g. {missing[0]}); the trunk must not run round {k} before its forks")
    state["open_episodes"] = episodes
    RunDir(home, arm_id).save(k - 1, state)


# -- what the arms measured -----------------------------------------------------------------------


def score_at(r_history: Sequence[tuple[int, float]], cfg, k: int) -> float | None:
    """S_k, the score Nitro's scaler gives round k after seeing R at the rounds before it (the
    trunk's) and R_k: the same window, decay and formula (``nitro.scaling.scalers.NitroScaler``)."""
    scaler = NitroScaler(cfg)
    for round_idx, R in sorted(r_history):
        if round_idx <= k:
            scaler.decide(round_idx, RoundSignal(R=R))
    return scaler.last.get("score") if scaler.last.get("round") == k else None


def phi_at(rows: Sequence[Mapping[str, float]], decay: float, k: int) -> float | None:
    """phi_k in samples: the policy loss's noise scale smoothed over the measured rounds up to k
    of ``rows`` (per-round histories; the learner's diagnostics under ``<learner>/noise_...``) as
    the `goodput` scaler smooths it (``NoiseTracker``); None where round k measured nothing."""
    tracker, measured_k = NoiseTracker(decay), False
    for row in sorted(rows, key=lambda r: int(r["round"])):
        if int(row["round"]) > k:
            break
        prefix = next((name[: -len("noise_fragments")] for name in row if name.endswith("/noise_fragments")), None)
        m = measurement_from({name[len(prefix):]: v for name, v in row.items() if name.startswith(prefix)}) \
            if prefix is not None else None
        if m is not None:
            tracker.update(m.policy)
            measured_k = int(row["round"]) == k
    estimate = tracker.estimate()
    return estimate.phi if estimate is not None and measured_k else None


def predicted_gain(phi: float | None, plain_samples: float, boost_samples: float) -> float:
    """What a round of ``boost_samples`` is predicted to buy over one of ``plain_samples``, in
    rounds of ``plain_samples``: r - 1 (module docstring); NaN without phi."""
    return adascale_gain(boost_samples, plain_samples, phi) - 1.0 if phi is not None else math.nan


def spearman_ci(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Spearman's rank correlation with a 95% confidence interval from Fisher's z with the
    Bonett-Wright standard error sqrt((1 + rho^2 / 2) / (n - 3)), and the two-sided p-value of
    the test of no association; NaN below 4 pairs (the interval needs n > 3)."""
    from scipy.stats import spearmanr

    pairs = [(float(a), float(b)) for a, b in zip(x, y) if finite(a) and finite(b)]
    n = len(pairs)
    out = {"n": float(n), "rho": math.nan, "ci_low": math.nan, "ci_high": math.nan, "p_value": math.nan}
    if n < 4:
        return out
    res = spearmanr(*zip(*pairs))
    rho = float(res.statistic)
    if not math.isfinite(rho):  # a constant column
        return out
    z = math.atanh(max(-0.999999, min(0.999999, rho)))
    se = math.sqrt((1 + rho * rho / 2) / (n - 3))
    return {**out, "rho": rho, "ci_low": math.tanh(z - Z975 * se), "ci_high": math.tanh(z + Z975 * se),
            "p_value": float(res.pvalue)}


def _row(history: Sequence[Mapping[str, float]], k: int) -> Mapping[str, float]:
    return next((r for r in history if int(r["round"]) == k), {})


def trunk_histories(spec: ProbeSpec) -> dict[int, list[dict[str, float]]]:
    """Per seed, the per-round history of its trunk (seeds whose trunk has no checkpoint: none)."""
    out = {}
    for seed in spec.seeds:
        home, trunk = trunk_config(spec, seed).home, trunk_run_id(spec, seed)
        if RunDir(home, trunk).latest_round() is not None:
            out[seed] = RunDir(home, trunk).load()[1]["history"]
    return out


def probe_rows(spec: ProbeSpec, trunks: Mapping[int, Sequence[Mapping[str, float]]]) -> list[dict[str, Any]]:
    """One row per (seed, branch round) whose two arms finished, given the trunks' histories
    (``trunk_histories``): R_k, S_k, both arms' evaluation returns at k + horizon, the gains and
    what the boost cost more."""
    rows = []
    for seed, trunk_history in trunks.items():
        tcfg = trunk_config(spec, seed)
        for k in spec.branch_rounds:
            arms = {}
            for arm in ARMS:
                cfg, rid = arm_config(spec, seed, k, arm), arm_run_id(spec, seed, k, arm)
                if arm_finished(cfg, rid):
                    arms[arm] = RunDir(cfg.home, rid).load()[1]["history"]
            if len(arms) < 2:
                continue
            at_k = {arm: _row(h, k) for arm, h in arms.items()}
            end = {arm: _row(h, k + spec.horizon) for arm, h in arms.items()}
            R = at_k["plain"].get("hessian_R", math.nan)
            r_hist = [(int(r["round"]), r["hessian_R"]) for r in trunk_history
                      if int(r["round"]) < k and finite(r.get("hessian_R"))]
            score = score_at(r_hist + ([(k, R)] if finite(R) else []), tcfg.scaler, k)
            phi = phi_at([r for r in trunk_history if int(r["round"]) < k] + [at_k["plain"]],
                         tcfg.scaler.noise_decay, k)
            plain_n, boost_n = at_k["plain"].get("actors_launched"), at_k["boost"].get("actors_launched")
            row: dict[str, Any] = {
                "seed": seed, "round": k, "hessian_R": R, "score": math.nan if score is None else score,
                "phi": math.nan if phi is None else phi,
                "predicted_gain": predicted_gain(phi, (plain_n or math.nan) * tcfg.steps_per_actor,
                                                 (boost_n or math.nan) * tcfg.steps_per_actor),
                "hessian_R_boost_arm": at_k["boost"].get("hessian_R", math.nan),  # the same update: equal to R
                "actors_plain": at_k["plain"].get("actors_launched", math.nan),
                "actors_boost": at_k["boost"].get("actors_launched", math.nan),
                "eval_plain": end["plain"].get("eval_return_mean", math.nan),
                "eval_boost": end["boost"].get("eval_return_mean", math.nan),
                "eval_stochastic_plain": end["plain"].get("eval_stochastic_return_mean", math.nan),
                "eval_stochastic_boost": end["boost"].get("eval_stochastic_return_mean", math.nan),
                "extra_spend_usd": (end["boost"].get("spend_total_usd", math.nan)
                                    - end["plain"].get("spend_total_usd", math.nan)),
                "plain_run": arm_run_id(spec, seed, k, "plain"), "boost_run": arm_run_id(spec, seed, k, "boost"),
            }
            row["gain"] = row["eval_boost"] - row["eval_plain"]
            row["gain_stochastic"] = row["eval_stochastic_boost"] - row["eval_stochastic_plain"]
            rows.append(row)
    return rows


def correlations(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Spearman's rho with its 95% CI: R, S_k and phi_k against the gain, both evaluation modes."""
    out = {}
    for signal in ("hessian_R", "score", "phi"):
        for gain in ("gain", "gain_stochastic"):
            out[f"{signal}~{gain}"] = spearman_ci([r[signal] for r in rows], [r[gain] for r in rows])
    return out


# -- the report -----------------------------------------------------------------------------------

ROW_COLUMNS = ("seed", "round", "hessian_R", "score", "phi", "predicted_gain", "hessian_R_boost_arm", "actors_plain",
               "actors_boost",
               "eval_plain", "eval_boost", "gain", "eval_stochastic_plain", "eval_stochastic_boost", "gain_stochastic",
               "extra_spend_usd", "plain_run", "boost_run")
RUN_NAME_COLUMNS = ("plain_run", "boost_run")


def read_branches(report_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """A probe report's ``branches.csv``, the only copy of its per-branch rows: ``seed`` and
    ``round`` as ints, the arms' run ids as text, every other column as a float (NaN where empty)."""
    with (Path(report_dir) / "branches.csv").open(newline="") as fh:
        return [{k: (v if k in RUN_NAME_COLUMNS else int(v) if k in ("seed", "round") else float(v or "nan"))
                 for k, v in row.items()} for row in csv.DictReader(fh)]


def _fmt(v: Any, spec: str = ".3g") -> str:
    return format(float(v), spec) if finite(v) else "n/a"


def correlation_line(c: Mapping[str, float]) -> str:
    return (f"rho = {_fmt(c['rho'], '+.2f')} (95% CI {_fmt(c['ci_low'], '+.2f')} to {_fmt(c['ci_high'], '+.2f')}, "
            f"p = {_fmt(c['p_value'], '.2g')}, n = {int(c['n'])})")


def build_probe_report(spec: ProbeSpec, out_dir: str | os.PathLike, *,
                       parent_run_id: str | None = None) -> dict[str, Any]:
    """README.md, branches.csv (the per-branch rows), probe.json (the spec, the correlations, the
    machine) and the plots in ``out_dir``; returns the results, the rows included."""
    from nitro.experiments.machine import machine_info, machine_markdown
    from nitro.tracking import plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trunks = trunk_histories(spec)
    rows = probe_rows(spec, trunks)
    corr = correlations(rows)
    plain_n, boost_n = actor_counts(spec)
    files = [plots.plot_probe(rows, out / "gain-vs-R.png", "hessian_R",
                              "R_k = |lambda_min / lambda_max| at round k", "R_k"),
             plots.plot_probe(rows, out / "gain-vs-score.png", "score",
                              "S_k, the score Nitro's scaler gives round k", "S_k"),
             plots.plot_probe(rows, out / "gain-vs-phi.png", "phi",
                              "phi_k, the gradient noise scale at round k (samples)", "phi_k")]
    if trunks:
        files.append(plots.plot_probe_trunk(trunks, spec.branch_rounds, out / "trunk-R.png"))
    with (out / "branches.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(ROW_COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    results: dict[str, Any] = {"spec": spec.model_dump(mode="json"), "plain_actors": plain_n, "boost_actors": boost_n,
               "correlations": corr, "parent_run_id": parent_run_id, "machine": machine_info()}
    (out / "probe.json").write_text(json.dumps(json_safe(results), indent=2))
    results["rows"] = rows
    cfg = trunk_config(spec, spec.seeds[0])
    lines = [
        f"# Boostability probe `{spec.name}`", "",
        spec.description.strip(), "",
        f"{cfg.env_id}, {cfg.algo}, seeds {', '.join(map(str, spec.seeds))}. "
        f"A trunk run with {plain_n} actors per round ({cfg.steps_per_actor} steps each) is forked at rounds "
        f"{', '.join(map(str, spec.branch_rounds))}: at round k "
        f"the `plain` arm keeps {plain_n} actors and the `boost` arm gets {boost_n}; then both run {spec.horizon} more "
        f"rounds with {plain_n}. The gain is the difference of their evaluation returns at round k + {spec.horizon} "
        f"(whole episodes, {spec.eval_episodes} per mode, the same start states in both arms).", "",
        "## Does R (or S_k, or phi_k) rank the rounds where boosting pays?", "",
        "Spearman rank correlation, 95% CI from Fisher's z (Bonett-Wright standard error). Nitro boosts where R is "
        "low, so a useful signal has rho < 0 against R and rho > 0 against S_k. The `goodput` scaler boosts where "
        "the noise scale phi_k is high (its predicted gain grows with phi), so a useful phi_k has rho > 0.", "",
        "| signal | gain, mean action | gain, sampled actions |", "|---|---|---|",
        f"| R_k | {correlation_line(corr['hessian_R~gain'])} | {correlation_line(corr['hessian_R~gain_stochastic'])} |",
        f"| S_k | {correlation_line(corr['score~gain'])} | {correlation_line(corr['score~gain_stochastic'])} |",
        f"| phi_k | {correlation_line(corr['phi~gain'])} | {correlation_line(corr['phi~gain_stochastic'])} |", "",
        "![gain vs R](gain-vs-R.png) ![gain vs S_k](gain-vs-score.png) ![gain vs phi_k](gain-vs-phi.png)", "",
    ]
    if trunks:
        lines += ["![R over the trunk's rounds](trunk-R.png)", ""]
    gains = [r["gain"] for r in rows if finite(r["gain"])]
    if gains:
        mean, half = plots.mean_ci95(gains)
        lines += [f"Mean gain of a boost over all branch rounds: {_fmt(mean, '+.1f')} ± {_fmt(half, '.1f')} "
                  f"(95% CI, n = {len(gains)}); it cost ${np.nanmean([r['extra_spend_usd'] for r in rows]):.4f} more "
                  "on average.", ""]
    lines += ["## Branches", "",
              "| seed | k | R_k | S_k | phi_k | predicted gain | eval plain | eval boost | gain | gain (sampled) "
              "| extra $ |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['round']} | {_fmt(r['hessian_R'])} | {_fmt(r['score'])} "
              f"| {_fmt(r['phi'])} | {_fmt(r['predicted_gain'], '+.2f')} "
              f"| {_fmt(r['eval_plain'], '.1f')} | {_fmt(r['eval_boost'], '.1f')} | {_fmt(r['gain'], '+.1f')} "
              f"| {_fmt(r['gain_stochastic'], '+.1f')} | {_fmt(r['extra_spend_usd'], '.4f')} |" for r in rows]
    lines += ["", f"Raw numbers: `branches.csv`, `probe.json`. MLflow: the probe's parent run `{parent_run_id}`, "
              "with the trunk and every arm nested under it.", ""]
    lines += machine_markdown(results["machine"])
    (out / "README.md").write_text("\n".join(lines))
    written = [str(out / n) for n in ("README.md", "branches.csv", "probe.json")]
    return {**results, "files": [str(p) for p in files] + written}
