"""One training run's state and the steps of its rounds.

    round k:  update = update_policy(k)
              detection = detect_boosting(k, update)
              decision = decide_actors(k, detection, update, started)
              events = plan_invocations(k, decision, publish_weights(k));  summaries = invoke each
              report = end_round(k, update, detection, decision, summaries, actor_s, elapsed_s)
              report = record_round(k, report, round_s)

Each step is a function of the values the earlier steps returned, and the round's clock starts
in the caller (``started``): nothing of one round is kept between its steps. ``TrainingRun``
holds what lives across rounds (the learner, the scaler, the cost ledger, the batches the next
update consumes, the deadline the last decision set for it, the history), and all of it is in
``state_dict()``, which is checkpointed after each round. It knows nothing of Prefect:
``flows/`` calls these steps through thin ``tasks/``, and a plain loop can drive them as well.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nitro.actors.events import ActorEvent, ActorSummary, invocation_mode
from nitro.budget import DEADLINE_SHARE, LearnerBound, cap_by_budget, final_eval_reserve
from nitro.cache import TrajectoryCache
from nitro.checkpoint import save_inflight
from nitro.config import NitroConfig
from nitro.cost import ledger_from_config
from nitro.detector import Detection, detect_on_batch
from nitro.envs import env_spec
from nitro.interrupted import bill_interrupted_round
from nitro.invocations import eval_invocations, evaluation_invocations, plan_invocations
from nitro.learners import Learner, OffPolicyLearner, Progress, UpdateResult, make_learner
from nitro.metrics import EVAL_MODES, round_metrics, timed_round
from nitro.behaviour import BehaviourPolicies
from nitro.scalers import make_scaler, round_signal
from nitro.serialization import dumps_tensors, loads_tensors
from nitro.stellaris.round import GradientPlan, StellarisLearning
from nitro.stopping import stop_reason
from nitro.validation import BatchError, batch_version, bounds_for, decode_batch_meta
from nitro.vm import make_round_clock

log = logging.getLogger("nitro")

MAX_FAILED_UPDATES = 3  # updates in a row that took no step (non-finite losses): the run stops


class TrainingError(RuntimeError):
    """The run cannot go on training (its updates keep failing); the message is one line."""


@dataclass
class UpdateReport:
    """What a round's policy update trained on and what it measured."""

    samples: int = 0  # new samples trained on (a replayed one is not new)
    batches: int = 0
    missing: list[str] = field(default_factory=list)  # invocation ids whose batch never landed
    corrupt: list[str] = field(default_factory=list)  # invocation ids of batches that failed validation
    corrupt_reasons: dict[str, str] = field(default_factory=dict)  # invocation id -> one-line reason
    seconds: float = 0.0
    grad_noise_scale: float | None = None  # None: no update measured it this round
    diagnostics: dict[str, float] = field(default_factory=dict)  # the learner's, by name
    projected_s: float = 0.0  # Stellaris: the learner functions' part of the round on the Lambda clock


@dataclass(frozen=True)
class LatestUpdate:
    """What an off-policy round's detection probes: the learner's latest update, made while the
    previous round's actors acted (the round's own update runs beside its actors, after it)."""


@dataclass(frozen=True)
class Decision:
    """The actors a round gets, and why."""

    n_actors: int
    wanted: int
    reason: str
    score: float | None = None
    final_evaluation: bool = False  # a budget run's last round: no training actors, only the evaluation
    instances_started: int = 0  # actors on VMs: instances this decision starts (the round waits for them)


@dataclass(frozen=True)
class RoundReport:
    """A finished round: its metrics (one MLflow step) and whether the run stops after it."""

    round: int
    metrics: dict[str, float]
    stop_reason: str | None
    tags: dict[str, str] = field(default_factory=dict)  # MLflow tags, one line each, e.g. why a batch was dropped


class TrainingRun:
    """The learner side of one training run: its state across rounds and the steps of a round."""

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
        self.bounds = bounds_for(self.spec, config.door)
        self.behaviour = BehaviourPolicies(self.spec, config.model.architecture(), atol=config.door.logp_atol,
                                           rtol=config.door.logp_rtol)
        self.stellaris = (StellarisLearning(config, self.learner, cache, run_id, self.behaviour, self.bounds)  # type: ignore[arg-type]
                          if config.learner.mode == "stellaris" else None)
        self.scaler = make_scaler(config.scaler, seed=config.seed, steps_per_actor=config.steps_per_actor)
        self.ledger = ledger_from_config(config)
        self.next_round = 0
        self.env_steps_total = 0
        self.pending: list[str] = []  # invocation ids whose batches the next update consumes
        self.open_episodes: list[str] = []  # snapshots of the last round's unfinished episodes (cache keys)
        self.history: list[dict[str, float]] = []
        self.failed_updates = 0  # updates in a row that could take no step
        b = config.backend
        parallel = b.lambda_.concurrency if b.kind == "lambda" else (b.workers or os.cpu_count() or 1)
        self.clock = make_round_clock(config.clock, self.ledger.vm, self.ledger.provisioned_concurrency)
        if self.clock.projected:  # on the projected clock the invocations all run at once
            parallel = 2**31
        self.bound = LearnerBound(parallel=parallel, timeout_s=self.ledger.max_billed_ms / 1000,
                                  startup_s=self.clock.startup_s, capacity=self.clock.capacity)
        # A budget run's next update stops by this time.perf_counter() value (None: no deadline),
        # and the allowance the last decision reserved for it (restarts the deadline on resume).
        self.update_deadline: float | None = None
        self.reserved_next_s: float | None = None

    # -- the policy update ---------------------------------------------------------------

    def update_policy(self, k: int) -> UpdateReport:
        """Collect the previous round's batches (until the deadline) and update the policy."""
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
            self._record(report, self._train(k, batches))
            report.samples = int(sum(len(b["rewards"]) for b in batches))
        report.seconds = time.perf_counter() - t0
        return report

    def learn_while_acting(self, k: int, expected_ids: list[str], actors_done: threading.Event) -> UpdateReport:
        """The off-policy update, beside the round's actors: update on each batch of this round
        as it lands in the cache; while nothing new has landed, replay from the buffer; stop when
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
                self._record(report, self._train(k, batches))
                report.samples += int(sum(len(b["rewards"]) for b in batches))
                report.batches += len(batches)
                updates += 1
            elif learner.replay_update(deadline=self.update_deadline) is not None:
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
        report.diagnostics = {**report.diagnostics, "updates": float(updates), "replay_updates": float(replays),
                              "learner_busy_s": busy}
        return report

    def _train(self, k: int, batches: list[dict]) -> UpdateResult:
        """One learner update under the budget's deadline; stops the run when updates keep
        failing (every minibatch had a non-finite loss or gradient) rather than go on with a
        learner that cannot learn from what it is given."""
        result = self.learner.update(batches, progress=Progress(k, self.config.rounds), deadline=self.update_deadline)
        if result.took_no_step:
            self.failed_updates += 1
            log.warning("round %d: the update took no step (%d in a row)", k, self.failed_updates)
            if self.failed_updates >= MAX_FAILED_UPDATES:
                raise TrainingError(f"round {k}: {self.failed_updates} policy updates in a row had only non-finite "
                                    "losses or gradients; stopping rather than training on garbage")
        else:
            self.failed_updates = 0
        return result

    @staticmethod
    def _record(report: UpdateReport, result: UpdateResult) -> None:
        report.diagnostics = dict(result.diagnostics)
        report.grad_noise_scale = result.grad_noise_scale

    def _wait_s(self, wanted_s: float) -> float:
        """``wanted_s``, or less when the budget's deadline for this part of the round is nearer."""
        if self.update_deadline is None:
            return wanted_s
        return max(0.0, min(wanted_s, self.update_deadline - time.perf_counter()))

    def _decode(self, k: int, payloads: dict[str, bytes], report: UpdateReport) -> list[dict]:
        """The payloads that pass ``nitro.validation`` (env, bounds) and ``nitro.behaviour`` (their
        log-probabilities); each other one is dropped and recorded in ``report`` (``corrupt``, why)."""
        batches = []
        for inv_id, payload in sorted(payloads.items()):
            try:
                arrays, meta = decode_batch_meta(payload, self.spec, self.config.steps_per_actor, inv_id, self.bounds)
                self.behaviour.check(arrays, batch_version(meta))
                batches.append(arrays)
            except BatchError as exc:
                log.warning("round %d: dropped corrupt batch %s: %s", k, inv_id, exc)
                report.corrupt.append(inv_id)
                report.corrupt_reasons[inv_id] = str(exc)
        return batches

    # -- Stellaris: learner functions and the parameter server (nitro.stellaris) --------------

    def plan_gradients(self, k: int, events: list[ActorEvent], weights_key: str) -> GradientPlan:
        assert self.stellaris is not None, "plan_gradients needs learner.mode=stellaris"
        return self.stellaris.plan(k, events, weights_key, self.actor_cache_url, self.actor_credentials)

    def serve_gradients(self, k: int, plan: GradientPlan) -> UpdateReport:
        """Apply the round's gradients as the schedule lands them (``StellarisLearning.serve``)."""
        assert self.stellaris is not None, "serve_gradients needs learner.mode=stellaris"
        served = self.stellaris.serve(k, plan)
        batches = list(served.batches.values())
        corrupt = {**served.corrupt, **served.lost}
        answers = {inv: ActorSummary.model_validate_json(raw) for inv, raw in self.cache.get_summaries(
            k, sorted({j.actor_id for j in plan.jobs}) + [j.invocation_id for j in plan.jobs]).items()}
        projected, learning = self.stellaris.projected_update_s(plan, answers, self.config.clock.invoke_s, served.busy_s)
        return UpdateReport(samples=int(sum(len(b["rewards"]) for b in batches)), batches=len(batches),
                            missing=sorted(served.missing), corrupt=sorted(served.corrupt), corrupt_reasons=corrupt,
                            seconds=served.busy_s, projected_s=projected, diagnostics=served.metrics | {
                                "stellaris_projected_s": projected, "stellaris_learning_s": learning})

    # -- boosting detection --------------------------------------------------------------

    def detect_boosting(self, k: int, update: UpdateReport | LatestUpdate) -> Detection | None:
        """Hessian extremes of the surrogate on a subset of the batch the learner last trained
        on: this round's ``update``, or ``LatestUpdate()`` off-policy. None when there is nothing
        fresh to probe or nothing reads R (``DetectorConfig.runs_for``)."""
        fresh = isinstance(update, LatestUpdate) or update.samples > 0
        wanted = self.config.detector.runs_for(self.config.scaler.name)
        if not wanted or not fresh or self.learner.trained_samples() == 0:
            return None
        if self.update_deadline is not None and time.perf_counter() > self.update_deadline:
            log.warning("round %d: detection skipped: the budget's deadline for this round's update has passed", k)
            return None
        return detect_on_batch(self.learner, subset_size=self.config.detector.subset_size,
                               steps=self.config.detector.lanczos_steps, seed=self.config.seed + k)

    # -- the scaling decision ------------------------------------------------------------

    def decide_actors(self, k: int, detection: Detection | None, update: UpdateReport, started: float) -> Decision:
        """How many actors this round gets: the scaler's wish, capped by the remaining budget.
        ``update``: what this round trained on before deciding (empty off-policy); ``started``:
        the ``time.perf_counter()`` at which the round began (the budget bills from there)."""
        remaining = self.ledger.remaining(self.config.budget_usd)
        signal = round_signal(detection.R if detection is not None else None, update.diagnostics, update.grad_noise_scale,
                              update.seconds, self.history, self.ledger.spent_usd,
                              float(remaining) if remaining is not None else None)
        wanted = int(self.scaler.decide(k, signal))  # always asked: a scaler with a window keeps it
        reason = self.config.scaler.name
        if k in self.config.scaler.actors_at:
            wanted, reason = self.config.scaler.actors_at[k], f"actors_at[{k}]"
        n, final_evaluation = wanted, False
        if remaining is not None:
            now = time.perf_counter()
            elapsed = now - started
            if update.samples and not self.config.learns_while_acting:
                self.bound.observe(elapsed, update.samples)
            reserve = final_eval_reserve(self.ledger, self.bound, evaluation_invocations(self.config))
            cap = cap_by_budget(self.ledger, self.bound, wanted=wanted, affordable=remaining - reserve,
                                elapsed_s=elapsed, eval_invocations=eval_invocations(self.config, k),
                                steps_per_actor=self.config.steps_per_actor,
                                functions_per_actor=self.stellaris.jobs_per_actor() if self.stellaris else 0)
            n = cap.n_actors
            self.update_deadline = now + cap.deadline_after_s if cap.deadline_after_s is not None else None
            self.reserved_next_s = cap.reserved_next_s
            if n < wanted:
                reason = f"{reason}, capped by budget (${float(remaining):.4f} left)"
            if n == 0 and self.config.eval.every_rounds > 0 and remaining >= reserve:
                # The kept reserve pays this last round's evaluation: the run ends on a score of
                # the policy it trained last, not on whichever round happened to evaluate before.
                final_evaluation = True
                reason = f"budget spent: a final evaluation (${float(remaining):.4f} left)"
        started_vms = 0
        if self.ledger.vm is not None:  # the decision sizes the actors' instances (nitro.vm)
            evals = eval_invocations(self.config, k, final_evaluation) if n or final_evaluation else 0
            started_vms = self.ledger.vm.scale(k, n, n + evals, time.perf_counter() - started).started
        return Decision(n_actors=n, wanted=wanted, reason=reason, score=self.scaler.last.get("score"),
                        final_evaluation=final_evaluation, instances_started=started_vms)

    # -- the actors ----------------------------------------------------------------------

    def policy_payload(self, version: int, weights: Mapping[str, torch.Tensor] | None = None) -> bytes:
        """The policy as actors load it (``weights``, default the learner's): its state dict
        (normaliser included) and, in the metadata, the env, the round and the MLP's architecture."""
        meta = {"format": "nitro.policy/1", "env_id": self.config.env_id, "version": version,
                "arch": self.config.model.architecture().to_meta()}
        return dumps_tensors(dict(weights if weights is not None else self.learner.weights()), meta)

    def publish_weights(self, k: int) -> str:
        """Publish the policy as version ``k``; keep what actors act with (an earlier attempt's, if stored)."""
        weights = self.learner.weights()
        key, stored = self.cache.publish_weights_once(k, self.policy_payload(k, weights))
        if not stored:
            weights = {name: torch.as_tensor(v) for name, v in loads_tensors(self.cache.fetch_weights(key))[0].items()}
        self.behaviour.remember(k, weights)
        return key

    def plan_invocations(self, k: int, decision: Decision, weights_key: str) -> list[ActorEvent]:
        """The round's invocations (``nitro.invocations``), recorded before any is invoked: a
        learner that dies now still bills them on resume."""
        events = plan_invocations(self.config, self.spec, run_id=self.run_id, k=k, n_actors=decision.n_actors,
                                  final_evaluation=decision.final_evaluation, weights_key=weights_key,
                                  open_episodes=self.open_episodes, cache_url=self.actor_cache_url,
                                  cache_credentials=self.actor_credentials)
        if events:
            save_inflight(self.config.home, self.run_id, k, [e.invocation_id for e in events])
        return events

    # -- the end of a round --------------------------------------------------------------

    def end_round(self, k: int, update: UpdateReport, detection: Detection | None, decision: Decision,
                  summaries: list[ActorSummary], actor_s: float, elapsed_s: float,
                  functions: list[ActorSummary] | None = None) -> RoundReport:
        """Charge the round (``elapsed_s``: its wall time so far, billed to the learner; ``functions``:
        the learner functions' summaries, billed like actors), compute its metrics and decide
        whether the run goes on."""
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
        billed_s, lambda_s = self.clock.round(elapsed_s, actor_s, [s.duration_s for s in unique], update.projected_s)
        functions = functions or []
        cost = self.ledger.charge_round(
            k, learner_seconds=billed_s,
            actor_billed_ms=[s.billed_ms for s in unique + functions], n_requests=len(unique) + len(functions),
            provisioned_seconds=billed_s,
        )
        metrics = round_metrics(
            train_returns=[r for s in ok for r in s.episode_returns],
            eval_returns={mode: [r for s in unique if s.ok and invocation_mode(s.invocation_id) == mode
                                 for r in s.episode_returns] for mode in EVAL_MODES},
            env_steps=steps, env_steps_total=self.env_steps_total,
            actors_launched=len(train), actors_wanted=decision.wanted, actors_failed=len(train) - len(ok),
            eval_invocations=len(unique) - len(train),
            batches_missing=len(update.missing), actors_corrupt=len(update.corrupt),
            boost_score=decision.score, detection=detection,
            learner_s=update.seconds, actor_s=actor_s, round_lambda_s=lambda_s, round_billed_s=billed_s,
            cost=cost, interrupted_usd=float(self.ledger.interrupted_cost(k)),  # dead attempts, billed on resume
            learner_name=self.learner.name, diagnostics=update.diagnostics,
        ) | self.clock.round_extras()
        self.history.append({"round": float(k), **metrics})
        self.pending = [] if self.config.learns_while_acting else [s.invocation_id for s in ok]
        self.open_episodes = [s.episode_key for s in ok if s.episode_key]
        self.next_round = k + 1
        if k >= 1:
            self.cache.delete_round(k - 1)  # consumed by this round's update and actors
        tags = {f"corrupt.{inv}": reason for inv, reason in update.corrupt_reasons.items()}
        return RoundReport(k, metrics, stop_reason(self.config, metrics, self.next_round, decision.n_actors), tags)

    def record_round(self, report: RoundReport, round_s: float) -> RoundReport:
        """The round's report with its wall time as the loop over rounds measured it around the
        whole round (``round_s``) and the part of it spent orchestrating; kept in the history."""
        row = self.history[-1]
        assert int(row["round"]) == report.round, f"round {report.round} is not the last recorded ({row['round']})"
        metrics = timed_round(report.metrics, round_s, overlapped=self.config.learns_while_acting)
        row.update(metrics)
        return RoundReport(report.round, metrics, report.stop_reason, report.tags)

    def final_return(self) -> tuple[int, float] | None:
        """(round, mean return) of the last evaluation: whole episodes, deterministic actions."""
        evaluated = [(int(r["round"]), r["eval_return_mean"]) for r in self.history
                     if not math.isnan(r.get("eval_return_mean", math.nan))]
        return evaluated[-1] if evaluated else None

    def bill_interrupted_round(self) -> int:
        """Charge the invocations of a round whose learner died before its checkpoint
        (``nitro.interrupted``); returns how many invocations were billed."""
        return bill_interrupted_round(self.config.home, self.run_id, self.next_round, self.cache, self.ledger)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_round": self.next_round,
            "env_steps_total": self.env_steps_total,
            "pending": list(self.pending),
            "open_episodes": list(self.open_episodes),
            "history": self.history,
            "failed_updates": self.failed_updates,
            "update_s_per_sample": self.bound.update_s_per_sample,
            "reserved_next_s": self.reserved_next_s,
            "warm_instances": self.clock.warm_instances,
            "learner": dict(zip(("tensors", "meta"), self.learner.state_dict())),
            "scaler": self.scaler.state_dict(),
            "ledger": self.ledger.state_dict(),
            "stellaris": self.stellaris.state_dict() if self.stellaris is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_round = int(state["next_round"])
        self.env_steps_total = int(state["env_steps_total"])
        self.pending = list(state["pending"])
        self.open_episodes = list(state.get("open_episodes", []))
        self.history = list(state["history"])
        self.failed_updates = int(state.get("failed_updates", 0))
        self.bound.update_s_per_sample = state.get("update_s_per_sample")
        self.reserved_next_s = state.get("reserved_next_s")
        self.clock.warm_instances = int(state.get("warm_instances", self.clock.warm_instances))
        # The next update's allowance restarts now: the process that reserved it is gone.
        self.update_deadline = (time.perf_counter() + self.reserved_next_s * DEADLINE_SHARE
                                if self.reserved_next_s is not None else None)
        self.learner.load_state_dict(state["learner"]["tensors"], state["learner"]["meta"])
        if self.next_round > 0:  # the pending batches were acted with the checkpointed policy
            self.behaviour.remember(self.next_round - 1, self.learner.weights())
        self.scaler.load_state_dict(state["scaler"])
        self.ledger.load_state_dict(state["ledger"])
        if self.stellaris is not None and state.get("stellaris"):
            self.stellaris.load_state_dict(state["stellaris"])
