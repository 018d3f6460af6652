"""Actor profiling (paper §7): invoke the actor at several memory sizes, recommend one.

``profile_actor(backend_factory, memory_sizes, event_template) -> ProfileReport``

* ``backend_factory(memory_mb)`` returns a backend (``invoke(event) -> ActorSummary``, ``close()``)
  whose actor runs with that much memory: for Lambda, e.g. a ``LambdaActorBackend`` whose
  ``qualifier`` is an alias published at that memory size (``deployments/deploy_lambda.py
  --profile-memory 512,1024,...`` creates ``mem512``, ``mem1024``, ...), or a function per size.
* For each size: ``warmup`` invocations (cold starts; reported, not ranked), then ``repeats``
  measured invocations, one at a time so they do not compete for the same CPU.
* Duration of an invocation: Lambda's billed duration when it reports one, else the duration
  measured inside the actor. Cost of an invocation: GB-s x price + the per-request price.
* Recommendation: among sizes with no failed invocation, those "not slower" are the ones whose
  median duration is within ``tolerance`` (default 10 %) of the fastest median; of those, the
  cheapest per invocation (ties: the smaller size). Memory buys CPU on Lambda (1,769 MB is one
  vCPU), so past the point where the rollout stops getting faster, more memory only costs more.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from nitro.actors.events import ActorEvent, ActorSummary

GB_S_X86 = 0.0000166667
GB_S_ARM = 0.0000133334
PER_REQUEST = 0.20 / 1_000_000


@dataclass
class SizeResult:
    memory_mb: int
    runs: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)
    durations_ms: list[float] = field(default_factory=list)
    cold_ms: list[float] = field(default_factory=list)
    median_ms: float | None = None
    p90_ms: float | None = None
    steps: int = 0
    cost_per_invocation_usd: float | None = None
    cost_per_1k_steps_usd: float | None = None
    not_slower: bool = False


@dataclass
class ProfileReport:
    sizes: list[SizeResult]
    recommended_mb: int | None
    fastest_mb: int | None
    tolerance: float
    architecture: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """A plain-text table for the CLI."""
        lines = [f"{'memory MB':>9}  {'median ms':>9}  {'p90 ms':>8}  {'$/invocation':>12}  {'$/1k steps':>10}  note"]
        for s in self.sizes:
            note = ("RECOMMENDED" if s.memory_mb == self.recommended_mb
                    else "failed" if s.failures else "not slower" if s.not_slower else "")
            med = f"{s.median_ms:9.0f}" if s.median_ms is not None else f"{'-':>9}"
            p90 = f"{s.p90_ms:8.0f}" if s.p90_ms is not None else f"{'-':>8}"
            cost = f"{s.cost_per_invocation_usd:12.8f}" if s.cost_per_invocation_usd is not None else f"{'-':>12}"
            c1k = f"{s.cost_per_1k_steps_usd:10.8f}" if s.cost_per_1k_steps_usd is not None else f"{'-':>10}"
            lines.append(f"{s.memory_mb:>9}  {med}  {p90}  {cost}  {c1k}  {note}")
        lines.append(self.reason)
        return "\n".join(lines)


def _duration_ms(s: ActorSummary) -> float:
    return float(s.billed_ms) if s.billed_ms > 0 else float(s.duration_s) * 1000.0


def _event_for(template: ActorEvent | dict[str, Any], suffix: str) -> ActorEvent | dict[str, Any]:
    if isinstance(template, ActorEvent):
        return template.model_copy(update={"invocation_id": f"{template.invocation_id}-{suffix}"})
    ev = dict(template)
    ev["invocation_id"] = f"{ev.get('invocation_id', 'profile')}-{suffix}"
    return ev


def profile_actor(
    backend_factory: Callable[[int], Any],
    memory_sizes: Iterable[int],
    event_template: ActorEvent | dict[str, Any],
    *,
    repeats: int = 3,
    warmup: int = 1,
    tolerance: float = 0.10,
    architecture: str = "x86_64",
    gb_s_price: float | None = None,
    request_price: float = PER_REQUEST,
) -> ProfileReport:
    """Invoke the actor at each memory size and recommend the cheapest size that is not slower."""
    sizes = sorted({int(m) for m in memory_sizes})
    if not sizes:
        raise ValueError("profile_actor needs at least one memory size")
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    price = gb_s_price if gb_s_price is not None else (GB_S_ARM if architecture == "arm64" else GB_S_X86)
    results: list[SizeResult] = []
    for mem in sizes:
        res = SizeResult(memory_mb=mem)
        backend = backend_factory(mem)
        try:
            for i in range(warmup + repeats):
                summary = backend.invoke(_event_for(event_template, f"m{mem}-{i}"))
                if i < warmup:
                    if summary.ok:
                        res.cold_ms.append(_duration_ms(summary))
                    continue
                res.runs += 1
                if not summary.ok:
                    res.failures += 1
                    res.errors.append(summary.error or "failed")
                    continue
                res.durations_ms.append(_duration_ms(summary))
                res.steps = max(res.steps, summary.steps)
        finally:
            close = getattr(backend, "close", None)
            if close is not None:
                close()
        if res.durations_ms:
            ds = sorted(res.durations_ms)
            res.median_ms = statistics.median(ds)
            res.p90_ms = ds[min(len(ds) - 1, round(0.9 * (len(ds) - 1)))]
            res.cost_per_invocation_usd = res.median_ms / 1000.0 * mem / 1024.0 * price + request_price
            if res.steps:
                res.cost_per_1k_steps_usd = res.cost_per_invocation_usd * 1000.0 / res.steps
        results.append(res)

    healthy = [(r.median_ms, r) for r in results if r.failures == 0 and r.median_ms is not None]
    if not healthy:
        return ProfileReport(results, None, None, tolerance, architecture,
                             "no memory size completed every invocation; nothing to recommend")
    fastest_ms, fastest = min(healthy, key=lambda mr: (mr[0], mr[1].memory_mb))
    limit = fastest_ms * (1.0 + tolerance)
    for median_ms, r in healthy:
        r.not_slower = median_ms <= limit
    best = min((r for _, r in healthy if r.not_slower), key=lambda r: (r.cost_per_invocation_usd, r.memory_mb))
    reason = (f"recommended {best.memory_mb} MB: the cheapest size (${best.cost_per_invocation_usd:.8f}/invocation) "
              f"whose median duration {best.median_ms:.0f} ms is within {tolerance:.0%} of the fastest "
              f"({fastest.memory_mb} MB, {fastest_ms:.0f} ms)")
    return ProfileReport(results, best.memory_mb, fastest.memory_mb, tolerance, architecture, reason)
