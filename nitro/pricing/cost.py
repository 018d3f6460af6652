"""The cost ledger: what each round costs, component by component, in exact decimal arithmetic,
so that it adds up to the invoices a user would get (docs/decisions.md, "Cost model"; prices from
``PriceTable``, the paper's §8.1 values by default).

Per round:

* **learner**: ``learner_per_hour × learner_seconds / 3600`` (the round's wall time on the learner
  instance; hand it every second of the round, detection and invocation included; with
  ``clock.kind: lambda``, the round as it would have run on Lambda, ``nitro.pricing.clock``).
* **lambda_compute**: for each actor invocation, ``billed_ms / 1000 × memory_mb / 1024`` GB-s
  (Lambda bills duration per 1 ms, rounded up, at the configured memory; 1 GB = 1024 MB in
  Lambda's pricing) × the duration rate of the architecture. With provisioned concurrency P,
  the first P invocations of the round (in invocation order) run on provisioned instances and are
  billed at the provisioned *duration* rate; the rest spill over to on-demand. Billed ms are
  capped at ``max_billed_ms`` when given (Lambda never bills past the function timeout; a local
  worker is killed there).
* **requests**: ``n_requests × per_million / 10**6`` (every invocation is a request; retries of
  throttled calls are not billed by AWS, so pass the accepted invocations).
* **interrupted invocations**: a round whose learner died mid-flight (``kill -9``, a lost machine)
  never reached its own charge, yet Lambda bills every invocation it started. On resume the
  engine charges them with ``charge_round(..., interrupted=True)``: compute and requests only, from
  the summaries the actors left in the cache, at the timeout-bounded worst case where none did.
  Such an entry is marked ``interrupted`` and names the attempt it bills (``attempt``), so that
  the same dead attempt is never billed twice.
* **provisioned**: ``P × GB × seconds × provisioned_gb_s`` for the time provisioned concurrency is
  enabled. AWS rounds that period up to 5 minutes; the ledger charges the running total so
  that the cumulative charge equals the rounded-up invoice after every round:
  ``charge_k = cost(ceil_300(S_k)) − cost(ceil_300(S_{k−1}))`` with S the cumulative seconds
  (``provisioned_rounding_s=0`` turns the rounding off).

* **vm**: with ``backend.pricing: vm`` the actors run on EC2 instances instead, and this line
  replaces ``lambda_compute`` and ``requests``: each instance from its start to its stop, idle
  time included, per second with a one-minute minimum per start (``nitro.pricing.vm``).

Local actors are priced as if they were Lambda (or the configured VMs) at the configured memory and architecture, from
their measured durations (ceil to ms); ``tags()`` says so, and the engine logs the tags with the
run. Amounts are kept as ``Decimal`` (prices enter via ``Decimal(str(price))``, so
``0.0000166667`` is that number exactly); floats appear only in ``metrics()`` for MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from functools import cached_property
from typing import Any

from nitro.config import PriceTable
from nitro.pricing.amount import S_PER_H, D
from nitro.pricing.vm import VmFleet

_MS_PER_S = Decimal(1000)
_MB_PER_GB = Decimal(1024)
_MILLION = Decimal(1_000_000)
CENT = Decimal("0.01")

COMPONENTS = ("learner", "lambda_compute", "requests", "provisioned", "vm")


def to_cents(x: Decimal) -> Decimal:
    return x.quantize(CENT, rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class RoundCost:
    """One round's charges (USD, exact) and the quantities behind them."""

    round_idx: int
    learner: Decimal
    lambda_compute: Decimal
    requests: Decimal
    provisioned: Decimal
    cumulative: Decimal
    learner_seconds: Decimal = Decimal(0)
    n_actors: int = 0
    n_requests: int = 0
    billed_ms: int = 0
    gb_s: Decimal = Decimal(0)
    provisioned_seconds: Decimal = Decimal(0)
    interrupted: bool = False  # invocations of a round whose learner died, billed on resume
    attempt: str = ""  # for an interrupted entry: the id of the dead attempt it bills
    vm: Decimal = Decimal(0)  # actor instances (backend.pricing: vm)

    @property
    def total(self) -> Decimal:
        return self.learner + self.lambda_compute + self.requests + self.provisioned + self.vm

    def metrics(self) -> dict[str, float]:
        """Floats for MLflow, one per component plus totals."""
        out = {f"cost_{c}_usd": float(getattr(self, c)) for c in COMPONENTS}
        out.update(
            cost_round_usd=float(self.total),
            cost_cumulative_usd=float(self.cumulative),
            cost_gb_s=float(self.gb_s),
            cost_billed_ms=float(self.billed_ms),
            cost_requests=float(self.n_requests),
        )
        return out

    @cached_property
    def row(self) -> dict[str, Any]:
        """``to_dict()`` made once: a checkpoint stores each round's row once, knowing it by
        identity (nitro/run/rowblocks.py). Read it, never change it."""
        return self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able and exact: amounts as decimal strings."""
        return {
            "round_idx": self.round_idx,
            **{c: str(getattr(self, c)) for c in COMPONENTS},
            "total": str(self.total),
            "cumulative": str(self.cumulative),
            "learner_seconds": str(self.learner_seconds),
            "n_actors": self.n_actors,
            "n_requests": self.n_requests,
            "billed_ms": self.billed_ms,
            "gb_s": str(self.gb_s),
            "provisioned_seconds": str(self.provisioned_seconds),
            "interrupted": self.interrupted,
            "attempt": self.attempt,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoundCost:
        dec = ("learner", "lambda_compute", "requests", "provisioned", "cumulative", "learner_seconds", "gb_s",
               "provisioned_seconds")
        return cls(
            round_idx=int(d["round_idx"]),
            **{k: Decimal(d[k]) for k in dec}, vm=Decimal(d.get("vm", "0")),
            n_actors=int(d["n_actors"]), n_requests=int(d["n_requests"]), billed_ms=int(d["billed_ms"]),
            interrupted=bool(d.get("interrupted", False)), attempt=str(d.get("attempt", "")),
        )


@dataclass
class CostLedger:
    prices: PriceTable
    memory_mb: int = 1024
    architecture: str = "x86_64"  # "x86_64" | "arm64"
    provisioned_concurrency: int = 0
    local_actors: bool = False  # not on Lambda (local processes or Ray), priced as if they were
    actors_backend: str | None = None  # where they ran, for the tags: "local" or "ray"; None: from local_actors
    max_billed_ms: int | None = None
    provisioned_rounding_s: int = 300
    learner_clock: str = "measured"  # what learner seconds are handed in: "measured" | "lambda" (nitro.pricing.clock)
    vm: VmFleet | None = None  # actors billed as EC2 instances (backend.pricing: vm), not as Lambda
    rounds: list[RoundCost] = field(default_factory=list)
    _provisioned_s: Decimal = Decimal(0)

    def __post_init__(self) -> None:
        if self.architecture not in ("x86_64", "arm64"):
            raise ValueError(f"architecture must be x86_64 or arm64, not {self.architecture!r}")
        if self.memory_mb <= 0 or self.provisioned_concurrency < 0:
            raise ValueError("memory_mb must be positive and provisioned_concurrency non-negative")

    # -- rates ------------------------------------------------------------------------------------

    @property
    def gb(self) -> Decimal:
        return Decimal(self.memory_mb) / _MB_PER_GB

    @property
    def _arm(self) -> bool:
        return self.architecture == "arm64"

    @property
    def rate_gb_s(self) -> Decimal:
        return D(self.prices.lambda_gb_s_arm if self._arm else self.prices.lambda_gb_s_x86)

    @property
    def rate_provisioned_duration_gb_s(self) -> Decimal:
        return D(self.prices.provisioned_duration_gb_s_arm if self._arm else self.prices.provisioned_duration_gb_s)

    @property
    def rate_provisioned_gb_s(self) -> Decimal:
        return D(self.prices.provisioned_gb_s_arm if self._arm else self.prices.provisioned_gb_s)

    @property
    def rate_request(self) -> Decimal:
        return D(self.prices.lambda_per_million_requests) / _MILLION

    # -- pieces -----------------------------------------------------------------------------------

    def _ms(self, billed: int | float) -> int:
        ms = math.ceil(billed) if not isinstance(billed, int) else billed
        if ms < 0:
            raise ValueError(f"negative billed duration: {billed!r}")
        return min(ms, self.max_billed_ms) if self.max_billed_ms is not None else ms

    def learner_cost(self, seconds: float | Decimal) -> Decimal:
        s = D(seconds)
        if s < 0:
            raise ValueError("negative learner time")
        return D(self.prices.learner_per_hour) * s / S_PER_H

    def _provisioned_cost_of(self, seconds: Decimal) -> Decimal:
        if self.provisioned_rounding_s > 0:
            step = Decimal(self.provisioned_rounding_s)
            seconds = (seconds / step).to_integral_value(rounding="ROUND_CEILING") * step
        return Decimal(self.provisioned_concurrency) * self.gb * seconds * self.rate_provisioned_gb_s

    def provisioned_cost(self, seconds: float | Decimal) -> Decimal:
        """What enabling provisioned concurrency for ``seconds`` more would add now."""
        if self.provisioned_concurrency == 0:
            return Decimal(0)
        s = D(seconds)
        if s < 0:
            raise ValueError("negative provisioned time")
        return self._provisioned_cost_of(self._provisioned_s + s) - self._provisioned_cost_of(self._provisioned_s)

    def invocation_cost(self, billed_ms: int | float, provisioned: bool = False) -> Decimal:
        """One invocation: its duration at the right rate plus one request."""
        rate = self.rate_provisioned_duration_gb_s if provisioned else self.rate_gb_s
        return Decimal(self._ms(billed_ms)) / _MS_PER_S * self.gb * rate + self.rate_request

    def estimate_actor_cost(self, steps: int, ms_per_step: float) -> Decimal:
        """Expected cost of one actor of ``steps`` steps at ``ms_per_step`` (a measured mean, e.g.
        from ``profile-actor``), at the on-demand rate (never below the provisioned one) plus one
        request. An estimate, not a bound: use ``max_actor_cost`` where a guarantee is needed."""
        return self.invocation_cost(math.ceil(D(steps) * D(ms_per_step)))

    def max_actor_cost(self) -> Decimal:
        """The most one invocation can be billed: ``max_billed_ms`` (the timeout) at the dearer of
        the on-demand and (where configured) provisioned duration rates, plus one request. An
        upper bound, which is what ``cap_by_budget`` needs for its guarantee."""
        if self.max_billed_ms is None:
            raise ValueError("max_actor_cost needs max_billed_ms (the function timeout)")
        return self.max_functions_cost(self.max_billed_ms, 1)

    def max_functions_cost(self, billed_ms: int, invocations: int) -> Decimal:
        """An upper bound of what ``invocations`` billed ``billed_ms`` in all can cost on Lambda:
        the duration at the dearer of the on-demand and (where configured) provisioned rates, plus
        one request each (one actor at its timeout; Stellaris's learner functions under their
        allowance)."""
        rate = self.rate_gb_s
        if self.provisioned_concurrency:
            rate = max(rate, self.rate_provisioned_duration_gb_s)
        return Decimal(billed_ms) / _MS_PER_S * self.gb * rate + invocations * self.rate_request

    def max_actors_cost(self, invocations: int, actors: int, seconds: float | Decimal) -> Decimal:
        """An upper bound of what ``invocations`` (``actors`` of them training actors) can add to
        the invoice while the learner runs ``seconds``: each at its timeout on Lambda; on VMs,
        the instances they need, up all that time (``VmFleet.bound``)."""
        if self.vm is not None:
            return self.vm.bound(actors, invocations, seconds)
        return invocations * self.max_actor_cost() if invocations else Decimal(0)

    def round_fixed_cost(self, learner_seconds: float | Decimal, provisioned_seconds: float | Decimal = 0) -> Decimal:
        """The part of a round's cost that does not scale with its actors: learner time plus the
        provisioned-concurrency increment. With upper bounds of the two durations it is an upper
        bound of the round's fixed charge."""
        return self.learner_cost(learner_seconds) + self.provisioned_cost(provisioned_seconds)

    # -- charging ---------------------------------------------------------------------------------

    def charge_round(
        self,
        round_idx: int,
        learner_seconds: float | Decimal,
        actor_billed_ms: Sequence[int | float],
        n_requests: int | None = None,
        provisioned_seconds: float | Decimal = 0,
        *,
        interrupted_attempt: str | None = None,
    ) -> RoundCost:
        """Record round ``round_idx``'s charges; returns them with the new cumulative total.
        ``n_requests`` defaults to one per actor. ``interrupted_attempt``: these are the
        invocations of a dead attempt at the round, billed on resume (see the module docstring)."""
        ms = [self._ms(b) for b in actor_billed_ms]
        n_req = len(ms) if n_requests is None else int(n_requests)
        if n_req < 0:
            raise ValueError("negative request count")
        n_pc = min(self.provisioned_concurrency, len(ms))
        ms_pc, ms_od = sum(ms[:n_pc]), sum(ms[n_pc:])
        gb_s_pc = Decimal(ms_pc) / _MS_PER_S * self.gb
        gb_s_od = Decimal(ms_od) / _MS_PER_S * self.gb
        compute = gb_s_od * self.rate_gb_s + gb_s_pc * self.rate_provisioned_duration_gb_s
        prov = self.provisioned_cost(provisioned_seconds)
        if self.provisioned_concurrency:
            self._provisioned_s += D(provisioned_seconds)
        learner = self.learner_cost(learner_seconds)
        requests = Decimal(n_req) * self.rate_request
        vm = Decimal(0)
        if self.vm is not None:  # the instances bill the actors, not Lambda
            compute = requests = Decimal(0)
            vm = self.vm.charge(learner_seconds) if interrupted_attempt is None else Decimal(0)
        total = learner + compute + requests + prov + vm
        rc = RoundCost(
            round_idx=int(round_idx), learner=learner, lambda_compute=compute, requests=requests,
            provisioned=prov, cumulative=self.spent + total, learner_seconds=D(learner_seconds),
            n_actors=len(ms), n_requests=n_req, billed_ms=ms_pc + ms_od, gb_s=gb_s_pc + gb_s_od,
            provisioned_seconds=D(provisioned_seconds),
            interrupted=interrupted_attempt is not None, attempt=interrupted_attempt or "", vm=vm,
        )
        self.rounds.append(rc)
        return rc

    # -- totals -----------------------------------------------------------------------------------

    @property
    def spent(self) -> Decimal:
        return self.rounds[-1].cumulative if self.rounds else Decimal(0)

    @property
    def spent_usd(self) -> float:
        return float(self.spent)

    def remaining(self, budget_usd: float | Decimal | None) -> Decimal | None:
        return None if budget_usd is None else D(budget_usd) - self.spent

    def billed_attempts(self) -> set[str]:
        """The dead attempts whose invocations are already billed."""
        return {r.attempt for r in self.rounds if r.interrupted}

    def interrupted_cost(self, round_idx: int) -> Decimal:
        """What the dead attempts at round ``round_idx`` were billed."""
        return sum((r.total for r in self.rounds if r.interrupted and r.round_idx == round_idx), Decimal(0))

    def totals(self) -> dict[str, Decimal]:
        out = {c: sum((getattr(r, c) for r in self.rounds), Decimal(0)) for c in COMPONENTS}
        out["total"] = self.spent
        return out

    def tags(self) -> dict[str, str]:
        """Run tags describing how actors were priced."""
        priced = f"aws-lambda {self.architecture} {self.memory_mb}MB"
        if self.vm is not None:
            c = self.vm.config
            priced = (f"aws-ec2 {c.instance_type} ({c.vcpus} vCPUs, ${c.per_hour}/h, {c.price_source}), "
                      f"{c.startup_s:g} s start-up, billed per second, {c.min_billed_s} s minimum")
        tags = {
            "cost.actors_backend": self.actors_backend or ("local" if self.local_actors else "lambda"),
            "cost.actor_pricing": priced,
            "cost.provisioned_concurrency": str(self.provisioned_concurrency),
            "cost.learner_per_hour": str(D(self.prices.learner_per_hour)),
            "cost.learner_clock": self.learner_clock,
        }
        if self.local_actors:
            backend = self.actors_backend or "local"
            tags["cost.note"] = (
                f"{backend} actors priced as if they ran on the EC2 instances above" if self.vm is not None
                else f"{backend} actors priced as if they were Lambda, from measured duration and memory")
        return tags

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": "nitro.cost_ledger/1",
            "memory_mb": self.memory_mb,
            "architecture": self.architecture,
            "provisioned_concurrency": self.provisioned_concurrency,
            "local_actors": self.local_actors,
            "provisioned_seconds": str(self._provisioned_s),
            "rounds": [r.row for r in self.rounds],
            **({"vm": self.vm.state_dict()} if self.vm is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != "nitro.cost_ledger/1":
            raise ValueError(f"not a cost ledger state: format {state.get('format')!r}")
        for key in ("memory_mb", "architecture", "provisioned_concurrency", "local_actors"):
            if state[key] != getattr(self, key):
                raise ValueError(f"ledger state has {key}={state[key]!r}, this ledger {getattr(self, key)!r}")
        self._provisioned_s = Decimal(state["provisioned_seconds"])
        self.rounds = [RoundCost.from_dict(r) for r in state["rounds"]]
        if self.vm is not None:
            self.vm.load_state_dict(state.get("vm", {"sessions": []}))


def ledger_from_config(cfg: Any) -> CostLedger:
    """A ledger for a ``NitroConfig``: memory, architecture, provisioned concurrency and the
    timeout cap from ``cfg.backend``; actors off Lambda (``local``, ``ray``) are priced as Lambda."""
    b = cfg.backend
    timeout_s = b.lambda_.function_timeout_s if b.kind == "lambda" else b.timeout_s
    prices = cfg.prices
    if cfg.learner.mode == "stellaris":  # the learner process is a parameter server on its own, smaller instance
        prices = prices.model_copy(update={"learner_per_hour": cfg.learner.server_per_hour})
    return CostLedger(
        prices=prices,
        memory_mb=b.memory_mb,
        architecture=b.lambda_.architecture,
        provisioned_concurrency=b.lambda_.provisioned_concurrency if b.kind == "lambda" else 0,
        local_actors=b.kind != "lambda",
        actors_backend=b.kind,
        max_billed_ms=math.ceil(timeout_s * 1000),
        learner_clock=cfg.clock.kind,
        vm=VmFleet(b.vm) if b.pricing == "vm" else None,
    )
