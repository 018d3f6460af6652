"""The parameter server's rules: when pending gradients are applied, the staleness bound that
decays over training, and the weight a gradient's staleness earns it.

Staleness s = v_PS - v_k: aggregation events (version bumps) between the snapshot a function
computed against and the parameter server's version when the gradient lands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


def s_max_from(mean_staleness: float) -> int | None:
    """S_max from the first round whose gradients were stale on average; None while none was."""
    return int(mean_staleness) + 1 if mean_staleness > 0 else None


def staleness_bound(t: int, s_max: int | None, decay: float) -> int | None:
    """B_t = clip(int(S_max d^(t-1)) + 1, 1, S_max) for round t (1-based); None (unbounded) before
    S_max is known. It decays to 1: late training is near-synchronous, when small steps matter."""
    if s_max is None:
        return None
    return max(1, min(int(s_max * decay ** (t - 1)) + 1, s_max))


def should_apply(pending: Sequence[int], bound: int | None, trigger_k: int) -> bool:
    """Apply the pending gradients when their mean staleness is within the bound, or when
    ``trigger_k`` of them wait (so a stale backlog cannot grow without end)."""
    if bound is None or len(pending) >= trigger_k:
        return bool(pending)
    return bool(pending) and sum(pending) / len(pending) <= bound


def staleness_weight(s: int, rule: Literal["none", "inverse_power"], kappa: float = 3.0) -> float:
    """The learning-rate factor of a gradient with staleness ``s``: 1 for "none"; s^(-1/kappa) for
    "inverse_power" (1 for a fresh gradient: s = 0 and s = 1 both take the full step)."""
    if s < 0:
        raise ValueError(f"staleness must be >= 0, got {s}")
    if rule == "none" or s == 0:
        return 1.0
    if rule == "inverse_power":
        return float(s) ** (-1.0 / kappa)
    raise ValueError(f"unknown staleness weighting {rule!r}")


@dataclass
class BoundState:
    """S_max across rounds: set once, from the first round with stale gradients."""

    s_max: int | None = None

    def bound(self, t: int, decay: float) -> int | None:
        return staleness_bound(t, self.s_max, decay)

    def observe_round(self, mean_staleness: float) -> None:
        if self.s_max is None:
            self.s_max = s_max_from(mean_staleness)

    def to_dict(self) -> dict[str, int | None]:
        return {"s_max": self.s_max}

    @classmethod
    def from_dict(cls, d: dict) -> "BoundState":
        return cls(s_max=d.get("s_max"))
