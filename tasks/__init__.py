"""Prefect tasks: thin wrappers over the core library, one concern per module.

Every task takes small, JSON-able arguments (run ids, round numbers, keys) and finds the live
training run with ``nitro.runtime.get_run``. ``NO_CACHE``: rounds resume from Nitro's own
checkpoints, and hashing inputs on every call is pure overhead (NOTES.md).
"""
