"""Billing a round whose learner died in flight: Lambda bills its invocations all the same.

Before a round invokes its actors, their ids are recorded (``RunDir.save_inflight``).
If the learner dies before the round's checkpoint, the resumed run charges those invocations once:
each from the summary its actor left in the cache, or at its timeout-bounded worst case where
none is there, marked as interrupted in the ledger. Invocations that start only once their inputs
are ready (Stellaris's gradient jobs, the record's ``if_started``) are billed only if they ran:
from their summary, or at the worst case when they were marked started and left none (started
and lost); one that never started costs nothing.
"""

from __future__ import annotations

import logging

from nitro.actors.events import ActorSummary
from nitro.cache import TrajectoryCache
from nitro.pricing.cost import CostLedger
from nitro.run.rundir import RunDir

log = logging.getLogger("nitro")


def bill_interrupted_round(run_dir: RunDir, next_round: int, cache: TrajectoryCache, ledger: CostLedger) -> int:
    """Charge the dead attempt's invocations, if there is one not yet billed (the same attempt is
    never billed twice); returns how many invocations were billed."""
    record = run_dir.inflight()
    if record is None or int(record["round"]) < next_round or record["attempt"] in ledger.billed_attempts():
        return 0
    k, ids, lazy = int(record["round"]), list(record["invocations"]), list(record.get("if_started", []))
    found = cache.get_summaries(k, ids + lazy)
    started = cache.started(k, lazy) if lazy else set()
    ran = ids + [i for i in lazy if i in found or i in started]
    billed = [billed_ms(found.get(i), ledger.max_billed_ms) for i in ran]
    cost = ledger.charge_round(k, 0, billed, n_requests=len(ran), interrupted_attempt=str(record["attempt"]))
    log.warning("round %d died with %d invocations in flight: billed $%.6f (%d from their summaries, %d at "
                "their timeout; %d planned never started)", k, len(ran), float(cost.total),
                sum(i in found for i in ran), sum(i not in found for i in ran), len(ids) + len(lazy) - len(ran))
    return len(ran)


def billed_ms(summary_json: bytes | None, worst_ms: int | None) -> int:
    """An invocation's billed ms from its stored summary; the worst case without a usable one."""
    if summary_json is not None:
        try:
            return ActorSummary.model_validate_json(summary_json).billed_ms
        except ValueError:
            pass
    return int(worst_ms or 0)
