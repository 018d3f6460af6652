"""One training run's state and the four steps of a round (SPEC.md, paper §4 Fig. 6).

    round k:  update = update_policy(k)
              detection = detect(k, update)
              decision = decide(k, detection, update)
              events = actor_events(k, decision.n_actors, publish_weights(k));  summaries = invoke each
              report = end_round(k, update, detection, decision, summaries, ...)

Each step is a function of the values the earlier steps returned: nothing of a round is kept
between the steps. ``Trainer`` holds only what lives across rounds (the learner, the scaler, the
cost ledger, the pending invocation ids, the history), and all of it is in ``state_dict()``, which
the pipeline checkpoints after each round. It knows nothing of Prefect: ``flows/`` calls these
steps through thin ``tasks/``, and the same steps can be driven by a plain loop.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np
import torch

from nitro.actors.events import ActorEvent, ActorSummary, invocation_id, invocation_mode
from nitro.budget import DEADLINE_SHARE, LearnerBound, decision_cost
from nitro.clock import RoundClock
from nitro.cache import TrajectoryCache
from nitro.checkpoint import load_inflight, save_inflight
from nitro.config import NitroConfig
from nitro.cost import ledger_from_config
from nitro.detector import Detection, detect_on_batch
from nitro.envs import env_spec
from nitro.learners import Learner, OffPolicyLearner, make_learner
from nitro.learners.common import annealed_lr
from nitro.scalers import RoundSignal, largest_affordable, make_scaler
from nitro.serialization import dumps_tensors
from nitro.validation import BatchError, decode_batch

log = logging.getLogger("nitro")

STOP_ROUNDS = "round_limit"
STOP_TARGET = "target_reward"
STOP_BUDGET = "budget_spent"
MAX_FAILED_UPDATES = 3  # updates in a row that took no step (non-finite losses): the run stops


class TrainingError(RuntimeError):
    """The run cannot go on training (its updates keep failing); the message is one line."""


@dataclass
class UpdateReport:
    """Step 1's result: what the policy update trained on and what it measured."""

    samples: int = 0
    batches: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)  # invocation ids of batches that failed validation
    corrupt_reasons: dict[str, str] = field(default_factory=dict)  # invocation id -> one-line reason
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """Step 3's result: the actors this round gets, and why."""

    n_actors: int
    wanted: int
    reason: str
    score: float | None = None


@dataclass(frozen=True)
class RoundReport:
    """A finished round: its metrics (one MLflow step) and whether the run stops after it."""

    round: int
    metrics: dict[str, float]
    stop_reason: str | None
    notes: dict[str, str] = field(default_factory=dict)  # one line each, e.g. why a batch was dropped


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
        self.learner: Learner = make_learner(config)
        self.asynchronous = config.algo == "impact" and config.impact.asynchronous
        self.scaler = make_scaler(config.scaler, seed=config.seed, steps_per_actor=config.steps_per_actor)
        self.ledger = ledger_from_config(config)
        self.next_round = 0
        self.env_steps_total = 0
        self.pending: list[str] = []  # invocation ids whose batches the next update consumes
        self.open_episodes: list[str] = []  # snapshots of the last round's unfinished episodes (cache keys)
        self.last_round_s: float | None = None
        self.history: list[dict[str, float]] = []
        self.failed_updates = 0  # updates in a row that could take no step
        b = config.backend
        parallel = b.lambda_.concurrency if b.kind == "lambda" else (b.workers or os.cpu_count() or 1)
        # Lambda keeps instances warm; provisioned ones never start cold
        self.clock = RoundClock(config.clock, warm_instances=self.ledger.provisioned_concurrency)
        if self.clock.projected:  # on the projected clock the invocations all run at once
            parallel = 2**31
        self.bound = LearnerBound(parallel=parallel, timeout_s=self.ledger.max_billed_ms / 1000,
                                  startup_s=self.clock.startup_s)
        self._round_k: int | None = None  # the round whose start time is _round_started
        self._round_started = 0.0
        self._deadline: float | None = None  # the next update stops by then (budget runs only)
        self.reserved_next_s: float | None = None  # the allowance the last decision made for the next update
        self.final_eval_round: int | None = None  # a budget run's last round, which only evaluates

    # -- step 1 --------------------------------------------------------------------------

    def update_policy(self, k: int) -> UpdateReport:
        """Collect the previous round's batches (until the deadline) and update the policy."""
        self._start(k)
        if not self.pending:
            return UpdateReport()
        t0 = time.perf_counter()
        collected = self.cache.collect(k - 1, set(self.pending), deadline_s=self._wait_s(self.config.round_deadline_s))
        report = UpdateReport(missing=sorted(collected.missing))
        batches = self._decode(k, collected.batches, report)
        report.batches = len(batches)
        if collected.missing:
            log.warning("round %d: %d of %d batches missing at the deadline", k, len(collected.missing), len(self.pending))
        if batches:
            report.metrics = self._update(k, batches)
            report.samples = int(sum(len(b["rewards"]) for b in batches))
        report.seconds = time.perf_counter() - t0
        return report

    def _update(self, k: int, batches: list[dict]) -> dict[str, float]:
        """One learner update under the budget's deadline; stops the run when updates keep
        failing (every minibatch had a non-finite loss or gradient) rather than go on with a
        learner that cannot learn from what it is given."""
        self.learner.update_deadline = self._deadline
        if self.config.algo == "ppo" and self.config.ppo.anneal_lr:
            self.learner.set_learning_rate(annealed_lr(self.config.ppo.lr, k, self.config.rounds))
        metrics = self.learner.update(batches)
        if metrics.get("skipped_minibatches", 0.0) > 0 and metrics.get("sgd_steps", 1.0) == 0:
            self.failed_updates += 1
            log.warning("round %d: the update took no step (%d in a row)", k, self.failed_updates)
            if self.failed_updates >= MAX_FAILED_UPDATES:
                raise TrainingError(f"round {k}: {self.failed_updates} policy updates in a row had only non-finite "
                                    "losses or gradients; stopping rather than training on garbage")
        else:
            self.failed_updates = 0
        return metrics

    def _start(self, k: int) -> None:
        """Note when round k began (its first step calls this; later calls are no-ops)."""
        if self._round_k != k:
            self._round_k, self._round_started = k, time.perf_counter()

    def _wait_s(self, wanted_s: float) -> float:
        """``wanted_s``, or less when the budget's deadline for this part of the round is nearer."""
        if self._deadline is None:
            return wanted_s
        return max(0.0, min(wanted_s, self._deadline - time.perf_counter()))

    # -- step 2 --------------------------------------------------------------------------

    def detect(self, k: int, update: UpdateReport | None = None) -> Detection | None:
        """Hessian extremes of the surrogate on a subset of the batch the learner last trained
        on: this round's ``update``, or (off-policy, ``update=None``) the latest update made
        while the previous round's actors acted. None when there is nothing fresh to probe or
        nothing reads R (``DetectorConfig.runs_for``)."""
        self._start(k)
        fresh = update is None or update.samples > 0
        wanted = self.config.detector.runs_for(self.config.scaler.name)
        if not wanted or not fresh or self.learner.trained_samples() == 0:
            return None
        if self._deadline is not None and time.perf_counter() > self._deadline:
            log.warning("round %d: detection skipped: the budget's deadline for this round's update has passed", k)
            return None
        return detect_on_batch(self.learner, subset_size=self.config.detector.subset_size,
                               steps=self.config.detector.lanczos_steps, seed=self.config.seed + k)

    # -- step 3 --------------------------------------------------------------------------

    def decide(self, k: int, detection: Detection | None, update: UpdateReport | None = None) -> Decision:
        """How many actors this round gets: the scaler's wish, capped by the remaining budget."""
        self._start(k)
        signal = RoundSignal(R=detection.R if detection is not None else None,
                             grad_noise_scale=update.metrics.get("grad_noise_scale") if update is not None else None)
        wanted = int(self.scaler.decide(k, signal))  # always asked: a scaler with a window keeps it
        reason = self.config.scaler.name
        if k in self.config.scaler.actors_at:
            wanted, reason = self.config.scaler.actors_at[k], f"actors_at[{k}]"
        n = wanted
        remaining = self.ledger.remaining(self.config.budget_usd)
        if remaining is not None:
            n = self._cap_by_budget(k, wanted, remaining, update)
            if n < wanted:
                reason = f"{reason}, capped by budget (${float(remaining):.4f} left)"
            if n == 0 and self.config.eval.every_rounds > 0 and remaining >= self.final_eval_reserve():
                # The kept reserve pays this last round's evaluation: the run ends on a score of
                # the policy it trained last, not on whichever round happened to evaluate before.
                self.final_eval_round = k
                reason = f"budget spent: a final evaluation (${float(remaining):.4f} left)"
        return Decision(n_actors=n, wanted=wanted, reason=reason, score=self.scaler.last.get("score"))

    def _cap_by_budget(self, k: int, wanted: int, remaining: Decimal, update: UpdateReport | None) -> int:
        """The most actors whose worst case fits in the budget, with the learner's time bounded by
        ``nitro.budget.LearnerBound``: what this round has taken so far (measured: its update and
        detection included), the actors' timeout-bounded waves, and the next round's update,
        which the deadline set here enforces. Each invocation may be billed up to its timeout."""
        now = time.perf_counter()
        elapsed = now - self._round_started
        samples = update.samples if update is not None else 0
        if samples and not self.asynchronous:
            self.bound.observe(elapsed, samples)

        def invocations(n: int) -> int:
            return n + self.eval_invocations(k) if n else 0

        def cost(n: int) -> Decimal:
            return decision_cost(self.ledger, self.bound, elapsed, invocations(n), n * self.config.steps_per_actor)

        n = largest_affordable(wanted, remaining - self.final_eval_reserve(), cost, min_actors=1)
        next_samples = n * self.config.steps_per_actor
        self._deadline = now + self.bound.deadline_after_s(invocations(n), next_samples) if n else None
        self.reserved_next_s = self.bound.allowance_s(next_samples) if n else None
        return n

    # -- step 4 --------------------------------------------------------------------------

    def policy_payload(self, version: int) -> bytes:
        """The policy as actors load it: its state dict (normaliser included) and, in the
        metadata, the env, the round and the MLP's architecture (so an actor builds the same net)."""
        meta = {"format": "nitro.policy/1", "env_id": self.config.env_id, "version": version,
                "arch": self.config.model.architecture().to_meta()}
        return dumps_tensors(self.learner.weights(), meta)

    def publish_weights(self, k: int) -> str:
        return self.cache.publish_weights(k, self.policy_payload(k))

    def actor_events(self, k: int, n: int, weights_key: str) -> list[ActorEvent]:
        """The round's invocations: ``n`` training actors, then, on an evaluation round, the
        evaluation episodes (``eval_invocations``). Training actor i continues the episode that
        the previous round's i-th surviving actor left unfinished (``open_episodes``); the others
        start fresh ones. Seeds depend on (seed, round, slot) only, so a run is reproducible
        however the invocations are scheduled. Evaluation seeds do not depend on the round: every
        evaluation starts its episodes from the same states, so rounds compare like for like."""
        common = {"run_id": self.run_id, "round": k, "weights_key": weights_key, "env_id": self.config.env_id,
                  "cache_url": self.actor_cache_url, "cache_credentials": self.actor_credentials,
                  "batch_ttl_s": self.config.redis.ttl_s}
        events = [
            ActorEvent(invocation_id=invocation_id(self.run_id, k, i), seed=_seed(self.config.seed, k, i),
                       n_steps=self.config.steps_per_actor,
                       episode_key=self.open_episodes[i] if i < len(self.open_episodes) else None, **common)
            for i in range(n)
        ]
        if (n or k == self.final_eval_round) and self.is_eval_round(k):
            ev = self.config.eval
            max_steps = ev.max_steps or self.spec.max_episode_steps or 27_000
            for m, mode in enumerate(("eval_deterministic", "eval_stochastic")):
                events += [ActorEvent(invocation_id=invocation_id(self.run_id, k, i, mode), mode=mode,
                                      seed=_seed(self.config.seed, 2**20 + m, i), n_steps=max_steps, **common)
                           for i in range(ev.episodes)]
        if events:  # before any is invoked: a learner that dies now still bills them on resume
            save_inflight(self.config.home, self.run_id, k, [e.invocation_id for e in events])
        return events

    def is_eval_round(self, k: int) -> bool:
        """Evaluate every ``eval.every_rounds`` rounds from round 0, and in the last round (the
        round limit's, or a budget run's final evaluation)."""
        every = self.config.eval.every_rounds
        return every > 0 and (k % every == 0 or k == self.config.rounds - 1 or k == self.final_eval_round)

    def final_eval_reserve(self) -> Decimal:
        """What a budget run keeps back for its final evaluation: its invocations at their
        timeout-bounded worst case and the learner's time while they run (``decide``)."""
        if self.config.eval.every_rounds <= 0:
            return Decimal(0)
        return decision_cost(self.ledger, self.bound, 0.0, 2 * self.config.eval.episodes, 0)

    def eval_invocations(self, k: int) -> int:
        return 2 * self.config.eval.episodes if self.is_eval_round(k) else 0

    def learn_while_acting(self, k: int, expected_ids: list[str], actors_done: threading.Event) -> UpdateReport:
        """Off-policy step 1, overlapping step 4 (paper §4): update on each batch of this round as
        it lands in the cache; while nothing new has landed, replay from the buffer; stop when
        every batch is in, or ``actors_done`` is set and nothing more came, or at the deadline."""
        learner = self.learner
        assert isinstance(learner, OffPolicyLearner), f"{type(learner).__name__} cannot learn while acting"
        deadline = time.perf_counter() + self._wait_s(self.config.round_deadline_s)
        waiting, report, busy = set(expected_ids), UpdateReport(), 0.0
        updates = replays = 0
        wait_s = 0.0
        while waiting and time.perf_counter() < deadline:
            got = self.cache.collect(k, waiting, deadline_s=wait_s)
            waiting -= set(got.batches)
            batches = self._decode(k, got.batches, report)
            started = time.perf_counter()
            if batches:
                report.metrics = self._update(k, batches)
                report.samples += int(sum(len(b["rewards"]) for b in batches))
                report.batches += len(batches)
                updates += 1
            elif learner.replay_update() is not None:
                replays += 1
            elif actors_done.is_set():
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
        return report

    def _decode(self, k: int, payloads: dict[str, bytes], report: UpdateReport) -> list[dict]:
        """The payloads that pass ``nitro.validation`` against this run's env; each one that does
        not is dropped and recorded in ``report`` (``corrupt``, with its reason)."""
        batches = []
        for inv_id, payload in sorted(payloads.items()):
            try:
                batches.append(decode_batch(payload, self.spec, self.config.steps_per_actor, inv_id))
            except BatchError as exc:
                log.warning("round %d: dropped corrupt batch %s: %s", k, inv_id, exc)
                report.corrupt.append(inv_id)
                report.corrupt_reasons[inv_id] = str(exc)
        return batches

    # -- bookkeeping ---------------------------------------------------------------------

    def end_round(self, k: int, update: UpdateReport, detection: Detection | None, decision: Decision,
                  summaries: list[ActorSummary], actor_s: float, round_s: float) -> RoundReport:
        """Charge the round (``round_s``: its wall time so far, billed to the learner), compute
        its metrics and decide whether the run goes on."""
        seen: set[str] = set()
        unique = sorted((s for s in summaries if not (s.invocation_id in seen or seen.add(s.invocation_id))),
                        key=lambda s: s.invocation_id)
        for s in unique:
            if not s.ok:
                log.warning("round %d: actor %s failed: %s", k, s.invocation_id, s.error)
        train = [s for s in unique if invocation_mode(s.invocation_id) == "train"]
        ok = [s for s in train if s.ok]
        steps = sum(s.steps for s in ok)
        self.env_steps_total += steps
        billed_s, lambda_s = self.clock.round(round_s, actor_s, [s.duration_s for s in unique])
        cost = self.ledger.charge_round(
            k, learner_seconds=billed_s,
            actor_billed_ms=[s.billed_ms for s in unique], n_requests=len(unique),
            provisioned_seconds=billed_s,
        )
        interrupted = float(self.ledger.interrupted_cost(k))  # dead attempts at this round, billed on resume
        returns = [r for s in ok for r in s.episode_returns]
        evaluated = {mode: [r for s in unique if s.ok and invocation_mode(s.invocation_id) == mode
                            for r in s.episode_returns] for mode in ("eval_deterministic", "eval_stochastic")}
        det, dec, upd = detection, decision, update
        metrics: dict[str, float] = {
            # whole training episodes that ended this round (sampled actions; an episode may span
            # rounds, so several policy versions): a diagnostic, not the score
            "train_return_mean": float(np.mean(returns)) if returns else math.nan,
            "train_return_max": float(np.max(returns)) if returns else math.nan,
            "train_episodes": float(len(returns)),
            # the score: whole evaluation episodes of this round's policy (NaN between evaluations)
            **_eval_metrics("eval", evaluated["eval_deterministic"]),
            **_eval_metrics("eval_stochastic", evaluated["eval_stochastic"]),
            "env_steps": float(steps),
            "env_steps_total": float(self.env_steps_total),
            "actors_launched": float(len(train)),
            "actors_failed": float(len(train) - len(ok)),
            "eval_invocations": float(len(unique) - len(train)),
            "batches_missing": float(len(upd.missing)),
            "actors_corrupt": float(len(upd.corrupt)),
            "boost_score": float(dec.score) if dec.score is not None else math.nan,
            "hessian_R": _num(det.R if det is not None else None),
            "lambda_max": _num(det.lambda_max if det is not None else None),
            "lambda_min": _num(det.lambda_min if det is not None else None),
            "learner_s": upd.seconds,
            "detection_s": det.seconds if det is not None else 0.0,
            "actor_s": actor_s,
            "orchestration_s": 0.0,  # known once the orchestrator has timed the round: record_wall_time
            "round_s": round_s,
            "round_lambda_s": lambda_s,  # had the invocations run at once on Lambda (nitro.clock)
            "round_billed_s": billed_s,
        }
        for name in ("learner", "lambda_compute", "requests", "provisioned"):
            metrics[f"spend_{name}_usd"] = float(getattr(cost, name))
        metrics["spend_interrupted_usd"] = interrupted
        metrics["spend_round_usd"] = float(cost.total) + interrupted
        metrics["spend_total_usd"] = float(cost.cumulative)
        metrics.update({f"{self.config.algo}/{name}": float(v) for name, v in upd.metrics.items()})
        self.history.append({"round": float(k), **metrics})
        self.pending = [] if self.asynchronous else [s.invocation_id for s in ok]
        self.open_episodes = [s.episode_key for s in ok if s.episode_key]
        self.last_round_s = round_s
        self.next_round = k + 1
        if k >= 1:
            self.cache.delete_round(k - 1)  # consumed by this round's update and actors
        notes = {f"corrupt.{inv}": reason for inv, reason in upd.corrupt_reasons.items()}
        return RoundReport(k, metrics, self.stop_reason(metrics, decision), notes)

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

    def final_return(self) -> tuple[int, float] | None:
        """(round, mean return) of the last evaluation: whole episodes, deterministic actions."""
        evaluated = [(int(r["round"]), r["eval_return_mean"]) for r in self.history
                     if not math.isnan(r.get("eval_return_mean", math.nan))]
        return evaluated[-1] if evaluated else None

    def bill_interrupted_round(self) -> int:
        """Charge the invocations of a round whose learner died before its checkpoint (Lambda
        bills them all the same): each from the summary its actor left in the cache, or at the
        timeout-bounded worst case where none is there. Marked as interrupted in the ledger;
        the same dead attempt is never billed twice. Returns how many invocations were billed."""
        record = load_inflight(self.config.home, self.run_id)
        if record is None or int(record["round"]) < self.next_round or record["attempt"] in self.ledger.billed_attempts():
            return 0
        k, ids = int(record["round"]), list(record["invocations"])
        found = self.cache.get_summaries(k, ids)
        billed = [_billed_ms(found.get(i), self.ledger.max_billed_ms) for i in ids]
        cost = self.ledger.charge_round(k, 0, billed, n_requests=len(ids), interrupted_attempt=str(record["attempt"]))
        log.warning("round %d died with %d invocations in flight: billed $%.6f (%d from their summaries, %d at "
                    "their timeout)", k + 1, len(ids), float(cost.total), len(found), len(ids) - len(found))
        return len(ids)

    def stop_reason(self, metrics: dict[str, float], decision: Decision) -> str | None:
        return stop_reason(self.config, metrics, self.next_round, decision.n_actors)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_round": self.next_round,
            "env_steps_total": self.env_steps_total,
            "pending": list(self.pending),
            "open_episodes": list(self.open_episodes),
            "last_round_s": self.last_round_s,
            "history": self.history,
            "failed_updates": self.failed_updates,
            "update_s_per_sample": self.bound.update_s_per_sample,
            "reserved_next_s": self.reserved_next_s,
            "warm_instances": self.clock.warm_instances,
            "learner": dict(zip(("tensors", "meta"), self.learner.state_dict())),
            "scaler": self.scaler.state_dict(),
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_round = int(state["next_round"])
        self.env_steps_total = int(state["env_steps_total"])
        self.pending = list(state["pending"])
        self.open_episodes = list(state.get("open_episodes", []))
        self.last_round_s = state["last_round_s"]
        self.history = list(state["history"])
        self.failed_updates = int(state.get("failed_updates", 0))
        self.bound.update_s_per_sample = state.get("update_s_per_sample")
        self.reserved_next_s = state.get("reserved_next_s")
        self.clock.warm_instances = int(state.get("warm_instances", self.clock.warm_instances))
        # The next update's allowance restarts now: the process that reserved it is gone.
        self._deadline = (time.perf_counter() + self.reserved_next_s * DEADLINE_SHARE
                          if self.reserved_next_s is not None else None)
        self.learner.load_state_dict(state["learner"]["tensors"], state["learner"]["meta"])
        self.scaler.load_state_dict(state["scaler"])
        self.ledger.load_state_dict(state["ledger"])


def stop_reason(config: NitroConfig, metrics: Mapping[str, float], next_round: int, n_actors: int) -> str | None:
    """Why the run stops after a round with these metrics (None: it goes on). The target is
    judged on the evaluation return, or on the training return when evaluation is off; a budget
    stop is a round the budget could not pay any actor for."""
    key = "eval_return_mean" if config.eval.every_rounds > 0 else "train_return_mean"
    ret = metrics.get(key, math.nan)
    if config.target_reward is not None and ret is not None and not math.isnan(ret) and ret >= config.target_reward:
        return STOP_TARGET
    if config.budget_usd is not None and n_actors == 0:
        return STOP_BUDGET
    if next_round >= config.rounds:
        return STOP_ROUNDS
    return None


def round_line(report: RoundReport, rounds: int) -> str:
    """The one INFO line per round that people read. Rounds are numbered from 0, as in Prefect's
    subflow names, the round table and MLflow's steps: ``round 3 of 0..14`` is the fourth of 15."""
    m = report.metrics
    train = "   n/a" if math.isnan(m["train_return_mean"]) else f"{m['train_return_mean']:8.1f}"
    evaluated = "" if math.isnan(m["eval_return_mean"]) else f" eval={m['eval_return_mean']:.1f}"
    r = "" if math.isnan(m["hessian_R"]) else f" R={m['hessian_R']:.3g}"
    failed = f" ({int(m['actors_failed'])} failed)" if m["actors_failed"] else ""
    return (f"round {report.round} of 0..{rounds - 1}: actors={int(m['actors_launched'])}{failed} "
            f"steps={int(m['env_steps'])} train_return={train}{evaluated}{r} "
            f"spend=${m['spend_total_usd']:.4f} {m['round_s']:.1f}s")


def _billed_ms(summary_json: bytes | None, worst_ms: int | None) -> int:
    """An invocation's billed ms from its stored summary; the worst case without a usable one."""
    if summary_json is not None:
        try:
            return ActorSummary.model_validate_json(summary_json).billed_ms
        except ValueError:
            pass
    return int(worst_ms or 0)


def _seed(*entropy: int) -> int:
    return int(np.random.SeedSequence(list(entropy)).generate_state(1, dtype=np.uint64)[0] >> 1)


def _eval_metrics(prefix: str, returns: list[float]) -> dict[str, float]:
    """Mean and std of whole evaluation episodes' returns, and how many; NaN without any."""
    return {f"{prefix}_return_mean": float(np.mean(returns)) if returns else math.nan,
            f"{prefix}_return_std": float(np.std(returns)) if returns else math.nan,
            f"{prefix}_episodes": float(len(returns))}


def _num(value: float | None) -> float:
    return math.nan if value is None else float(value)
