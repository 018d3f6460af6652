"""A round's invocations: which actors run, with which seeds, and which rounds evaluate.

Seeds depend on (seed, round, slot) only, so a run is reproducible however its invocations are
scheduled. Evaluation seeds do not depend on the round: every evaluation starts its episodes from
the same states, so rounds compare like for like.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nitro.actors.events import ActorEvent, invocation_id
from nitro.config import NitroConfig
from nitro.envs import EnvSpec
from nitro.tracking.metrics import EVAL_MODES

FALLBACK_EPISODE_STEPS = 27_000  # an env without a time limit: Atari's 108k frames at frameskip 4


def is_eval_round(config: NitroConfig, k: int, final_evaluation: bool = False) -> bool:
    """Evaluate every ``eval.every_rounds`` rounds from round 0, and in the last round (the round
    limit's, or a budget run's ``final_evaluation``)."""
    every = config.eval.every_rounds
    return every > 0 and (k % every == 0 or k == config.rounds - 1 or final_evaluation)


def evaluation_invocations(config: NitroConfig) -> int:
    """The invocations of one evaluation: each evaluation episode, in both modes (0: evaluation off)."""
    return len(EVAL_MODES) * config.eval.episodes if config.eval.every_rounds > 0 else 0


def eval_invocations(config: NitroConfig, k: int, final_evaluation: bool = False) -> int:
    """The evaluation invocations of round k (``is_eval_round``)."""
    return evaluation_invocations(config) if is_eval_round(config, k, final_evaluation) else 0


def plan_invocations(config: NitroConfig, spec: EnvSpec, *, run_id: str, k: int, n_actors: int,
                     final_evaluation: bool, weights_key: str, open_episodes: Sequence[str],
                     cache_url: str, cache_credentials: dict[str, str]) -> list[ActorEvent]:
    """``n_actors`` training invocations, then, on an evaluation round, the evaluation episodes.
    Training actor i continues the episode that the previous round's i-th surviving actor left
    unfinished (``open_episodes``); the others start fresh ones. A round without training actors
    evaluates only when it is a budget run's ``final_evaluation``."""
    common = {"run_id": run_id, "round": k, "weights_key": weights_key, "env_id": config.env_id,
              "cache_url": cache_url, "cache_credentials": cache_credentials, "batch_ttl_s": config.redis.ttl_s}
    events = [
        ActorEvent(invocation_id=invocation_id(run_id, k, i), seed=actor_seed(config.seed, k, i),
                   n_steps=config.steps_per_actor, n_envs=config.envs_per_actor,
                   episode_key=open_episodes[i] if i < len(open_episodes) else None, **common)
        for i in range(n_actors)
    ]
    if (n_actors or final_evaluation) and is_eval_round(config, k, final_evaluation):
        max_steps = config.eval.max_steps or spec.max_episode_steps or FALLBACK_EPISODE_STEPS
        for m, mode in enumerate(EVAL_MODES):
            events += [ActorEvent(invocation_id=invocation_id(run_id, k, i, mode), mode=mode,
                                  seed=actor_seed(config.seed, 2**20 + m, i), n_steps=max_steps, **common)
                       for i in range(config.eval.episodes)]
    return events


def actor_seed(*entropy: int) -> int:
    """A 63-bit seed from ``entropy`` (numpy's SeedSequence: independent streams per tuple)."""
    return int(np.random.SeedSequence(list(entropy)).generate_state(1, dtype=np.uint64)[0] >> 1)
