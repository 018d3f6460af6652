"""When the parameter server applies landed gradients, and how much each one counts.

Learner functions compute PPO gradients against a snapshot of the policy (version ``v_k``) while
the parameter server (PS) keeps applying gradients from others, so a gradient lands *stale*:

    s = v_PS - v_k          v_PS counts aggregation events (version bumps), read at the landing

A landed gradient joins the pending list P. The PS applies all of P (in landing order) and bumps
its version once when the pending gradients are fresh enough on average or when enough of them
wait:

    mean_{i in P} s_i <= B_t    or    |P| >= K

The bound B_t tightens over the rounds of training, so late updates (small steps near a good
policy) are made from fresher gradients. It is unbounded until a round reports a positive mean
staleness; that round fixes S_max = int(mean) + 1 once, and round t (1-based) then has

    B_t = clip(int(S_max * d**(t-1)) + 1, 1, S_max)

A stale gradient can also count for less: its Adam step is scaled by a staleness weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_DECAY = 0.9


def s_max_from(mean_staleness: float) -> int | None:
    """The loosest bound a run uses, from the first round whose gradients were stale on average;
    None while no round was (then nothing needs bounding)."""
    return None if mean_staleness <= 0 else int(mean_staleness) + 1


def staleness_bound(t: int, s_max: int | None, decay: float = DEFAULT_DECAY) -> int | None:
    """B_t of round ``t`` (1-based): decays from S_max to 1, never below 1 so that a gradient one
    version behind can still be applied on its own. None (unbounded) while S_max is unknown."""
    if t < 1:
        raise ValueError(f"t counts rounds from 1, got {t}")
    if s_max is None:
        return None
    return min(max(int(s_max * decay ** (t - 1)) + 1, 1), s_max)


def should_apply(pending: Sequence[int], bound: int | None, trigger_k: int) -> bool:
    """Whether the PS applies the pending gradients (their stalenesses) now: they are fresh enough
    on average, or K of them wait (so a slow stale one cannot hold the others back forever)."""
    if not pending:
        return False
    if bound is None or len(pending) >= trigger_k:
        return True
    return sum(pending) / len(pending) <= bound


def staleness_weight(s: int, rule: Literal["none", "inverse_power"], kappa: float = 3.0) -> float:
    """The factor on a gradient's learning rate. ``none`` keeps every step whole; ``inverse_power``
    shrinks a stale one as s**(-1/kappa) (s=2: 0.794, s=8: 0.5), a fresh one (s=0) counts fully."""
    if s < 0:
        raise ValueError(f"staleness s must be >= 0, got {s}")
    if rule == "none":
        return 1.0
    if rule == "inverse_power":
        return 1.0 if s == 0 else float(s) ** (-1.0 / kappa)
    raise ValueError(f"rule must be 'none' or 'inverse_power', got {rule!r}")


@dataclass
class BoundState:
    """The one number the bound keeps across rounds (S_max); checkpointed so that a resumed run
    keeps the bound it had."""

    s_max: int | None = None

    def observe_round(self, mean_staleness: float) -> None:
        """Fix S_max from the first round with a positive mean staleness; later rounds leave it."""
        if self.s_max is None:
            self.s_max = s_max_from(mean_staleness)

    def bound(self, t: int, decay: float = DEFAULT_DECAY) -> int | None:
        return staleness_bound(t, self.s_max, decay)

    def to_dict(self) -> dict[str, Any]:
        return {"s_max": self.s_max}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BoundState:
        s_max = data.get("s_max")
        return cls(s_max=None if s_max is None else int(s_max))
