"""The budget cap's bound on the learner's time: what a scaling decision must reserve so that the
ledger never passes the budget, the first update included.

The learner is billed by wall time. Between two scaling decisions it spends:

1. the rest of the current round: the actors (each invocation is cut at its timeout by its
   backend, and at most ``parallel`` run at once, so ``ceil(invocations / parallel)`` waves of at
   most ``timeout_s`` each) plus a little bookkeeping (``TAIL_S``);
2. the next round up to its decision: collecting the batches, the policy update on them and the
   boosting detection. This part is bounded by *enforcement*, not by a guess: the engine gives it
   a deadline (``deadline_s``), collection waits no longer than that, the update stops its
   epochs there and detection is skipped past it. The allowance grows with the samples to train
   on, from the slowest update seen so far (a prior before the first one: a wrong prior only makes
   the first update stop early, never the ledger pass the budget).

The part of a round that has already run when its decision is made is measured, not predicted:
round 0 has no update, so a rule that reserved a multiple of the last round's wall time would
under-reserve round 1 (the first update and detection). What follows the decision is bounded as
above.

Stellaris's learner functions are bounded by the allowance they enforce on themselves
(``LearnerFunctions.limit_ms``, ``nitro.stellaris.allowance``), not each at its timeout: they
count in the round's invocations for its time, and in its money at that allowance. Their lanes
start no invocation past the round's deadline, so the learner's time gains one timeout for the
invocations still running then. A mode that updates beside its actors has no update before its
decision: the rate it feeds the allowance is its round's time after the decision, per sample.

A budget run also keeps back what its final evaluation costs (``final_eval_reserve``), so it ends
on a score of the policy it trained last. ``cap_by_budget`` is the decision's cap with all of this.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from nitro.pricing.amount import D
from nitro.pricing.cost import CostLedger

TAIL_S = 2.0  # publishing the weights, planning the invocations and closing the round
ALLOWANCE_BASE_S = 5.0  # the next round's fixed work before its decision (connections, detection)
PRIOR_UPDATE_S_PER_SAMPLE = 0.005  # before the first update is timed (PPO 2x256 on one core: ~0.0012)
DEADLINE_SHARE = 0.8  # the update's deadline: this share of the allowance; the rest covers its last step


def no_startup(invocations: int, actors: int = 0) -> float:
    return 0.0


def backend_capacity(invocations: int, actors: int = 0) -> int | None:
    return None  # the backend's own parallelism (``LearnerBound.parallel``)


@dataclass
class LearnerBound:
    """The learner seconds one decision reserves, and the next round's deadline."""

    parallel: int  # invocations in flight at once (local workers, Lambda concurrency)
    timeout_s: float  # one invocation's timeout, enforced by the backend
    update_s_per_sample: float | None = None  # the slowest pre-decision part seen, per sample
    # before the invocations run (the Lambda clock's allowances, a VM's start-up), by (invocations, actors)
    startup_s: Callable[[int, int], float] = no_startup
    capacity: Callable[[int, int], int | None] = backend_capacity  # invocations at once, where the clock says

    def acting_s(self, invocations: int, actors: int = 0) -> float:
        """Worst case of the rest of a round after its decision."""
        parallel = self.capacity(invocations, actors) or self.parallel
        waves = math.ceil(invocations / max(1, parallel))
        return self.startup_s(invocations, actors) + waves * self.timeout_s + TAIL_S

    def allowance_s(self, samples: int) -> float:
        """The next round's part before its decision (collect, update, detect), enforced."""
        rate = self.update_s_per_sample if self.update_s_per_sample is not None else PRIOR_UPDATE_S_PER_SAMPLE
        return ALLOWANCE_BASE_S + 2.0 * rate * samples

    def reserve_s(self, invocations: int, samples: int, actors: int = 0) -> float:
        """Learner seconds from a decision to the next one."""
        return self.acting_s(invocations, actors) + self.allowance_s(samples)

    def deadline_after_s(self, invocations: int, samples: int, actors: int = 0) -> float:
        """Seconds after a decision by which the next round's update must stop."""
        return self.acting_s(invocations, actors) + DEADLINE_SHARE * self.allowance_s(samples)

    def observe(self, seconds: float, samples: int) -> None:
        """A round's measured part before its decision, and the samples it trained on."""
        if samples > 0 and seconds >= 0:
            rate = seconds / samples
            self.update_s_per_sample = max(rate, self.update_s_per_sample or 0.0)


class LearnerFunctions(Protocol):
    """A round's learner functions as the cap sees them (``nitro.stellaris.allowance``)."""

    jobs_per_actor: int  # invocations a training actor brings along, at most

    def limit_ms(self, n_actors: int) -> int:
        """The most the functions of a round of ``n_actors`` may be billed in all (they enforce it)."""
        ...


def decision_cost(ledger: CostLedger, bound: LearnerBound, elapsed_s: float, invocations: int, samples: int,
                  actors: int = 0, functions: LearnerFunctions | None = None) -> Decimal:
    """An upper bound of what a decision for ``invocations`` (``actors`` of them training actors,
    which bring ``samples``, and ``functions``' invocations for them) can cost until the next
    decision: the learner's time (``elapsed_s`` of this round so far, plus ``bound.reserve_s``)
    with its provisioned concurrency, the actors' (``CostLedger.max_actors_cost``: each invocation
    at its timeout on Lambda) and the learner functions' allowance."""
    seconds = elapsed_s + bound.reserve_s(invocations, samples, actors)
    functions_cost = Decimal(0)
    if functions is not None and actors:
        seconds += bound.timeout_s  # lanes start nothing past the deadline; what runs ends by its timeout
        jobs = actors * functions.jobs_per_actor
        invocations -= jobs
        functions_cost = ledger.max_functions_cost(functions.limit_ms(actors), jobs)
    actors_cost = ledger.max_actors_cost(invocations, actors, seconds)
    return ledger.round_fixed_cost(seconds, seconds) + functions_cost + actors_cost


def final_eval_reserve(ledger: CostLedger, bound: LearnerBound, eval_invocations: int) -> Decimal:
    """What a budget run keeps back for its final evaluation: its ``eval_invocations`` at their
    timeout-bounded worst case and the learner's time while they run (0 when it never evaluates)."""
    if eval_invocations <= 0:
        return Decimal(0)
    return decision_cost(ledger, bound, 0.0, eval_invocations, 0)


def largest_affordable(
    wanted: int,
    remaining_usd: float | Decimal | None,
    cost_of: Callable[[int], Decimal],
    min_actors: int = 1,
) -> int:
    """The most actors, at most ``wanted``, for which ``cost_of(n)`` (an upper bound of what the
    round and what follows it until the next decision can cost with n actors; non-decreasing in
    n) fits in ``remaining_usd``; 0 (stop the run) if fewer than ``min(min_actors, wanted)``
    fit. ``remaining_usd=None`` means no budget."""
    wanted = max(0, int(wanted))
    if remaining_usd is None:
        return wanted
    remaining = D(remaining_usd)
    need = min(max(1, int(min_actors)), wanted)  # a scaler asking for fewer than min_actors gets them
    if wanted == 0 or cost_of(need) > remaining:
        return 0
    lo, hi = need, wanted  # invariant: cost_of(lo) fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost_of(mid) <= remaining:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class BudgetCap:
    """A decision's cap: the actors the budget pays for and what it reserved for the next update."""

    n_actors: int
    deadline_after_s: float | None  # the next update stops this long after the decision (None: no actors)
    reserved_next_s: float | None  # the allowance reserved for the next round's update (None: no actors)


def cap_by_budget(ledger: CostLedger, bound: LearnerBound, *, wanted: int, affordable: Decimal, elapsed_s: float,
                  eval_invocations: int, steps_per_actor: int, functions: LearnerFunctions | None = None) -> BudgetCap:
    """The most actors, at most ``wanted``, whose worst case fits in ``affordable``: this round's
    measured ``elapsed_s`` so far, the actors' timeout-bounded waves (with the round's
    ``eval_invocations``, which run only beside training actors, and Stellaris's learner
    ``functions`` for each training actor, at their allowance) and the next round's update, which
    the returned deadline enforces. Each actor's invocation may be billed up to its timeout."""
    per_actor = 1 + (functions.jobs_per_actor if functions is not None else 0)

    def invocations(n: int) -> int:
        return n * per_actor + eval_invocations if n else 0

    def cost(n: int) -> Decimal:
        return decision_cost(ledger, bound, elapsed_s, invocations(n), n * steps_per_actor, n, functions)

    n = largest_affordable(wanted, affordable, cost, min_actors=1)
    if not n:
        return BudgetCap(0, None, None)
    samples = n * steps_per_actor
    return BudgetCap(n, bound.deadline_after_s(invocations(n), samples, n), bound.allowance_s(samples))
