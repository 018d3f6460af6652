"""What every scaler shares: the signal it decides on and its base class (``nitro.scaling.scalers``
has the scalers and ``make_scaler``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from nitro.config import ScalerConfig
from nitro.scaling.noise import NoiseMeasurement, measurement_from
from nitro.scaling.prices import RoundCharge, ledger_rows


@dataclass(frozen=True)
class RoundSignal:
    """What a scaler may look at when deciding round k."""

    R: float | None = None  # Detection.R (None when detection was degenerate or not run)
    grad_noise_scale: float | None = None  # B_simple from the PPO update, for kungfu
    # what MinionsRL's state reads (nitro.scaling.minionsrl.state; None: unknown)
    loss: float | None = None  # this round's update, its mean total loss
    kl: float | None = None
    mean_return: float | None = None  # the latest training episodes' mean return
    learner_s: float | None = None  # this round's update
    actor_s: float | None = None  # the last round's acting, on the billing clock
    spent_usd: float = 0.0
    budget_left_usd: float | None = None  # None: no budget
    # what goodput reads: this round's gradients across its actor fragments (None: not measured)
    # and the run's ledger so far, one entry per usable round (nitro.scaling.prices)
    noise: NoiseMeasurement | None = None
    ledger: tuple[RoundCharge, ...] = ()


def round_signal(R: float | None, diagnostics: Mapping[str, float], grad_noise_scale: float | None,
                 learner_s: float, history: Sequence[Mapping[str, float]], spent_usd: float,
                 budget_left_usd: float | None) -> RoundSignal:
    """Round k's signal from its detection, its update (``diagnostics``: the learner's, by name)
    and the rounds before it (``history``: the engine's per-round metrics). The last round's
    acting is its billed seconds less its learner and detection seconds: on the projected clock,
    the acting a serverless fleet has."""
    last = history[-1] if history else {}
    returns = [r["train_return_mean"] for r in history if valid_number(r.get("train_return_mean"))]
    acting = last.get("round_billed_s", 0.0) - last.get("learner_s", 0.0) - last.get("detection_s", 0.0)
    return RoundSignal(R=R, grad_noise_scale=grad_noise_scale, loss=diagnostics.get("loss"), kl=diagnostics.get("kl"),
                       mean_return=returns[-1] if returns else None, learner_s=learner_s,
                       actor_s=max(0.0, acting) if history else None, spent_usd=spent_usd,
                       budget_left_usd=budget_left_usd, noise=measurement_from(diagnostics),
                       ledger=ledger_rows(history))


def valid_number(x: float | None) -> TypeGuard[float]:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def clip_count(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


class Scaler:
    name = "base"

    def __init__(self, cfg: ScalerConfig, seed: int = 0):
        self.cfg = cfg
        self.seed = int(seed)
        self.last: dict[str, Any] = {}

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        raise NotImplementedError

    def step_gain(self, n_actors: int) -> float:
        """The factor on the learning rate of an update over ``n_actors`` actors' batches: 1, unless
        the scaler offers one (goodput's ``scale_step``)."""
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"scaler state is for {state.get('name')!r}, this scaler is {self.name!r}")

    def tags(self) -> dict[str, str]:
        """What the run's tags should say about this scaler (MinionsRL: its pre-training)."""
        return {}

    def round_metrics(self, round_idx: int) -> dict[str, float]:
        """Round ``round_idx``'s decision as per-round metrics for MLflow (none by default)."""
        return {}

    def round_tags(self, round_idx: int) -> dict[str, str]:
        """Round ``round_idx``'s decision as MLflow tags, one line each (none by default)."""
        return {}

    def _record(self, round_idx: int, actors: int, **info: Any) -> int:
        self.last = {"round": round_idx, "actors": actors, **info}
        return actors
