"""Exact amounts: the money and durations the pricing modules bill, as decimals."""

from __future__ import annotations

from decimal import Decimal

S_PER_H = Decimal(3600)


def D(x: float | int | str | Decimal) -> Decimal:
    """Exact decimal of a price or duration (floats via their shortest repr)."""
    d = x if isinstance(x, Decimal) else Decimal(str(x))
    if not d.is_finite():
        raise ValueError(f"not a finite amount: {x!r}")
    return d
