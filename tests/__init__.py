"""Nitro's test suite (a package, so that ``tests.support`` imports from the repository root)."""
