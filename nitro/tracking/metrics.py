"""The per-round metrics: their names and the one pure function that computes them.

Rounds are numbered from 0 everywhere: MLflow step k, Prefect subflow ``<run id>-round-k``, row
``round=k`` of the Prefect table artifact and the CLI's ``round k`` line are the same round. The
engine produces exactly ``ROUND_METRICS`` (plus the learner's diagnostics, prefixed with its name,
e.g. ``ppo/kl``, and with actors on VMs the fleet's ``vm/instances``, ``vm/started``, ``vm/stopped``,
``vm/startup_s``, ``vm/wait_s`` (idle), ``vm/replay_s``, ``vm/replay_updates`` from ``nitro.pricing.vm``);
the tracker, ``nitro.tracking.compare`` and ``nitro.tracking.plots`` read them by these names::

    eval_return_mean, eval_return_std    evaluation: whole episodes of the round's policy, mean action
                                         (NaN between evaluations; the score a run is judged by)
    eval_stochastic_return_mean, _std,   the same with sampled actions
    eval_stochastic_episodes
    eval_episodes, eval_invocations      evaluation episodes finished / invocations
    train_return_mean, train_return_max  whole training episodes that ended in the round (sampled
                                         actions, may span rounds): a diagnostic
    train_episodes                       training episodes that ended in the round
    env_steps, env_steps_total           env steps this round / cumulative
    actors_launched, actors_failed       actor invocations started / failed or missing
    actors_wanted                        the scaler's count before the budget cap (above
                                         actors_launched only where the cap bound)
    batches_missing, actors_corrupt      batches absent at the deadline / dropped at the learner's door
    boost_score                          the scaler's boosting score S_k (NaN: no score)
    hessian_R, lambda_max, lambda_min    detection output
    spend_round_usd, spend_total_usd     spend of the round / cumulative
    spend_learner_usd, spend_lambda_compute_usd, spend_requests_usd, spend_provisioned_usd,
    spend_vm_usd, spend_interrupted_usd  the round's spend by ledger line (vm: actors on EC2 instances)
    learner_s, detection_s, actor_s      wall seconds of the round's parts
    orchestration_s, round_s             the rest of the round / the whole round, as the loop over
                                         rounds timed it around the round's flow
    round_lambda_s, round_billed_s       the round had its invocations run at once on Lambda
                                         (nitro.pricing.clock) / the seconds the learner was billed for
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Protocol

import numpy as np

from nitro.scaling.detector import Detection

EVAL_MODES = ("eval_deterministic", "eval_stochastic")  # invocation modes of the evaluation episodes

ROUND_METRICS: tuple[str, ...] = (
    "eval_return_mean", "eval_return_std", "eval_episodes",
    "eval_stochastic_return_mean", "eval_stochastic_return_std", "eval_stochastic_episodes",
    "eval_invocations",
    "train_return_mean", "train_return_max", "train_episodes",
    "env_steps", "env_steps_total",
    "actors_launched", "actors_wanted", "actors_failed", "batches_missing", "actors_corrupt",
    "boost_score", "hessian_R", "lambda_max", "lambda_min",
    "spend_round_usd", "spend_total_usd",
    "spend_learner_usd", "spend_lambda_compute_usd", "spend_requests_usd", "spend_provisioned_usd",
    "spend_vm_usd", "spend_interrupted_usd",
    "learner_s", "detection_s", "actor_s", "orchestration_s", "round_s",
    "round_lambda_s", "round_billed_s",
)
# What a user judges a run by, in the order the MLflow UI shows them: evaluation return, training
# return, spend, actors, R, boosting score.
HEADLINE_METRICS: tuple[str, ...] = (
    "eval_return_mean", "train_return_mean", "spend_total_usd", "actors_launched", "hessian_R", "boost_score",
)
SCORE_METRIC = "eval_return_mean"


class RoundCost(Protocol):
    """What ``CostLedger.charge_round`` returns, as far as the metrics read it (read-only: the
    ledger's ``RoundCost`` is frozen)."""

    @property
    def learner(self) -> Decimal: ...
    @property
    def lambda_compute(self) -> Decimal: ...
    @property
    def requests(self) -> Decimal: ...
    @property
    def provisioned(self) -> Decimal: ...
    @property
    def vm(self) -> Decimal: ...
    @property
    def total(self) -> Decimal: ...
    @property
    def cumulative(self) -> Decimal: ...


def round_metrics(
    *,
    train_returns: Sequence[float],
    eval_returns: Mapping[str, Sequence[float]],
    env_steps: int,
    env_steps_total: int,
    actors_launched: int,
    actors_wanted: int,
    actors_failed: int,
    eval_invocations: int,
    batches_missing: int,
    actors_corrupt: int,
    boost_score: float | None,
    detection: Detection | None,
    learner_s: float,
    actor_s: float,
    round_lambda_s: float,
    round_billed_s: float,
    cost: RoundCost,
    interrupted_usd: float,
    learner_name: str,
    diagnostics: Mapping[str, float],
) -> dict[str, float]:
    """One round's metrics, every name of ``ROUND_METRICS`` but ``round_s`` and
    ``orchestration_s`` (the loop over rounds adds those once it has timed the round's flow), then
    the learner's diagnostics as ``<learner_name>/<name>``."""
    metrics: dict[str, float] = {
        # whole training episodes that ended this round (sampled actions; an episode may span
        # rounds, so several policy versions): a diagnostic, not the score
        "train_return_mean": float(np.mean(train_returns)) if train_returns else math.nan,
        "train_return_max": float(np.max(train_returns)) if train_returns else math.nan,
        "train_episodes": float(len(train_returns)),
        # the score: whole evaluation episodes of this round's policy (NaN between evaluations)
        **_eval_metrics("eval", eval_returns.get("eval_deterministic", ())),
        **_eval_metrics("eval_stochastic", eval_returns.get("eval_stochastic", ())),
        "env_steps": float(env_steps),
        "env_steps_total": float(env_steps_total),
        "actors_launched": float(actors_launched),
        "actors_wanted": float(actors_wanted),
        "actors_failed": float(actors_failed),
        "eval_invocations": float(eval_invocations),
        "batches_missing": float(batches_missing),
        "actors_corrupt": float(actors_corrupt),
        "boost_score": _number(boost_score),
        "hessian_R": _number(detection.R if detection is not None else None),
        "lambda_max": _number(detection.lambda_max if detection is not None else None),
        "lambda_min": _number(detection.lambda_min if detection is not None else None),
        "learner_s": learner_s,
        "detection_s": detection.seconds if detection is not None else 0.0,
        "actor_s": actor_s,
        "round_lambda_s": round_lambda_s,  # had the invocations run at once on Lambda (nitro.pricing.clock)
        "round_billed_s": round_billed_s,
    }
    for name in ("learner", "lambda_compute", "requests", "provisioned", "vm"):
        metrics[f"spend_{name}_usd"] = float(getattr(cost, name))
    metrics["spend_interrupted_usd"] = interrupted_usd
    metrics["spend_round_usd"] = float(cost.total) + interrupted_usd
    metrics["spend_total_usd"] = float(cost.cumulative)
    metrics.update({f"{learner_name}/{name}": float(v) for name, v in diagnostics.items()})
    return metrics


def timed_round(metrics: Mapping[str, float], round_s: float, overlapped: bool) -> dict[str, float]:
    """``metrics`` with ``round_s`` (the round's wall time as the loop over rounds measured it)
    and ``orchestration_s``: the part of it not spent learning, detecting or acting. With
    ``overlapped`` (an off-policy round) the update runs beside the actors, so only its tail
    after them counts."""
    learning = metrics["learner_s"]
    if overlapped:
        learning = max(0.0, learning - metrics["actor_s"])
    work = learning + metrics["detection_s"] + metrics["actor_s"]
    return {**metrics, "round_s": round_s, "orchestration_s": max(0.0, round_s - work)}


def round_line(round_index: int, metrics: Mapping[str, float], rounds: int) -> str:
    """The one INFO line per round that people read. Rounds are numbered from 0, as in Prefect's
    subflow names, the round table and MLflow's steps: ``round 3 of 0..14`` is the fourth of 15."""
    m = metrics
    train = "   n/a" if math.isnan(m["train_return_mean"]) else f"{m['train_return_mean']:8.1f}"
    evaluated = "" if math.isnan(m["eval_return_mean"]) else f" eval={m['eval_return_mean']:.1f}"
    r = "" if math.isnan(m["hessian_R"]) else f" R={m['hessian_R']:.3g}"
    failed = f" ({int(m['actors_failed'])} failed)" if m["actors_failed"] else ""
    capped = (f" (capped by budget: {int(m['actors_wanted'])} wanted)"
              if m["actors_wanted"] > m["actors_launched"] else "")
    return (f"round {round_index} of 0..{rounds - 1}: actors={int(m['actors_launched'])}{failed}{capped} "
            f"steps={int(m['env_steps'])} train_return={train}{evaluated}{r} "
            f"spend=${m['spend_total_usd']:.4f} {m['round_s']:.1f}s")


def _eval_metrics(prefix: str, returns: Sequence[float]) -> dict[str, float]:
    """Mean and std of whole evaluation episodes' returns, and how many; NaN without any."""
    return {f"{prefix}_return_mean": float(np.mean(returns)) if len(returns) else math.nan,
            f"{prefix}_return_std": float(np.std(returns)) if len(returns) else math.nan,
            f"{prefix}_episodes": float(len(returns))}


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)
