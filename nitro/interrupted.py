"""Billing a round whose learner died in flight: Lambda bills its invocations all the same.

Before a round invokes its actors, their ids are recorded (``nitro.checkpoint.save_inflight``).
If the learner dies before the round's checkpoint, the resumed run charges those invocations once:
each from the summary its actor left in the cache, or at its timeout-bounded worst case where
none is there, marked as interrupted in the ledger.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nitro.actors.events import ActorSummary
from nitro.cache import TrajectoryCache
from nitro.checkpoint import load_inflight
from nitro.cost import CostLedger

log = logging.getLogger("nitro")


def bill_interrupted_round(home: str | Path, run_id: str, next_round: int, cache: TrajectoryCache,
                           ledger: CostLedger) -> int:
    """Charge the dead attempt's invocations, if there is one not yet billed (the same attempt is
    never billed twice); returns how many invocations were billed."""
    record = load_inflight(home, run_id)
    if record is None or int(record["round"]) < next_round or record["attempt"] in ledger.billed_attempts():
        return 0
    k, ids = int(record["round"]), list(record["invocations"])
    found = cache.get_summaries(k, ids)
    billed = [billed_ms(found.get(i), ledger.max_billed_ms) for i in ids]
    cost = ledger.charge_round(k, 0, billed, n_requests=len(ids), interrupted_attempt=str(record["attempt"]))
    log.warning("round %d died with %d invocations in flight: billed $%.6f (%d from their summaries, %d at "
                "their timeout)", k + 1, len(ids), float(cost.total), len(found), len(ids) - len(found))
    return len(ids)


def billed_ms(summary_json: bytes | None, worst_ms: int | None) -> int:
    """An invocation's billed ms from its stored summary; the worst case without a usable one."""
    if summary_json is not None:
        try:
            return ActorSummary.model_validate_json(summary_json).billed_ms
        except ValueError:
            pass
    return int(worst_ms or 0)
