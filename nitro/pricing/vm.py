"""Actors on EC2 instances (``backend.pricing: vm``): the fleet a run's decisions scale, its
invoice, and the clock of a round whose actors run on it.

**The fleet.** One actor per vCPU. A round's decision sizes the fleet for its actors:
``max(min_instances, ceil(actors / vcpus))`` instances, and one when only evaluation episodes run
(they share the instances' vCPUs, in waves). Instances beyond that number stop at the decision
(the newest first); missing ones start at the decision and can run actors ``startup_s`` later.

**The invoice** (docs/decisions.md, "Actors on VMs"). Each instance is billed from its start
request to its stop, idle time included (the learner's update, the wait for the slowest actor),
per second, with AWS's minimum (``min_billed_s``, 60 s) per start:
``cost(S) = per_hour x max(min_billed_s, ceil(S)) / 3600`` for an instance up S seconds. Within a
round an instance that runs throughout is up the round's billed seconds; one started at the
decision is up from the decision (``decided_after_s`` into the round) to the round's end, its
start-up included; one stopped at the decision is up until then. As with provisioned
concurrency in ``nitro.pricing.cost``, a round is charged the growth of each instance's rounded-up cost,
so the cumulative charge equals the invoice after every round.

**The clock.** A round whose decision starts instances waits ``startup_s`` before its actors run
(*VM pause*: the learner is idle and billed), or trains on replayed batches meanwhile (*VM
replay*, ``nitro.run.vm_replay``: the wait is then what the replay leaves of it). The wait is added
to the round's seconds, never slept. On the projected clock (``clock.kind: lambda``, which for
VM actors projects onto the fleet) the round is the learner's steps as measured, plus the wait,
plus ``ceil(invocations / (instances x vcpus))`` waves of the slowest invocation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal
from typing import Any

from nitro.config import ClockConfig
from nitro.config.vm import VmConfig
from nitro.pricing.amount import S_PER_H, D
from nitro.pricing.clock import RoundClock


def billed_instance_s(up_s: Decimal, min_billed_s: int) -> Decimal:
    """The seconds AWS bills an instance up ``up_s`` seconds: whole seconds, at least the
    minimum; nothing for an instance never up."""
    if up_s <= 0:
        return Decimal(0)
    return max(Decimal(min_billed_s), up_s.to_integral_value(rounding=ROUND_CEILING))


@dataclass
class InstanceSession:
    """One instance from its start request to its stop."""

    up_s: Decimal = Decimal(0)  # seconds up so far, unrounded
    running: bool = True


@dataclass
class FleetChange:
    """What a round's decision did to the fleet, and what the round waited for it."""

    round_idx: int
    instances: int  # running after the decision
    started: int
    stopped: int
    decided_after_s: float  # the round's seconds before its decision
    wait_s: float  # from the decision until the new instances' actors can run (0: none started)
    replay_s: float = 0.0  # vm-replay: the learner's seconds on replayed batches during the wait
    replay_updates: int = 0

    @property
    def idle_wait_s(self) -> float:
        """What the round waits beyond its replay: the learner's idle seconds."""
        return max(0.0, self.wait_s - self.replay_s)


@dataclass
class VmFleet:
    """The actor instances of one run: their sessions, the current round's change, the invoice."""

    config: VmConfig
    sessions: list[InstanceSession] = field(default_factory=list)
    change: FleetChange | None = None  # set by the round's decision, cleared when the round is charged

    @property
    def running(self) -> int:
        return sum(s.running for s in self.sessions)

    @property
    def vcpus(self) -> int:
        return int(self.config.vcpus or 1)

    @property
    def per_hour(self) -> Decimal:
        return D(self.config.per_hour or 0)

    def instances_for(self, actors: int, invocations: int) -> int:
        """Instances a round with ``actors`` training actors and ``invocations`` in all needs."""
        needed = math.ceil(max(0, actors) / self.vcpus) if actors > 0 else int(invocations > 0)
        return max(self.config.min_instances, needed)

    def instance_cost(self, up_s: Decimal) -> Decimal:
        return self.per_hour * billed_instance_s(up_s, self.config.min_billed_s) / S_PER_H

    def scale(self, round_idx: int, actors: int, invocations: int, decided_after_s: float) -> FleetChange:
        """Size the fleet for round ``round_idx``'s decision (applied to the sessions when the
        round is charged)."""
        want, have = self.instances_for(actors, invocations), self.running
        started = max(0, want - have)
        self.change = FleetChange(round_idx=round_idx, instances=want, started=started, stopped=max(0, have - want),
                                  decided_after_s=max(0.0, float(decided_after_s)),
                                  wait_s=float(self.config.startup_s) if started else 0.0)
        return self.change

    def record_replay(self, seconds: float, updates: int) -> None:
        """vm-replay: the learner trained on replayed batches for ``seconds`` during the wait."""
        if self.change is not None:
            self.change.replay_s += max(0.0, float(seconds))
            self.change.replay_updates += int(updates)

    def charge(self, round_s: float | Decimal) -> Decimal:
        """The round's charge for ``round_s`` billed seconds (see the module docstring); applies
        and clears the round's change."""
        seconds, change = D(round_s), self.change
        running = [s for s in self.sessions if s.running]
        n_stop = change.stopped if change is not None else 0
        decided = D(change.decided_after_s) if change is not None else Decimal(0)
        new = [InstanceSession() for _ in range(change.started if change is not None else 0)]
        kept, stopping = running[:len(running) - n_stop], running[len(running) - n_stop:]
        ups = [(s, seconds) for s in kept] + [(s, min(decided, seconds)) for s in stopping] + \
              [(s, max(Decimal(0), seconds - decided)) for s in new]
        total = Decimal(0)
        for session, up in ups:
            total += self.instance_cost(session.up_s + up) - self.instance_cost(session.up_s)
            session.up_s += up
        for session in stopping:
            session.running = False
        self.sessions.extend(new)
        self.change = None
        return total

    def bound(self, actors: int, invocations: int, seconds: float | Decimal) -> Decimal:
        """An upper bound of the fleet's charge for a decision for ``actors`` (``invocations`` in
        all) whose learner runs ``seconds`` until the next decision: every running instance and
        every one it starts, up all that time."""
        s = D(seconds)
        running = [x for x in self.sessions if x.running]
        more = max(0, self.instances_for(actors, invocations) - len(running))
        kept = sum((self.instance_cost(x.up_s + s) - self.instance_cost(x.up_s) for x in running), Decimal(0))
        return kept + more * self.instance_cost(s)

    def state_dict(self) -> dict[str, Any]:
        return {"sessions": [{"up_s": str(s.up_s), "running": s.running} for s in self.sessions]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sessions = [InstanceSession(Decimal(s["up_s"]), bool(s["running"])) for s in state["sessions"]]
        self.change = None


def vm_round_s(round_s: float, actor_s: float, actor_durations_s: Sequence[float], capacity: int,
               wait_s: float) -> float:
    """Round seconds had its invocations run on the fleet's ``capacity`` vCPUs (module docstring)."""
    learner_side = max(0.0, round_s - actor_s)
    n = len(actor_durations_s)
    if not n:
        return learner_side + wait_s
    return learner_side + wait_s + math.ceil(n / max(1, capacity)) * max(actor_durations_s)


@dataclass
class VmRoundClock:
    """The clock of a run whose actors are billed as VMs: ``RoundClock``'s interface."""

    config: ClockConfig
    fleet: VmFleet
    warm_instances: int = 0  # the Lambda clock's; kept so that checkpoints read the same
    last: dict[str, float] = field(default_factory=dict)

    @property
    def projected(self) -> bool:
        return self.config.kind == "lambda"

    def round(self, round_s: float, actor_s: float, actor_durations_s: Sequence[float],
              learning_s: float = 0.0) -> tuple[float, float]:
        """(the seconds billed to the learner, the fleet-projected seconds) of one round (learner
        functions do not run on VMs: ``learning_s`` is always 0 here)."""
        change, fleet = self.fleet.change, self.fleet
        wait = change.idle_wait_s if change is not None else 0.0
        capacity = (change.instances if change is not None else fleet.running) * fleet.vcpus
        projected = vm_round_s(round_s, actor_s, actor_durations_s, capacity, wait)
        self.last = {"vm/instances": float(change.instances if change is not None else fleet.running)}
        if change is not None:  # wait_s: the learner's idle wait; startup_s: the instances' start-up
            self.last.update({"vm/started": float(change.started), "vm/stopped": float(change.stopped),
                              "vm/startup_s": change.wait_s, "vm/wait_s": wait, "vm/replay_s": change.replay_s,
                              "vm/replay_updates": float(change.replay_updates)})
        return (projected if self.projected else round_s + wait), projected

    def round_extras(self) -> dict[str, float]:
        """The fleet's figures of the last round, for its metrics."""
        return dict(self.last)

    def startup_s(self, invocations: int, actors: int = 0) -> float:
        """What the budget cap adds before a round's invocations run: the start-up wait where
        the decision would start instances (replay may shorten it, never lengthen it)."""
        more = self.fleet.instances_for(actors, invocations) > self.fleet.running
        return float(self.fleet.config.startup_s) if more else 0.0

    def capacity(self, invocations: int, actors: int = 0) -> int | None:
        """Invocations that run at once on the projected clock (None: the backend's own)."""
        return self.fleet.instances_for(actors, invocations) * self.fleet.vcpus if self.projected else None


def make_round_clock(config: ClockConfig, fleet: VmFleet | None,
                     provisioned_instances: int) -> RoundClock | VmRoundClock:
    """The clock of a run: its VM fleet's where its actors are billed as VMs, else Lambda's
    (whose provisioned instances never start cold)."""
    if fleet is not None:
        return VmRoundClock(config, fleet)
    return RoundClock(config, warm_instances=provisioned_instances)
