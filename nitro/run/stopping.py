"""When a run stops: the round limit, the target return, or a budget that pays no more actors."""

from __future__ import annotations

import math
from collections.abc import Mapping

from nitro.config import NitroConfig

STOP_ROUNDS = "round_limit"
STOP_TARGET = "target_reward"
STOP_BUDGET = "budget_spent"


def stop_reason(config: NitroConfig, metrics: Mapping[str, float], next_round: int, n_actors: int) -> str | None:
    """Why the run stops after a round with these metrics (None: it goes on). The target is
    judged on the evaluation return, or on the training return when evaluation is off; a budget
    stop is a round the budget could not pay any actor for."""
    key = "eval_return_mean" if config.eval.every_rounds > 0 else "train_return_mean"
    ret = metrics.get(key, math.nan)
    if config.target_reward is not None and ret is not None and not math.isnan(ret) and ret >= config.target_reward:
        return STOP_TARGET
    if config.budget_usd is not None and n_actors == 0:
        return STOP_BUDGET
    if next_round >= config.rounds:
        return STOP_ROUNDS
    return None

