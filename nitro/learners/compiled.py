"""A learner's minibatch loss compiled by ``torch.compile``, with eager PyTorch as the fallback.

On the 2x256 MLPs an eager SGD step of 64 samples spends most of its time outside the matrix
products: PyTorch's per-operation dispatch, autograd's bookkeeping, and elementwise kernels run one
by one (``torch.tanh`` alone costs a tenth of a step on these CPUs). Compiled, the loss's forward
and backward become two generated kernels around the matrix products (bench/update_step.py
measures both ways). Compiling costs seconds the first time a process meets a graph (inductor
caches its kernels on disk, so later processes pay much less), which only a long run earns back:
``when_to_compile`` says when a run compiles by default.

Compiling may fail where eager PyTorch works (inductor needs a C++ compiler on the CPU); the first
failure logs one warning and the learner goes on eagerly, computing the same loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, Literal, ParamSpec, TypeVar

import torch

log = logging.getLogger("nitro")

P = ParamSpec("P")
R = TypeVar("R")

# Below this many rounds ``learner_compile: auto`` stays eager. A first compile of Hopper's loss took
# 10.5 s on a 2-core host (1.6 s from inductor's cache) and saves about 0.14 s a round there
# (bench/results/update_step.json): some 75 rounds to earn back a compile from nothing.
AUTO_COMPILE_ROUNDS = 100


def when_to_compile(setting: bool | Literal["auto"], rounds: int, budgeted: bool = False) -> bool:
    """Whether a run of ``rounds`` rounds compiles its learner's loss: true and false say so;
    ``auto`` compiles a run of at least ``AUTO_COMPILE_ROUNDS`` rounds, long enough to earn back a
    first compile, unless it runs on a budget (``budgeted``): the budget's deadline stops an
    update between its steps, and the first compiled step is the compile, 10 s on a quiet 2-core
    host and about 90 s under a test suite's load, which passed a budget the cap had kept."""
    return rounds >= AUTO_COMPILE_ROUNDS and not budgeted if setting == "auto" else bool(setting)


class CompiledOrEager(Generic[P, R]):
    """``fn`` through ``torch.compile``; once compiling fails, ``fn`` itself from then on.

    An error of ``fn``'s own (bad input) is raised again by the eager call, so falling back hides
    nothing but the compiler's failure, which it logs."""

    def __init__(self, fn: Callable[P, R], backend: str | Callable[..., object] = "inductor"):
        self.eager = fn
        self.call: Callable[P, R] = torch.compile(fn, backend=backend)
        self.compiled = True

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.compiled:
            try:
                return self.call(*args, **kwargs)
            except Exception as exc:  # any compiler failure; fn's own errors recur in the eager call
                log.warning("torch.compile of %s failed (%s); the learner goes on with eager PyTorch",
                            getattr(self.eager, "__name__", "the loss"), root_cause(exc))
                self.call, self.compiled = self.eager, False
        return self.call(*args, **kwargs)


def root_cause(exc: BaseException) -> str:
    """The innermost cause of ``exc`` in one line ("Type: first line"): torch.compile wraps the
    compiler's own error (say, a missing C++ compiler) in its own exceptions."""
    while True:
        inner = exc.__cause__ or getattr(exc, "inner_exception", None)  # BackendCompilerFailed keeps it there
        if not isinstance(inner, BaseException):
            break
        exc = inner
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
