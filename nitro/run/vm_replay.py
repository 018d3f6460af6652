"""VM replay (paper §2.3, Fig. 3): while the instances a boosting decision started boot, the
learner trains on old trajectories instead of idling.

``replay_while_instances_start(training, k)`` runs between round k's decision and its
invocations, only when the decision started instances and the scaler is ``vm-replay``. It
updates on replayed batches until the start-up has passed on the learner's own clock
(``backend.vm.startup_s``, measured by the updates' wall time) or ``backend.vm.replay_max_updates``
updates are done, whichever is first; the fleet records the seconds, so the round waits only for
what the replay left of the start-up (``nitro.pricing.vm``). On-policy (PPO) the replayed batches are the
previous round's, which the round's update has just trained on and which stay in the cache until
the round ends; off-policy (IMPACT) the learner's own replay buffer. A round with nothing to
replay (the first) waits as VM pause does.

On-policy, each replayed update is a full ``learner.update`` of the same batches: it merges their
observation statistics again, so the replayed round weighs more in the normaliser. RLlib's replay
would not; it is the price of keeping the learner contract closed, and it only touches the baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nitro.learners import OffPolicyLearner, Progress
from nitro.run.engine import TrainingRun
from nitro.validation import BatchError, decode_batch

REPLAY_SCALER = "vm-replay"


@dataclass(frozen=True)
class ReplayReport:
    """What the learner did while the round's new instances started."""

    updates: int = 0
    seconds: float = 0.0


def replay_while_instances_start(training: TrainingRun, k: int) -> ReplayReport:
    """Round ``k``'s updates on replayed batches during its instances' start-up (module docstring)."""
    fleet = training.ledger.vm
    change = fleet.change if fleet is not None else None
    if (fleet is None or change is None or change.round_idx != k or not change.started
            or training.config.scaler.name != REPLAY_SCALER):
        return ReplayReport()
    learner, limit = training.learner, training.config.backend.vm.replay_max_updates
    off_policy = learner if isinstance(learner, OffPolicyLearner) else None
    batches = None if off_policy is not None else _previous_batches(training, k)
    started, updates = time.perf_counter(), 0
    while updates < limit and time.perf_counter() - started < change.wait_s:
        if off_policy is not None:
            if off_policy.replay_update(deadline=training.deadline.at) is None:
                break
        elif not batches:
            break
        else:
            learner.update(batches, progress=Progress(k, training.config.rounds), deadline=training.deadline.at)
        updates += 1
    report = ReplayReport(updates, time.perf_counter() - started)
    fleet.record_replay(report.seconds, report.updates)
    return report


def _previous_batches(training: TrainingRun, k: int) -> list[dict]:
    """Round k-1's batches that passed validation (those round k's update trained on)."""
    pending = training.mode.pending
    if k < 1 or not pending:
        return []
    found = training.cache.collect(k - 1, set(pending), deadline_s=0.0)
    batches = []
    for inv_id, payload in sorted(found.batches.items()):
        try:
            batches.append(decode_batch(payload, training.spec, training.config.steps_per_actor, inv_id))
        except BatchError:
            continue  # the round's update dropped it too
    return batches
