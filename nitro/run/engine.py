"""One training run's state and the steps of its rounds.

    round k:  update = mode.update(k)            (nitro.run.updates: sync, learn-while-acting, stellaris)
              detection = detect_boosting(k, update)
              decision = decide_actors(k, detection, update, started)
              events = plan_invocations(k, decision, publish_weights(k));  summaries = invoke each
              report = end_round(k, update, detection, decision, summaries, actor_s, elapsed_s)
              report = record_round(k, report, round_s)

Each step is a function of the values the earlier steps returned, and the round's clock starts
in the caller (``started``): nothing of one round is kept between its steps. ``TrainingRun``
holds what lives across rounds (the learner, its update mode with what the next update consumes,
the scaler, the cost ledger, the deadline the last decision set for it, the history), and all of it is in
``state_dict()``, which is checkpointed after each round. It knows nothing of Prefect:
``flows/`` calls these steps through thin ``tasks/``, and a plain loop can drive them as well.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from nitro.actors.events import ActorEvent, ActorSummary, invocation_mode
from nitro.cache import TrajectoryCache
from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.learners import Learner, make_learner
from nitro.learners.behaviour import BehaviourPolicies
from nitro.pricing.cost import ledger_from_config
from nitro.pricing.vm import make_round_clock
from nitro.run.crashes import crash_point
from nitro.run.invocations import eval_invocations, evaluation_invocations, plan_invocations
from nitro.run.rundir import RunDir
from nitro.run.stopping import stop_reason
from nitro.run.updates import UpdateDeadline, UpdateReport, make_update_mode
from nitro.scaling.budget import DEADLINE_SHARE, LearnerBound, cap_by_budget, final_eval_reserve
from nitro.scaling.detector import Detection, detect_on_batch
from nitro.scaling.noise import measurement_from
from nitro.scaling.scalers import make_scaler, round_signal
from nitro.serialization import dumps_tensors, loads_tensors
from nitro.tracking.metrics import EVAL_MODES, round_metrics, timed_round
from nitro.validation import bounds_for

log = logging.getLogger("nitro")

Mode = TypeVar("Mode")


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


# The lists of ``TrainingRun.state_dict()`` that only grow at their end: a checkpoint stores them
# in blocks it shares with the checkpoints before it (nitro/run/rowblocks.py).
APPEND_ONLY = ("history", "ledger/rounds")


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
        torch.set_num_threads(config.torch_threads())
        self.learner: Learner = make_learner(config)
        self.bounds = bounds_for(self.spec, config.door)
        self.behaviour = BehaviourPolicies(self.spec, config.model.architecture(), atol=config.door.logp_atol,
                                           rtol=config.door.logp_rtol)
        self.run_dir = RunDir(config.home, run_id)
        # A budget run's next update stops by this deadline; the allowance the last decision
        # reserved for it restarts the deadline on resume.
        self.deadline = UpdateDeadline()
        self.reserved_next_s: float | None = None
        self.decided_at: float | None = None  # a budget run's last decision (time.perf_counter)
        self.scaler = make_scaler(config.scaler, seed=config.seed, steps_per_actor=config.steps_per_actor,
                                  run=config)
        self.ledger = ledger_from_config(config)
        if self.ledger.max_billed_ms is None:
            raise ValueError("the run's ledger needs the actors' timeout (backend.timeout_s) to bound a round's cost")
        self.mode = make_update_mode(config, self.learner, cache, self.run_dir, self.behaviour, self.bounds,
                                     self.deadline, actor_cache_url, self.actor_credentials,
                                     lr_gain=self.scaler.step_gain, max_billed_ms=self.ledger.max_billed_ms)
        self.next_round = 0
        self.env_steps_total = 0
        self.open_episodes: list[str] = []  # snapshots of the last round's unfinished episodes (cache keys)
        self.history: list[dict[str, float]] = []
        b = config.backend
        parallel = b.lambda_.concurrency if b.kind == "lambda" else (b.workers or os.cpu_count() or 1)
        self.clock = make_round_clock(config.clock, self.ledger.vm, self.ledger.provisioned_concurrency)
        if self.clock.projected:  # on the projected clock the invocations all run at once
            parallel = 2**31
        self.bound = LearnerBound(parallel=parallel, timeout_s=self.ledger.max_billed_ms / 1000,
                                  startup_s=self.clock.startup_s, capacity=self.clock.capacity)

    def mode_as(self, kind: type[Mode]) -> Mode:
        """The run's update mode as the round flow that drives it expects it (``kind``)."""
        if not isinstance(self.mode, kind):
            raise TypeError(f"run {self.run_id} updates in mode {self.mode.name!r}, not as {kind.__name__}")
        return self.mode

    # -- boosting detection --------------------------------------------------------------

    def detect_boosting(self, k: int, update: UpdateReport | LatestUpdate) -> Detection | None:
        """Hessian extremes of the surrogate on a subset of the batch the learner last trained
        on: this round's ``update``, or ``LatestUpdate()`` off-policy. None when there is nothing
        fresh to probe or nothing reads R (``DetectorConfig.runs_for``)."""
        fresh = isinstance(update, LatestUpdate) or update.samples > 0
        wanted = self.config.detector.runs_for(self.config.scaler.name)
        if not wanted or not fresh or self.learner.trained_samples() == 0:
            return None
        if self.deadline.passed():
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
        signal = round_signal(detection.R if detection is not None else None, update.diagnostics,
                              update.grad_noise_scale, update.seconds, self.history, self.ledger.spent_usd,
                              float(remaining) if remaining is not None else None)
        if self.mode.overlaps_actors and not update.samples:
            # The update runs beside the actors: the last round's measured the noise this decision reads.
            signal = replace(signal, noise=measurement_from(self.last_diagnostics()))
        wanted = int(self.scaler.decide(k, signal))  # always asked: a scaler with a window keeps it
        reason: str = self.config.scaler.name
        if k in self.config.scaler.actors_at:
            wanted, reason = self.config.scaler.actors_at[k], f"actors_at[{k}]"
        n, final_evaluation = wanted, False
        if remaining is not None:
            now = time.perf_counter()
            elapsed = now - started
            if update.samples and not self.mode.overlaps_actors:
                self.bound.observe(elapsed, update.samples)
            reserve = final_eval_reserve(self.ledger, self.bound, evaluation_invocations(self.config))
            cap = cap_by_budget(self.ledger, self.bound, wanted=wanted, affordable=remaining - reserve,
                                elapsed_s=elapsed, eval_invocations=eval_invocations(self.config, k),
                                steps_per_actor=self.config.steps_per_actor,
                                functions=self.mode.functions)
            n = cap.n_actors
            self.decided_at = now
            self.deadline.at = now + cap.deadline_after_s if cap.deadline_after_s is not None else None
            self.reserved_next_s = cap.reserved_next_s
            if n < wanted:
                reason = f"{reason}, capped by budget (${float(remaining):.4f} left)"
            if n == 0 and self.config.eval.every_rounds > 0 and remaining >= reserve:
                # The kept reserve pays this last round's evaluation: the run ends on a score of
                # the policy it trained last, not on whichever round happened to evaluate before.
                final_evaluation = True
                reason = f"budget spent: a final evaluation (${float(remaining):.4f} left)"
        if self.mode.functions is not None:  # the lanes hold the round's learner functions to what the cap reserved
            self.mode.functions.allow(self.mode.functions.limit_ms(n) if remaining is not None else None)
        started_vms = 0
        if self.ledger.vm is not None:  # the decision sizes the actors' instances (nitro.pricing.vm)
            evals = eval_invocations(self.config, k, final_evaluation) if n or final_evaluation else 0
            started_vms = self.ledger.vm.scale(k, n, n + evals, time.perf_counter() - started).started
        return Decision(n_actors=n, wanted=wanted, reason=reason, score=self.scaler.last.get("score"),
                        final_evaluation=final_evaluation, instances_started=started_vms)

    def last_diagnostics(self) -> dict[str, float]:
        """The learner's diagnostics of the last round ended, by name (the history keeps them as
        ``<learner>/<name>``, ``nitro.tracking.metrics``)."""
        prefix = f"{self.learner.name}/"
        last = self.history[-1] if self.history else {}
        return {name[len(prefix):]: v for name, v in last.items() if name.startswith(prefix)}

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
        """The round's invocations (``nitro.run.invocations``), recorded before any is invoked: a
        learner that dies now still bills them on resume."""
        events = plan_invocations(self.config, self.spec, run_id=self.run_id, k=k, n_actors=decision.n_actors,
                                  final_evaluation=decision.final_evaluation, weights_key=weights_key,
                                  open_episodes=self.open_episodes, cache_url=self.actor_cache_url,
                                  cache_credentials=self.actor_credentials)
        if events:
            self.run_dir.save_inflight(k, [e.invocation_id for e in events])
        return events

    # -- the end of a round --------------------------------------------------------------

    def end_round(self, k: int, update: UpdateReport, detection: Detection | None, decision: Decision,
                  summaries: list[ActorSummary], actor_s: float, elapsed_s: float,
                  functions: list[ActorSummary] | None = None) -> RoundReport:
        """Charge the round (``elapsed_s``: its wall time so far, billed to the learner; ``functions``:
        the learner functions' summaries, billed like actors), compute its metrics and decide
        whether the run goes on."""
        crash_point("after-actors", k)
        first: dict[str, ActorSummary] = {}
        for s in summaries:  # a duplicate delivery's answer counts once
            first.setdefault(s.invocation_id, s)
        unique = sorted(first.values(), key=lambda s: s.invocation_id)
        for s in unique:
            if not s.ok:
                log.warning("round %d: actor %s failed: %s", k, s.invocation_id, s.error)
        train = [s for s in unique if invocation_mode(s.invocation_id) == "train"]
        ok = [s for s in train if s.ok]
        steps = sum(s.steps for s in ok)
        self.env_steps_total += steps
        billed_s, lambda_s = self.clock.round(elapsed_s, actor_s, [s.duration_s for s in unique], update.projected_s)
        if self.mode.overlaps_actors and update.samples and self.decided_at is not None:
            # The update ran beside the actors, after the decision: that part bounds its rate.
            self.bound.observe(time.perf_counter() - self.decided_at, update.samples)
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
        ) | self.clock.round_extras() | self.scaler.round_metrics(k)
        self.history.append({"round": float(k), **metrics})
        self.mode.round_ended(k, ok)
        self.open_episodes = [s.episode_key for s in ok if s.episode_key]
        self.next_round = k + 1
        tags = {f"corrupt.{inv}": reason for inv, reason in update.corrupt_reasons.items()} | self.scaler.round_tags(k)
        crash_point("after-end-round", k)
        return RoundReport(k, metrics, stop_reason(self.config, metrics, self.next_round, decision.n_actors), tags)

    def record_round(self, report: RoundReport, round_s: float) -> RoundReport:
        """The round's report with its wall time as the loop over rounds measured it around the
        whole round (``round_s``) and the part of it spent orchestrating; kept in the history."""
        row = self.history[-1]
        assert int(row["round"]) == report.round, f"round {report.round} is not the last recorded ({row['round']})"
        metrics = timed_round(report.metrics, round_s, overlapped=self.mode.overlaps_actors)
        row.update(metrics)
        return RoundReport(report.round, metrics, report.stop_reason, report.tags)

    def final_return(self) -> tuple[int, float] | None:
        """(round, mean return) of the last evaluation: whole episodes, deterministic actions."""
        evaluated = [(int(r["round"]), r["eval_return_mean"]) for r in self.history
                     if not math.isnan(r.get("eval_return_mean", math.nan))]
        return evaluated[-1] if evaluated else None

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's state after its last round; the lists at ``APPEND_ONLY`` only grow at their end."""
        return {
            "next_round": self.next_round,
            "env_steps_total": self.env_steps_total,
            "open_episodes": list(self.open_episodes),
            "history": self.history,
            "update_s_per_sample": self.bound.update_s_per_sample,
            "reserved_next_s": self.reserved_next_s,
            "warm_instances": self.clock.warm_instances,
            "learner": dict(zip(("tensors", "meta"), self.learner.state_dict())),
            "scaler": self.scaler.state_dict(),
            "ledger": self.ledger.state_dict(),
            **self.mode.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_round = int(state["next_round"])
        self.env_steps_total = int(state["env_steps_total"])
        self.open_episodes = list(state.get("open_episodes", []))
        self.history = list(state["history"])
        self.bound.update_s_per_sample = state.get("update_s_per_sample")
        self.reserved_next_s = state.get("reserved_next_s")
        self.clock.warm_instances = int(state.get("warm_instances", self.clock.warm_instances))
        # The next update's allowance restarts now: the process that reserved it is gone.
        self.deadline.at = (time.perf_counter() + self.reserved_next_s * DEADLINE_SHARE
                            if self.reserved_next_s is not None else None)
        self.learner.load_state_dict(state["learner"]["tensors"], state["learner"]["meta"])
        if self.next_round > 0:  # the pending batches were acted with the checkpointed policy
            self.behaviour.remember(self.next_round - 1, self.learner.weights())
        self.scaler.load_state_dict(state["scaler"])
        self.ledger.load_state_dict(state["ledger"])
        self.mode.load_state_dict(state)
