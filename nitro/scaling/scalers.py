"""How many actors each round gets (paper §5.3 and §8.3; docs/decisions.md, "The round"), and the budget cap.

``make_scaler(cfg, seed)`` returns a scaler by name. Every scaler has
``decide(round_idx, signal) -> int`` plus ``state_dict()`` / ``load_state_dict()`` (JSON-able, for
checkpoints) and ``last`` (a dict describing the last decision, for MLflow).

**Round index k.** ``round_idx`` is the engine's 0-based round number: ``decide(k, ...)`` picks the
actor count of round k (the actors launched at the end of round k), using R measured in round k on
round k−1's batches. Round 0 has no R (nothing to update on yet). The decay is ``d**k`` with this
same k, so it does not depend on how many R values were valid, and a resumed run continues the
same schedule.

**NitroScaler** (the formula as written, unlike the official code which decayed twice and mixed
decayed with raw values in one window): the window holds the last ``n`` *raw* valid R values,
including R_k; ``S_k = (R_max − R_k)/(R_max − R_min) · d**k`` and
``I_k = clip(round(I_max · S_k), I_min, I_max)``, rounding to the nearest integer, halves up.
Degenerate choices, all giving **I_min** ("no evidence of a boosting opportunity", and the cheap
choice): R_k missing (None: the detector reported a degenerate status), NaN or infinite (then the
window is left unchanged: a bad value never enters it); a window whose max equals its min
(including a window of one value, e.g. round 1).

**Baselines** (paper §8.3):
* ``fixed``: ``cfg.fixed_actors`` every round (paper: 16), not clipped to [I_min, I_max].
* ``always``: I_max every round.
* ``hydrozoa``: ``clip(hydrozoa_start · 2**(k // hydrozoa_every), I_min, I_max)``: 8 for rounds
  0–9, 16 for 10–19, ... (with the defaults).
* ``kungfu``: KungFu scales workers with the gradient noise scale B_noise (the batch size beyond
  which more samples stop helping) and never scales down. Mapping: the round needs about
  B_noise samples, an actor brings ``steps_per_actor``, so the target is
  ``ceil(B_noise / steps_per_actor)`` clipped to [I_min, I_max]; the count is
  ``max(previous count, target)`` (start: I_min). A missing/NaN/non-positive B_noise keeps the
  previous count. B_noise is ``PPOLearner.update``'s ``grad_noise_scale`` (McCandlish's B_simple).
* ``vm-pause`` / ``vm-replay`` (paper §2.3, Fig. 3): Nitro's decisions, on actors billed as VMs
  (``backend.pricing: vm``): a decision that needs more instances than run waits for them to
  start, the learner idle (pause) or training on replayed batches (replay; ``nitro.pricing.vm``,
  ``nitro.run.vm_replay``). Only the fleet and the round differ; the decision is Nitro's.
* ``random``: "the same expected spend as Nitro, on random rounds": each round independently boosts
  to I_max with probability p, else I_min, so E[actors] = I_min + p·(I_max − I_min). With
  ``cfg.random_mean_actors`` set (the mean actors per round of the Nitro run to match, e.g. from
  its MLflow metrics) p = (mean − I_min)/(I_max − I_min), clipped to [0, 1]; otherwise
  p = ``cfg.random_boost_prob``. The draw for round k comes from a generator seeded with
  (seed, k), so it is reproducible and a resumed or retried round draws the same value.

The budget cap (``nitro.scaling.budget.cap_by_budget``) is applied after the scaler by the engine.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
import torch

from nitro.config import NitroConfig, ScalerConfig
from nitro.learners.sgd import minibatch_count
from nitro.scaling.base import (
    RoundSignal,
    Scaler,
    clip_count,
    round_half_up,
    round_signal as round_signal,  # the engine's and the tests' import, kept here
    valid_number,
)
from nitro.scaling.goodput import GoodputScaler
from nitro.scaling.minionsrl.policy import choose
from nitro.scaling.minionsrl.pretrain import load_scheduler
from nitro.scaling.minionsrl.state import SchedulerObservation, action_mask, actors_for_action, state_vector
from nitro.scaling.prices import price_prior


class NitroScaler(Scaler):
    name = "nitro"

    def __init__(self, cfg: ScalerConfig, seed: int = 0):
        super().__init__(cfg, seed)
        self.window: deque[float] = deque(maxlen=cfg.window)

    def score(self, round_idx: int, R: float) -> float | None:
        """S_k for a valid R_k already in the window; None when max == min."""
        r_max, r_min = max(self.window), min(self.window)
        if r_max == r_min:
            return None
        return (r_max - R) / (r_max - r_min) * self.cfg.decay**round_idx

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        cfg = self.cfg
        R = signal.R
        if not valid_number(R):
            return self._record(round_idx, cfg.i_min, score=None, reason="R missing or not finite", R=None)
        self.window.append(float(R))
        s = self.score(round_idx, float(R))
        if s is None:
            return self._record(round_idx, cfg.i_min, score=None, reason="window max == min", R=float(R))
        actors = clip_count(round_half_up(cfg.i_max * s), cfg.i_min, cfg.i_max)
        return self._record(
            round_idx, actors, score=s, reason="score", R=float(R),
            window_min=min(self.window), window_max=max(self.window),
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "window": list(self.window)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.window = deque((float(x) for x in state["window"]), maxlen=self.cfg.window)


class FixedScaler(Scaler):
    name = "fixed"

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        return self._record(round_idx, self.cfg.fixed_actors)


class AlwaysScaler(Scaler):
    name = "always"

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        return self._record(round_idx, self.cfg.i_max)


class HydrozoaScaler(Scaler):
    name = "hydrozoa"

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        cfg = self.cfg
        doublings = max(0, round_idx) // cfg.hydrozoa_every
        # cap the exponent before it grows: 2**k beyond i_max is i_max anyway
        n = cfg.hydrozoa_start * 2 ** min(doublings, 64)
        return self._record(round_idx, clip_count(n, cfg.i_min, cfg.i_max))


class KungFuScaler(Scaler):
    name = "kungfu"

    def __init__(self, cfg: ScalerConfig, seed: int = 0, steps_per_actor: int = 512):
        super().__init__(cfg, seed)
        if steps_per_actor < 1:
            raise ValueError("steps_per_actor must be >= 1")
        self.steps_per_actor = int(steps_per_actor)
        self.current = cfg.i_min

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        cfg = self.cfg
        b = signal.grad_noise_scale
        if not valid_number(b) or b <= 0:
            return self._record(round_idx, self.current, reason="noise scale missing", grad_noise_scale=None)
        target = clip_count(math.ceil(b / self.steps_per_actor), cfg.i_min, cfg.i_max)
        self.current = max(self.current, target)  # KungFu never scales down
        return self._record(round_idx, self.current, target=target, grad_noise_scale=float(b))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "current": self.current, "steps_per_actor": self.steps_per_actor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.current = int(state["current"])
        self.steps_per_actor = int(state.get("steps_per_actor", self.steps_per_actor))


def boost_prob_for_mean(mean_actors: float, i_min: int, i_max: int) -> float:
    """p such that I_min + p (I_max - I_min) = mean_actors, clipped to [0, 1]."""
    if i_max == i_min:
        return 0.0
    return float(min(1.0, max(0.0, (mean_actors - i_min) / (i_max - i_min))))


class RandomScaler(Scaler):
    name = "random"

    def __init__(self, cfg: ScalerConfig, seed: int = 0):
        super().__init__(cfg, seed)
        mean = getattr(cfg, "random_mean_actors", None)
        self.p = boost_prob_for_mean(mean, cfg.i_min, cfg.i_max) if mean is not None else float(cfg.random_boost_prob)

    def expected_actors(self) -> float:
        return self.cfg.i_min + self.p * (self.cfg.i_max - self.cfg.i_min)

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        u = float(np.random.default_rng([self.seed, max(0, int(round_idx))]).random())
        boost = u < self.p
        return self._record(round_idx, self.cfg.i_max if boost else self.cfg.i_min, boost=boost, p=self.p)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "p": self.p}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.p = float(state["p"])


class VmPauseScaler(NitroScaler):
    """Nitro's decisions with actors on VMs: a boost waits for its instances, the learner idle
    (``nitro.pricing.vm``)."""

    name = "vm-pause"


class VmReplayScaler(NitroScaler):
    """Nitro's decisions with actors on VMs: while a boost's instances start, the learner trains
    on replayed batches (``nitro.run.vm_replay``)."""

    name = "vm-replay"


class MinionsRLScaler(Scaler):
    """MinionsRL's pre-trained scheduler (``nitro.scaling.minionsrl``): the 8-feature state, N = a + 1
    from its policy (sampled as the code does, or greedy), within [I_min, I_max]."""

    name = "minionsrl"

    def __init__(self, cfg: ScalerConfig, seed: int = 0):
        super().__init__(cfg, seed)
        self.scheduler = load_scheduler(cfg.minionsrl.path or "")

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        cfg, sch = self.cfg, self.scheduler
        budget_left = (signal.budget_left_usd if signal.budget_left_usd is not None
                       else sch.budget_usd - signal.spent_usd)
        learner_s, actor_s = signal.learner_s or 0.0, signal.actor_s or 0.0
        obs = SchedulerObservation(float(round_idx), signal.loss or 0.0, signal.mean_return or 0.0, signal.kl or 0.0,
                                   learner_s, actor_s, learner_s + actor_s, float(budget_left))
        mask = action_mask(sch.net.n_actions, cfg.i_min, cfg.i_max, cfg.minionsrl.mask_out_of_range)
        draw = torch.Generator().manual_seed(int(np.random.default_rng([self.seed, max(0, round_idx)]).integers(2**62)))
        choice = choose(sch.net, sch.state(state_vector(obs)), mask, greedy=cfg.minionsrl.greedy, generator=draw)
        actors = actors_for_action(choice.action, cfg.i_min, cfg.i_max)
        return self._record(round_idx, actors, action=choice.action, greedy=cfg.minionsrl.greedy)

    def tags(self) -> dict[str, str]:
        """The pre-training record, for the run's tags and every report row that uses it."""
        r = self.scheduler.record
        return {"minionsrl.pretrain_usd": f"{r.usd:.10g}", "minionsrl.pretrain_episodes": str(r.episodes),
                "minionsrl.pretrain_env_steps": str(r.env_steps), "minionsrl.pretrain_on": r.simulator}


class ReplayScaler(Scaler):
    """Another run's actor counts (``cfg.replay_actors``) in a shuffled order: the control that
    separates how many actors a scaler chose from when it chose them. Round k plays the count at
    position k % L of a permutation of the L counts drawn from (seed, k // L): every L rounds play
    the same counts, each block in its own order, so a run longer than the recorded one goes on
    with the same mix. The counts are replayed as recorded, not clipped to [I_min, I_max]."""

    name = "replay"

    def __init__(self, cfg: ScalerConfig, seed: int = 0):
        super().__init__(cfg, seed)
        if not cfg.replay_actors:
            raise ValueError("scaler replay needs scaler.replay_actors (the counts to replay: an experiment fills "
                             "them from the cell it replays)")

    def decide(self, round_idx: int, signal: RoundSignal) -> int:
        counts = self.cfg.replay_actors
        block, position = divmod(max(0, int(round_idx)), len(counts))
        source = int(np.random.default_rng([self.seed, block]).permutation(len(counts))[position])
        return self._record(round_idx, int(counts[source]), replayed_round=source)


SCALERS: dict[str, type[Scaler]] = {
    cls.name: cls for cls in (NitroScaler, FixedScaler, AlwaysScaler, HydrozoaScaler, KungFuScaler, RandomScaler,
                              VmPauseScaler, VmReplayScaler, MinionsRLScaler, GoodputScaler, ReplayScaler)
}


def make_scaler(cfg: ScalerConfig, seed: int, *, steps_per_actor: int = 512, run: NitroConfig | None = None) -> Scaler:
    """The scaler named by ``cfg.name``. ``steps_per_actor`` (NitroConfig.steps_per_actor) is
    used by ``kungfu`` and ``goodput``; ``run`` (the run's whole config) by ``goodput``, whose
    prices are seeded from it (``nitro.scaling.prices.price_prior``; without it, from the defaults
    with this scaler section and ``steps_per_actor``)."""
    try:
        cls = SCALERS[cfg.name]
    except KeyError:
        raise ValueError(f"unknown scaler {cfg.name!r}; known: {', '.join(SCALERS)}") from None
    if cls is KungFuScaler:
        return KungFuScaler(cfg, seed, steps_per_actor=steps_per_actor)
    if cls is GoodputScaler:
        if run is None:
            run = NitroConfig.load({"scaler": cfg.model_dump(mode="json"), "steps_per_actor": steps_per_actor})
        ppo = run.ppo
        return GoodputScaler(cfg, seed, steps_per_actor=steps_per_actor, prior=price_prior(run),
                             minibatches=lambda n: minibatch_count(n, ppo.minibatch_size, ppo.minibatches))
    return cls(cfg, seed)
