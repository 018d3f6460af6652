"""Prefect tasks: thin wrappers over the core library, one concern per module.

A task takes the run id (to find the run's live resources with ``nitro.run.runtime.get_run``: its
Redis cache, actor backend, learner and tracker) and the typed values that earlier steps of the
round returned, and returns a typed value for the next step. The flow passes those values along,
so Prefect draws the round's data flow as edges between task runs. ``NO_CACHE``: rounds resume
from Nitro's own checkpoints, and hashing inputs on every call is pure overhead (docs/decisions.md, Prefect).
"""
