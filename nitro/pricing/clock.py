"""The clock the learner is billed by: the round as measured here, or as it would have run on Lambda.

The learner instance is billed by wall time (``nitro.pricing.cost``). With local actors that wall time
says more about this machine than about the setting Nitro is for: on 2 cores, 64 actors run two
at a time, so a boosted round takes 32x the acting time that Lambda, where they run at once,
would take. ``clock.kind: lambda`` bills the learner (and sizes the budget cap's reservation) for
the round it would have had if the round's invocations had run at once on Lambda:

    projected_s = (round_s - actor_s)               the learner-side steps, as measured
                + n x dispatch_s_per_invocation     the client puts n requests on the wire
                + invoke_s                          one request's trip and Lambda's invoke overhead
                + max(actor durations)              the slowest invocation's own duration
                + cold_start_s  (if cold)           new function instances start first

With Stellaris's learner functions (``learning_s``: their part of the round, the gradient schedule
replayed with the measured durations, counted from the actors' start) the acting term is the later
of the actors' last answer and the last gradient's application: the two overlap.

A round is *cold* when it invokes more functions than any earlier round of the run: Lambda keeps
an idle instance for minutes, and rounds are seconds apart, so earlier peaks stay warm and only
the instances beyond them start cold (all at once, so the allowance is paid once per round). The
first round is always cold. Instances reclaimed during a long pause (a resumed run) are not
modelled. Both figures are logged every round (``round_s`` and ``round_lambda_s``) whichever
clock bills; the run is tagged with the clock it was billed by.

The allowances' defaults and where they come from are in ``nitro.config.ClockConfig``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nitro.config import ClockConfig


def lambda_round_s(round_s: float, actor_s: float, actor_durations_s: Sequence[float], cold: bool,
                   dispatch_s_per_invocation: float, invoke_s: float, cold_start_s: float,
                   learning_s: float = 0.0) -> float:
    """Round seconds had its invocations run at once on Lambda (see the module docstring)."""
    learner_side = max(0.0, round_s - actor_s)
    n = len(actor_durations_s)
    if not n:
        return learner_side + learning_s
    acting = n * dispatch_s_per_invocation + invoke_s + max(actor_durations_s) + (cold_start_s if cold else 0.0)
    return learner_side + max(acting, learning_s)


@dataclass
class RoundClock:
    """Which clock bills the learner (``config``), and the warm-instance count the Lambda
    projection keeps."""

    config: ClockConfig
    warm_instances: int = 0  # the most invocations any earlier round made (or the provisioned ones)

    @property
    def projected(self) -> bool:
        return self.config.kind == "lambda"

    def round(self, round_s: float, actor_s: float, actor_durations_s: Sequence[float],
              learning_s: float = 0.0) -> tuple[float, float]:
        """(the seconds billed to the learner, the Lambda-projected seconds) of one round; updates
        the warm instances. ``learning_s``: the learner functions' part (module docstring)."""
        c, n = self.config, len(actor_durations_s)
        cold = n > self.warm_instances
        projected = lambda_round_s(round_s, actor_s, actor_durations_s, cold, c.dispatch_s_per_invocation,
                                   c.invoke_s, c.cold_start_s, learning_s)
        self.warm_instances = max(self.warm_instances, n)
        return (projected if self.projected else round_s), projected

    def round_extras(self) -> dict[str, float]:
        """Further per-round figures of this clock, for the metrics (none on Lambda)."""
        return {}

    def capacity(self, invocations: int, actors: int = 0) -> int | None:
        return None  # the backend's own parallelism, or all at once on the projected clock (nitro.run.engine)

    def startup_s(self, invocations: int, actors: int = 0) -> float:
        """What the budget cap adds to a round's acting time on this clock (worst case: cold)."""
        if not self.projected:
            return 0.0
        c = self.config
        return invocations * c.dispatch_s_per_invocation + c.invoke_s + c.cold_start_s

