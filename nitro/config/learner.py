"""How the policy update runs: the ``learner`` section of the config.

``sync`` is one learner process that trains on a round's batches (PPO, or IMPACT beside its actors).
``stellaris`` makes the learner serverless too: short-lived learner functions compute PPO gradients
on slices of the round's batches as the batches land, and the learner process becomes a parameter
server that applies each group of them in one step, weighted by samples and staleness, under a
staleness bound that decays over training, with the importance ratio truncated across the live
policy versions (``nitro.stellaris``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from nitro.config.backend import Section


class LatencyConfig(Section):
    """The seeded latencies of learner functions from which a round's gradient schedule is drawn
    (``learner.schedule: seeded``): which snapshot each function computes against and the order its
    gradient lands in. Real functions run the schedule, so a run repeats exactly whatever the
    machine's timing."""

    cold_s: float = Field(0.25, ge=0, description="a function instance's first job: start-up included")
    warm_s: float = Field(0.02, ge=0, description="a warm instance's fixed cost per job (fetch, load)")
    per_sample_s: float = Field(2e-5, ge=0, description="gradient compute per sample")
    jitter: float = Field(0.2, ge=0, description="sigma of the lognormal factor on each latency (mean 1)")
    actor_s: float = Field(1.0, ge=0, description="when a batch lands, after the round's start (the schedule's "
                           "view of the actors; jittered like the rest)")
    apply_s: float = Field(0.01, ge=0, description="the parameter server's time for one application (a step and a "
                           "published version): landings while it is busy join one group")


class LearnerConfig(Section):
    """``mode``: sync or stellaris. The remaining fields are Stellaris's; defaults say which of the
    official code's choices is taken and why (docs/stellaris.md)."""

    mode: Literal["sync", "stellaris"] = "sync"
    functions_per_actor: float = Field(0.5, gt=0, le=64, description="learner functions at once per training "
                                       "actor of the round, so a boosted round fans out to more of them "
                                       "(the official code: 4 learners for 16 actors = 0.25)")
    slice_samples: int = Field(256, ge=1, description="samples one learner function computes a gradient on")
    epochs: int | None = Field(None, ge=1, description="passes of gradient jobs over each batch; None: ppo.epochs")
    decay: float = Field(0.9, gt=0, le=1,
                         description="d in the staleness bound B_t = clip(int(S_max d^(t-1)) + 1, 1, S_max)")
    trigger_k: int | None = Field(None, ge=1, description="apply the pending gradients once this many wait, "
                                  "whatever their staleness; None: the round's number of learner functions")
    weighting: Literal["inverse_power", "none"] = Field(
        "inverse_power", description="a gradient's learning rate times s^(-1/kappa) for staleness s > 0 (the "
        "poster's staleness-aware aggregation); none: every gradient at the full rate (what the official code "
        "does: its weighting never takes effect)")
    kappa: float = Field(3.0, gt=0, description="the weighting's smoothing: s^(-1/kappa)")
    is_truncation: bool = Field(True, description="truncate each sample's ratio with the live versions' ratios: "
                                "min(rho, max(c, min_j rho_j))")
    is_ratio: float = Field(1.0, gt=0, description="c, the truncation's floor")
    gradient_timeout_s: float = Field(120.0, gt=0, description="how long the parameter server waits for one "
                                      "gradient, and a job for its batch and snapshot")
    lane_linger_s: float = Field(0.0, ge=0, description="seeded: how long a learner function that has finished "
                                 "a job waits for its lane's next one to be ready (its batch landed, its snapshot "
                                 "published) before it returns; the lane's next job then starts a new invocation. "
                                 "0: it runs the jobs that are ready and never waits. Waiting is billed: on the "
                                 "boost bench 0.05 s made rounds faster and the functions' bill 1.4-1.6x "
                                 "(docs/stellaris.md)")
    server_per_hour: float = Field(0.085, ge=0, description="the parameter server's instance (c5.large): it applies "
                                   "gradients and no longer computes them")
    schedule: Literal["seeded", "measured"] | None = Field(
        None, description="where each gradient's snapshot and staleness come from. seeded: a schedule drawn "
        "from the run's seed and learner.latency, which real functions then run, so a run repeats exactly; "
        "measured: real arrivals, a job computes against the version the parameter server has when it "
        "starts and its staleness is what it finds when it lands (the official code's behaviour). None: "
        "measured on Lambda and Ray, seeded on local workers")
    latency: LatencyConfig = Field(default_factory=LatencyConfig)

    @model_validator(mode="before")
    @classmethod
    def _without_apply(cls, data: Any) -> Any:
        """Configs saved before the parameter server took one step per group name how it applied
        (``apply``); the choice is gone, and such a run still resumes."""
        if isinstance(data, dict) and "apply" in data:
            data = {k: v for k, v in data.items() if k != "apply"}
        return data

    def schedule_on(self, backend_kind: str) -> Literal["seeded", "measured"]:
        """The schedule a run on ``backend_kind`` uses: the configured one, or by default the
        arrivals that real functions make, except on local workers, whose tests need a run to repeat."""
        if self.schedule is not None:
            return self.schedule
        return "seeded" if backend_kind == "local" else "measured"

    def functions_for(self, n_actors: int) -> int:
        """Learner functions at once for a round of ``n_actors`` training actors: a boosted round
        fans out to more of them."""
        return max(1, math.ceil(self.functions_per_actor * n_actors))
