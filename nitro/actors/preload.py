"""The function every actor pool runs unless told another, and what a fresh process of a pool
(local or Ray) or a Lambda function's INIT imports before its first invocation."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nitro.config import NitroConfig

DEFAULT_ACTOR_FN = "nitro.run.functions:run_function"  # actors and learner functions


def warm_modules(actor_fn: str = DEFAULT_ACTOR_FN, *, image_env: bool = False,
                 learner_functions: bool = False) -> tuple[str, ...]:
    """What a fresh process of a pool (local or Ray) imports before its first invocation, so that
    the first is as warm as the rest; the one place that decides it. For ``DEFAULT_ACTOR_FN``: the
    rollout, PyTorch's networks for an image env's CNN, and the learner function's modules where
    it computes gradients (a Stellaris run: 0.5 s of imports that its first job paid, measured
    here). A vector env's actor never imports PyTorch, a second or more of every fresh process's
    start. Another function: nothing (its own module is imported to load it)."""
    if actor_fn != DEFAULT_ACTOR_FN:
        return ()
    return ("nitro.actors.rollout", *(("nitro.models.networks",) if image_env else ()),
            *(("nitro.stellaris.function", "nitro.stellaris.gradient") if learner_functions else ()))


def warm_modules_for(config: NitroConfig) -> tuple[str, ...]:
    """``warm_modules`` for a run of ``config``: what its pool preloads, and what a Lambda function
    deployed for it imports in INIT (deployments/deploy_lambda.py)."""
    return warm_modules(image_env=config.env_family == "image", learner_functions=config.learner.mode == "stellaris")
