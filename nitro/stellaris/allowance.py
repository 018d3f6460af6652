"""What a round's learner functions may be billed under a budget, and the lanes' check before each
invocation.

At each scaling decision the budget cap (``nitro.scaling.budget.cap_by_budget``) reserves an upper
bound of what the round can cost. Any invocation may be billed to its timeout, but a gradient job
takes a small share of it (about 40 ms against a 5 s timeout on the boost bench), so a bound of
jobs x timeout holds a budgeted Stellaris run far under the actors it asks for (about 67x a mean
round at 8 actors, docs/results/stellaris-priced-alike/PREREGISTRATION.md). Instead the round's
functions get an allowance, which the lanes enforce: an invocation starts only if its timeout fits
in what is left once the invocations in flight are counted at their timeouts and the finished ones
at their bills. Whatever the functions do, their bill stays within the allowance, and the allowance
is what the cap reserves.

The allowance for ``jobs`` jobs on ``lanes`` lanes: ``lanes x timeout`` (each lane may always have
one invocation in flight) plus twice the most per job that the functions of any of the last
``WINDOW`` rounds were billed, never more than ``jobs x timeout``, which it is until a round has
been observed. A job whose invocation does not fit is lost with its reason, as a failed one is.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

WINDOW = 10  # rounds whose billing per job the allowance reads: recent, so a cold start ages out
MARGIN = 2.0  # times the billing per job observed: as the learner's allowance for its update


class FunctionAllowance:
    """The learner functions' allowance across rounds: ``limit_ms`` sizes a round's for the cap,
    ``allow`` opens a round under one (None: no budget, no limit), ``take`` and ``settle`` bracket
    each invocation, ``answered`` and ``close`` end the round. Thread-safe: the lanes are tasks in
    the parameter server's process."""

    def __init__(self, timeout_ms: int, jobs_per_actor: int, lanes_for: Callable[[int], int]):
        self.timeout_ms, self.jobs_per_actor, self.lanes_for = timeout_ms, jobs_per_actor, lanes_for
        self.per_job_ms: deque[float] = deque(maxlen=WINDOW)  # each observed round's billing per job
        self._lock = threading.Lock()
        self._limit_ms: int | None = None
        self._committed_ms = 0  # finished invocations at their bills, those in flight at their timeouts
        self._billed_ms = 0  # the open round's finished invocations, as the ledger bills them
        self._jobs_ran = 0
        self._refused = 0

    def limit_ms(self, n_actors: int) -> int:
        """The allowance of a round of ``n_actors`` training actors, in billed milliseconds."""
        if n_actors <= 0:
            return 0
        jobs = n_actors * self.jobs_per_actor
        worst = jobs * self.timeout_ms
        if not self.per_job_ms:
            return worst
        expected = math.ceil(MARGIN * max(self.per_job_ms) * jobs)
        return min(worst, self.lanes_for(n_actors) * self.timeout_ms + expected)

    def allow(self, limit_ms: int | None) -> None:
        """Open a round under ``limit_ms`` (None: no limit)."""
        with self._lock:
            self._limit_ms, self._committed_ms, self._billed_ms, self._jobs_ran, self._refused = limit_ms, 0, 0, 0, 0

    def close(self) -> None:
        """The round's invocations have all ended: its billing per job joins the window."""
        with self._lock:
            if self._jobs_ran:
                self.per_job_ms.append(self._billed_ms / self._jobs_ran)
            self._billed_ms, self._jobs_ran = 0, 0

    def take(self) -> bool:
        """Whether one more invocation may start; if so it is counted at its timeout until settled."""
        with self._lock:
            if self._limit_ms is not None and self._committed_ms + self.timeout_ms > self._limit_ms:
                self._refused += 1
                return False
            self._committed_ms += self.timeout_ms
            return True

    def settle(self, billed_ms: int) -> None:
        """A taken invocation ended, billed ``billed_ms`` (the ledger caps it at the timeout)."""
        billed = min(max(0, int(billed_ms)), self.timeout_ms)
        with self._lock:
            self._committed_ms += billed - self.timeout_ms
            self._billed_ms += billed

    def answered(self, jobs: int) -> None:
        """The open round's jobs that the parameter server got an answer for: the billing per job
        is read over them, so a billed invocation that answered nothing only raises it."""
        with self._lock:
            self._jobs_ran += max(0, int(jobs))

    def refusal(self) -> str:
        return (f"gradient job not started: the round's learner functions would pass their budgeted "
                f"allowance of {self._limit_ms} ms")

    def metrics(self) -> dict[str, float]:
        """The open round's allowance (where a budget set one) and the invocations it refused."""
        with self._lock:
            limit = {"stellaris_functions_allowance_ms": float(self._limit_ms)} if self._limit_ms is not None else {}
            return limit | {"stellaris_functions_refused": float(self._refused)}

    def state_dict(self) -> dict[str, Any]:
        return {"per_job_ms": list(self.per_job_ms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.per_job_ms = deque((float(x) for x in state.get("per_job_ms", [])), maxlen=WINDOW)
