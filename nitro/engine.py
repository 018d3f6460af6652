"""One training run's state and the four steps of a round (SPEC.md, paper §4 Fig. 6).

    round k:  update_policy -> detect -> decide -> (publish weights, invoke actors) -> end_round

``Trainer`` holds the learner, the scaler, the cost ledger and the bookkeeping between rounds. It
knows nothing of Prefect: ``flows/`` calls these steps through thin ``tasks/``, and the same steps
can be driven by a plain loop. Everything a round needs to resume lives in ``state_dict()``,
which ``end_round`` checkpoints.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nitro.actors.events import ActorEvent, ActorSummary, invocation_id
from nitro.cache import TrajectoryCache
from nitro.config import NitroConfig
from nitro.cost import ledger_from_config
from nitro.detector import Detection, detect_on_batch
from nitro.envs import env_spec
from nitro.impact import ImpactLearner
from nitro.ppo import PPOLearner
from nitro.scalers import RoundSignal, cap_by_budget, make_scaler
from nitro.serialization import SerializationError, dumps_tensors, loads_tensors

log = logging.getLogger("nitro")

STOP_ROUNDS = "round_limit"
STOP_TARGET = "target_reward"
STOP_BUDGET = "budget_spent"


@dataclass
class UpdateReport:
    samples: int = 0
    batches: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Decision:
    n_actors: int
    wanted: int
    reason: str
    score: float | None = None


@dataclass
class RoundReport:
    round: int
    metrics: dict[str, float]
    stop_reason: str | None


class Trainer:
    """The learner side of one training run."""

    def __init__(self, config: NitroConfig, run_id: str, cache: TrajectoryCache, actor_cache_url: str,
                 actor_credentials: dict[str, str] | None = None):
        self.config = config
        self.run_id = run_id
        self.cache = cache
        self.actor_cache_url = actor_cache_url
        self.actor_credentials = actor_credentials or {}
        self.spec = env_spec(config.env_id)
        torch.set_num_threads(config.learner_threads)
        if config.algo == "impact":
            self.learner = ImpactLearner(self.spec, config.impact, seed=config.seed, device=config.device)
        else:
            self.learner = PPOLearner(self.spec, config.ppo, seed=config.seed, device=config.device)
        self.asynchronous = config.algo == "impact" and config.impact.asynchronous
        self.scaler = make_scaler(config.scaler, seed=config.seed, steps_per_actor=config.steps_per_actor)
        self.ledger = ledger_from_config(config)
        self.next_round = 0
        self.env_steps_total = 0
        self.pending: list[str] = []  # invocation ids whose batches the next update consumes
        self.last_round_s: float | None = None
        self.history: list[dict[str, float]] = []
        # per-round scratch, not checkpointed: a round is redone whole on resume
        self._update = UpdateReport()
        self._detection: Detection | None = None
        self._decision: Decision | None = None
        self._round_start = 0.0
        self._actors_done = threading.Event()
        self._current_round: int | None = None

    def _begin(self, k: int) -> None:
        """Reset the per-round scratch when round k's first step runs (which step comes first
        depends on the algorithm's round shape)."""
        if self._current_round == k:
            return
        self._current_round = k
        self._round_start = time.perf_counter()
        self._update, self._detection, self._decision = UpdateReport(), None, None
        self._actors_done.clear()

    # -- step 1 --------------------------------------------------------------------------

    def update_policy(self, k: int) -> UpdateReport:
        """Collect the previous round's batches (until the deadline) and update the policy."""
        self._begin(k)
        if self.asynchronous:  # off-policy: the update runs while this round's actors act
            return self._update
        if not self.pending:
            self._update = UpdateReport()
            return self._update
        t0 = time.perf_counter()
        collected = self.cache.collect(k - 1, set(self.pending), deadline_s=self.config.round_deadline_s)
        report = UpdateReport(missing=sorted(collected.missing))
        batches = self._decode(k, collected.batches, report)
        report.batches = len(batches)
        if collected.missing:
            log.warning("round %d: %d of %d batches missing at the deadline", k, len(collected.missing), len(self.pending))
        if batches:
            report.metrics = self.learner.update(batches)
            report.samples = int(sum(len(b["rewards"]) for b in batches))
        report.seconds = time.perf_counter() - t0
        self._update = report
        return report

    # -- step 2 --------------------------------------------------------------------------

    def detect(self, k: int) -> Detection | None:
        """Hessian extremes of the surrogate on a subset of the batch just trained on."""
        self._begin(k)
        data = getattr(self.learner, "last_batch", None)
        fresh = self.asynchronous or self._update.samples > 0  # async: the batch of the last update
        if not self.config.detector.enabled or data is None or not fresh:
            self._detection = None
            return None
        self._detection = detect_on_batch(
            self.learner, data, n_total=len(data["rewards"]), subset_size=self.config.detector.subset_size,
            steps=self.config.detector.lanczos_steps, seed=self.config.seed + k,
        )
        return self._detection

    # -- step 3 --------------------------------------------------------------------------

    def decide(self, k: int) -> Decision:
        """How many actors this round gets: the scaler's wish, capped by the remaining budget."""
        self._begin(k)
        det = self._detection
        signal = RoundSignal(R=det.R if det is not None else None,
                             grad_noise_scale=self._update.metrics.get("grad_noise_scale"))
        wanted = int(self.scaler.decide(k, signal))
        n, reason = wanted, self.config.scaler.name
        remaining = self.ledger.remaining(self.config.budget_usd)
        if remaining is not None:
            # Upper bounds, so the ledger never passes the budget: each actor may be billed up to
            # its timeout, and the learner's share is taken as twice the last round's wall time.
            fixed = self.ledger.round_fixed_cost(2 * (self.last_round_s or 10.0))
            n = cap_by_budget(wanted, remaining, self.ledger.max_actor_cost(), fixed, min_actors=1)
            if n < wanted:
                reason = f"{reason}, capped by budget (${float(remaining):.4f} left)"
        self._decision = Decision(n_actors=n, wanted=wanted, reason=reason, score=self.scaler.last.get("score"))
        return self._decision

    # -- step 4 --------------------------------------------------------------------------

    def publish_weights(self, k: int) -> str:
        payload = dumps_tensors(
            self.learner.weights(), {"format": "nitro.policy/1", "env_id": self.config.env_id, "version": k}
        )
        return self.cache.publish_weights(k, payload)

    def actor_events(self, k: int, n: int, weights_key: str) -> list[ActorEvent]:
        """One event per invocation; seeds depend on (seed, round, slot) only, so a run is
        reproducible however the invocations are scheduled."""
        events = []
        for i in range(n):
            seed = int(np.random.SeedSequence([self.config.seed, k, i]).generate_state(1, dtype=np.uint64)[0] >> 1)
            events.append(ActorEvent(
                run_id=self.run_id, round=k, invocation_id=invocation_id(self.run_id, k, i), weights_key=weights_key,
                env_id=self.config.env_id, seed=seed, n_steps=self.config.steps_per_actor,
                cache_url=self.actor_cache_url, cache_credentials=self.actor_credentials,
                batch_ttl_s=self.config.redis.ttl_s,
            ))
        return events

    def learn_while_acting(self, k: int, expected_ids: list[str]) -> UpdateReport:
        """Off-policy step 1, overlapping step 4 (paper §4): update on each batch of this round as
        it lands in the cache; while nothing new has landed, replay from the buffer; stop when
        every batch is in, or the actors are done and nothing more came, or at the deadline."""
        deadline = time.perf_counter() + self.config.round_deadline_s
        waiting, report, busy = set(expected_ids), UpdateReport(), 0.0
        updates = replays = 0
        wait_s = 0.0
        while waiting and time.perf_counter() < deadline:
            got = self.cache.collect(k, waiting, deadline_s=wait_s)
            waiting -= set(got.batches)
            batches = self._decode(k, got.batches, report)
            started = time.perf_counter()
            if batches:
                report.metrics = self.learner.update(batches)
                report.samples += int(sum(len(b["rewards"]) for b in batches))
                report.batches += len(batches)
                updates += 1
            elif self.learner.replay_update() is not None:
                replays += 1
            elif self._actors_done.is_set():
                break  # nothing landed, nothing to replay, and no actor will write any more
            else:
                wait_s = 0.2  # nothing to learn from: block on the cache for a moment
                continue
            busy += time.perf_counter() - started
            wait_s = 0.0
        report.missing = sorted(waiting)
        report.seconds = busy
        report.metrics = {**report.metrics, "updates": float(updates), "replay_updates": float(replays),
                          "learner_busy_s": busy}
        self._update = report
        return report

    def actors_finished(self) -> None:
        """Tell ``learn_while_acting`` that no more batches are coming this round."""
        self._actors_done.set()

    def _decode(self, k: int, payloads: dict[str, bytes], report: UpdateReport) -> list[dict]:
        batches = []
        for inv_id, payload in sorted(payloads.items()):
            try:
                batches.append(loads_tensors(payload, expect_format="nitro.batch/1")[0])
            except SerializationError as exc:
                log.warning("round %d: dropped corrupt batch %s: %s", k, inv_id, exc)
                report.corrupt.append(inv_id)
        return batches

    # -- bookkeeping ---------------------------------------------------------------------

    def end_round(self, k: int, summaries: list[ActorSummary], actor_s: float, orchestration_s: float = 0.0) -> RoundReport:
        """Charge the round, compute its metrics and decide whether the run goes on."""
        round_s = time.perf_counter() - self._round_start
        seen: set[str] = set()
        unique = [s for s in summaries if not (s.invocation_id in seen or seen.add(s.invocation_id))]
        ok = [s for s in unique if s.ok]
        for s in unique:
            if not s.ok:
                log.warning("round %d: actor %s failed: %s", k, s.invocation_id, s.error)
        steps = sum(s.steps for s in ok)
        self.env_steps_total += steps
        cost = self.ledger.charge_round(
            k, learner_seconds=round_s,
            actor_billed_ms=[s.billed_ms for s in unique], n_requests=len(unique),
            provisioned_seconds=round_s,
        )
        returns = [r for s in ok for r in s.episode_returns]
        det, dec, upd = self._detection, self._decision, self._update
        metrics: dict[str, float] = {
            "return_mean": float(np.mean(returns)) if returns else math.nan,
            "return_max": float(np.max(returns)) if returns else math.nan,
            "episodes": float(len(returns)),
            "env_steps": float(steps),
            "env_steps_total": float(self.env_steps_total),
            "actors_launched": float(len(unique)),
            "actors_failed": float(len(unique) - len(ok)),
            "batches_missing": float(len(upd.missing) + len(upd.corrupt)),
            "boost_score": float(dec.score) if dec is not None and dec.score is not None else math.nan,
            "hessian_R": _num(det.R if det is not None else None),
            "lambda_max": _num(det.lambda_max if det is not None else None),
            "lambda_min": _num(det.lambda_min if det is not None else None),
            "learner_s": upd.seconds,
            "detection_s": det.seconds if det is not None else 0.0,
            "actor_s": actor_s,
            "orchestration_s": orchestration_s,
            "round_s": round_s,
        }
        for name in ("learner", "lambda_compute", "requests", "provisioned"):
            metrics[f"spend_{name}_usd"] = float(getattr(cost, name))
        metrics["spend_round_usd"] = float(cost.total)
        metrics["spend_total_usd"] = float(cost.cumulative)
        metrics.update({f"{self.config.algo}/{name}": float(v) for name, v in upd.metrics.items()})
        self.history.append({"round": float(k), **metrics})
        self.pending = [] if self.asynchronous else [s.invocation_id for s in ok]
        self.last_round_s = round_s
        self.next_round = k + 1
        if k >= 1:
            self.cache.delete_round(k - 1)  # consumed by this round's update
        return RoundReport(k, metrics, self.stop_reason(metrics))

    def record_wall_time(self, k: int, round_wall_s: float) -> dict[str, float]:
        """Round k's wall time as the orchestrator measured it, around the whole round flow; the
        part not spent learning, detecting or acting is orchestration. Off-policy, the update
        overlaps the actors, so only its tail after them counts."""
        row = self.history[-1]
        assert int(row["round"]) == k, f"round {k} is not the last recorded ({row['round']})"
        learning = row["learner_s"]
        if self.asynchronous:
            learning = max(0.0, learning - row["actor_s"])
        work = learning + row["detection_s"] + row["actor_s"]
        row["round_s"] = round_wall_s
        row["orchestration_s"] = max(0.0, round_wall_s - work)
        return {key: v for key, v in row.items() if key != "round"}

    def final_return(self) -> float | None:
        """Mean return of the last round with finished episodes (a budget stop ends with a round
        that launched no actors)."""
        finished = [r["return_mean"] for r in self.history if not math.isnan(r["return_mean"])]
        return finished[-1] if finished else None

    def stop_reason(self, metrics: dict[str, float]) -> str | None:
        cfg = self.config
        target, ret = cfg.target_reward, metrics.get("return_mean", math.nan)
        if target is not None and not math.isnan(ret) and ret >= target:
            return STOP_TARGET
        if cfg.budget_usd is not None and self._decision is not None and self._decision.n_actors == 0:
            return STOP_BUDGET
        if self.next_round >= cfg.rounds:
            return STOP_ROUNDS
        return None

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_round": self.next_round,
            "env_steps_total": self.env_steps_total,
            "pending": list(self.pending),
            "last_round_s": self.last_round_s,
            "history": self.history,
            "learner": dict(zip(("tensors", "meta"), self.learner.state_dict())),
            "scaler": self.scaler.state_dict(),
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_round = int(state["next_round"])
        self.env_steps_total = int(state["env_steps_total"])
        self.pending = list(state["pending"])
        self.last_round_s = state["last_round_s"]
        self.history = list(state["history"])
        self.learner.load_state_dict(state["learner"]["tensors"], state["learner"]["meta"])
        self.scaler.load_state_dict(state["scaler"])
        self.ledger.load_state_dict(state["ledger"])


def round_line(report: RoundReport, rounds: int) -> str:
    """The one INFO line per round that people read."""
    m = report.metrics
    ret = "   n/a" if math.isnan(m["return_mean"]) else f"{m['return_mean']:8.1f}"
    r = "" if math.isnan(m["hessian_R"]) else f" R={m['hessian_R']:.3g}"
    failed = f" ({int(m['actors_failed'])} failed)" if m["actors_failed"] else ""
    return (f"round {report.round + 1}/{rounds}: actors={int(m['actors_launched'])}{failed} "
            f"steps={int(m['env_steps'])} return={ret}{r} spend=${m['spend_total_usd']:.4f} {m['round_s']:.1f}s")


def _num(value: float | None) -> float:
    return math.nan if value is None else float(value)
