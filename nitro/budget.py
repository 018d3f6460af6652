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

The old rule reserved twice the last round's wall time; round 0 has no update, so round 1 (the
first update and detection) could take longer than that. Here the part of a round that has
already run when its decision is made is measured, not predicted, and what follows the decision
is bounded as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Callable

from nitro.cost import CostLedger

TAIL_S = 2.0  # publishing the weights, planning the invocations and closing the round
ALLOWANCE_BASE_S = 5.0  # the next round's fixed work before its decision (connections, detection)
PRIOR_UPDATE_S_PER_SAMPLE = 0.005  # before the first update is timed (PPO 2x256 on one core: ~0.0012)
DEADLINE_SHARE = 0.8  # the update's deadline: this share of the allowance; the rest covers its last step


def no_startup(invocations: int) -> float:
    return 0.0


@dataclass
class LearnerBound:
    """The learner seconds one decision reserves, and the next round's deadline."""

    parallel: int  # invocations in flight at once (local workers, Lambda concurrency)
    timeout_s: float  # one invocation's timeout, enforced by the backend
    update_s_per_sample: float | None = None  # the slowest pre-decision part seen, per sample
    startup_s: Callable[[int], float] = no_startup  # before the invocations run (the Lambda clock's allowances)

    def acting_s(self, invocations: int) -> float:
        """Worst case of the rest of a round after its decision."""
        waves = math.ceil(invocations / max(1, self.parallel))
        return self.startup_s(invocations) + waves * self.timeout_s + TAIL_S

    def allowance_s(self, samples: int) -> float:
        """The next round's part before its decision (collect, update, detect), enforced."""
        rate = self.update_s_per_sample if self.update_s_per_sample is not None else PRIOR_UPDATE_S_PER_SAMPLE
        return ALLOWANCE_BASE_S + 2.0 * rate * samples

    def reserve_s(self, invocations: int, samples: int) -> float:
        """Learner seconds from a decision to the next one."""
        return self.acting_s(invocations) + self.allowance_s(samples)

    def deadline_after_s(self, invocations: int, samples: int) -> float:
        """Seconds after a decision by which the next round's update must stop."""
        return self.acting_s(invocations) + DEADLINE_SHARE * self.allowance_s(samples)

    def observe(self, seconds: float, samples: int) -> None:
        """A round's measured part before its decision, and the samples it trained on."""
        if samples > 0 and seconds >= 0:
            rate = seconds / samples
            self.update_s_per_sample = max(rate, self.update_s_per_sample or 0.0)


def decision_cost(ledger: CostLedger, bound: LearnerBound, elapsed_s: float, invocations: int, samples: int) -> Decimal:
    """An upper bound of what a decision for ``invocations`` (whose actors bring ``samples``) can
    cost until the next decision: the learner's time (``elapsed_s`` of this round so far, plus
    ``bound.reserve_s``) with its provisioned concurrency, and each invocation at its timeout."""
    seconds = elapsed_s + bound.reserve_s(invocations, samples)
    return ledger.round_fixed_cost(seconds, seconds) + invocations * ledger.max_actor_cost()
