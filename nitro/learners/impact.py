"""IMPACT's learner: it trains on each round's new batches plus replayed ones against a clipped
target network, and replays on its own while no new batch has landed.

pi_target is a frozen copy of the whole policy module (normaliser statistics included, so it is the
same function of the raw observation that an actor holding those weights computes), refreshed from
the current policy at the start of every ``target_update_freq``-th update (``update`` and
``replay_update`` both count). With the paper's value 1 the target is the pre-update policy, so for
a fresh batch pi_target = mu and the update is PPO-like; for replayed batches the truncated
importance weights correct for the staleness. V-trace's values come from the current critic,
recomputed on everything an update trains on (with the reward scale in force then). The loss is in
``impact_loss.py``; every setting is an ``ImpactConfig`` field (``nitro/config/algorithms.py``).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from nitro.config import ImpactConfig
from nitro.envs import EnvSpec
from nitro.learners.arrays import ArrayLike
from nitro.learners.base import ActorCriticLearner, with_diagnostics
from nitro.learners.contract import Batch, Progress, UpdateResult
from nitro.learners.impact_loss import (
    ImpactBatch,
    impact_loss,
    impact_minibatch,
    impact_objective,
    prepare_impact_batches,
)
from nitro.learners.replay import ReplayBuffer, replay_batches, replay_tensors
from nitro.learners.statistics import action_std, explained_variance
from nitro.models.networks import Policy, evaluate
from nitro.validation import check_batch


class ImpactLearner(ActorCriticLearner[ImpactBatch]):
    """The IMPACT learner (a ``nitro.learners.OffPolicyLearner``): policy, critic, one Adam,
    adaptive KL coefficient and reward scale (``base.ActorCriticLearner``), plus the frozen target
    policy and the replay buffer."""

    name = "impact"
    cfg: ImpactConfig

    def __init__(self, spec: EnvSpec, cfg: ImpactConfig, seed: int, device: str | torch.device = "cpu", **kwargs: Any):
        super().__init__(spec, cfg, seed, device, **kwargs)
        self.target: Policy = copy.deepcopy(self.policy)
        self.target.requires_grad_(False)
        self.replay = ReplayBuffer(cfg.replay_capacity, cfg.replay_max_reuse, check=self._check_batch)
        self.n_target_updates = 0  # (n_updates counts update() and replay_update() calls that trained)
        self.last_n_new_batches = 0
        self.replay_dropped_on_load = 0
        self._target_refreshed = False

    def _check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        check_batch(batch, self.spec)

    def prepare(self, batches: Sequence[Batch]) -> ImpactBatch:
        """``prepare_impact_batches`` with this learner's networks (current target) and settings."""
        cfg = self.cfg
        return prepare_impact_batches(batches, self.policy, self.target, self.critic, cfg.gamma, self.reward_scale,
                                      cfg.rho_bar, cfg.c_bar, cfg.vtrace_lambda)

    def _coefs(self) -> dict[str, float]:
        """``impact_policy_loss``'s coefficients, with the KL coefficient now in force."""
        cfg = self.cfg
        return {"clip": cfg.clip, "rho_bar": cfg.rho_bar, "kl_coef": self.kl_coef, "entropy_coef": cfg.entropy_coef}

    def update(self, batches: Sequence[Batch], *, progress: Progress | None = None,
               deadline: float | None = None) -> UpdateResult:
        """Train on new batches plus replayed ones, no minibatch step started after ``deadline``.

        Refresh the target if due; take up to ceil(replay_ratio * len(batches)) replayed batches
        from the buffer (a new batch is never replayed in its own update); add the new batches
        with their first use counted; train; then merge the NEW batches' raw observations and
        discounted returns into the statistics. IMPACT follows no schedule: ``progress`` is
        accepted for the contract and not read."""
        start = time.perf_counter()
        new = [b for b in batches if len(b["rewards"]) and self.replay.admits(b)]
        if not new:
            raise ValueError("ImpactLearner.update needs at least one non-empty, valid batch")
        self._maybe_refresh_target()
        n_replay = math.ceil(float(self.cfg.replay_ratio) * len(new))
        replayed = self.replay.take(n_replay)  # before adding: a new batch is never replayed in its own update
        for b in new:
            self.replay.add(b, uses=1)
        result = self._train(new, replayed, deadline)
        # Unlike PPO (whose clipping tolerates stale ratios), statistics are merged after training,
        # so that V-trace's weights compare the target policy with exactly the behaviour policy.
        self.merge_statistics(new)
        self.last_n_new_batches = len(new)
        return with_diagnostics(result, {"seconds": time.perf_counter() - start, **action_std(self.policy)})

    def replay_update(self, *, deadline: float | None = None) -> UpdateResult | None:
        """One update purely from the buffer (as many batches as the last ``update`` had new
        ones), while no new batch has landed (paper §4); None when no stored batch has a use left.
        The normaliser and reward statistics are not touched (nothing new was seen)."""
        start = time.perf_counter()
        if not len(self.replay):
            return None
        n = max(1, self.last_n_new_batches)
        self._maybe_refresh_target()
        replayed = self.replay.take(n)
        if not replayed:
            return None
        result = self._train([], replayed, deadline)
        return with_diagnostics(result, {"seconds": time.perf_counter() - start, **action_std(self.policy)})

    def _maybe_refresh_target(self) -> None:
        if self.n_updates % self.cfg.target_update_freq == 0:
            self.target.load_state_dict(self.policy.state_dict())
            self.n_target_updates += 1
            self._target_refreshed = True
        else:
            self._target_refreshed = False

    def _train(self, new: list[Batch], replayed: list[Batch], deadline: float | None) -> UpdateResult:
        cfg = self.cfg
        self.policy.train()
        self.critic.train()
        data = self.prepare(new + replayed)
        n_new = int(sum(len(b["rewards"]) for b in new))  # the new batches' rows come first
        n = len(data.rewards)

        def total_loss(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            mb = impact_minibatch(data, idx)
            dist, values = evaluate(self.policy, self.critic, self.policy.features(mb.obs))
            return impact_loss(dist, values, mb, vf_coef=cfg.vf_coef, **self._coefs())

        result = self._optimise(data, lambda idx: impact_objective(self.policy, data, idx, **self._coefs())(),
                                lambda idx: self.loss_gradients(total_loss, idx), epochs=cfg.epochs,
                                deadline=deadline)
        drift = (data.logp - data.target_logp).abs()
        return with_diagnostics(result, {
            "explained_variance": explained_variance(data.values, data.vs),
            "logp_drift": float(drift[:n_new].mean()) if n_new else float("nan"),  # mu vs target on new data
            "logp_drift_replay": float(drift[n_new:].mean()) if n > n_new else float("nan"),
            "is_weight_mean": float(data.rho.mean()),
            "is_truncated_frac": float((data.target_logp - data.logp > math.log(cfg.rho_bar)).float().mean()),
            "reward_scale": self.reward_scale,
            "n_samples": float(n),
            "n_new_samples": float(n_new),
            "n_replay_samples": float(n - n_new),
            "n_new_batches": float(len(new)),
            "n_replay_batches": float(len(replayed)),
            "replay_buffer_batches": float(len(self.replay)),
            "replay_remaining_uses": float(self.replay.remaining_uses),
            "target_refreshed": float(self._target_refreshed),
        })

    def objective(self, indices: ArrayLike) -> Callable[[], torch.Tensor]:
        """``impact_objective`` on ``indices`` of the last update's batch (new + replayed), a
        differentiable function of ``policy_parameters()``. Advantages are normalised over the
        subset; kl_coef is the one in force when the closure is made; features are computed
        once, with the normaliser as it is now."""
        return impact_objective(self.policy, self._require_batch(), indices, **self._coefs())

    def _modules(self) -> dict[str, nn.Module]:
        return {"policy": self.policy, "target": self.target, "critic": self.critic}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta) for ``dumps_tensors``. Tensors: ``policy.*``, ``target.*``, ``critic.*``,
        ``optim.{i}.{key}``, and ``replay.{seq}.{key}`` for the buffer's batches when they total at
        most ``replay_checkpoint_max_bytes`` (``replay.replay_tensors``). Meta: the common meta,
        the target and replay counters, and the buffer's bookkeeping."""
        tensors, param_groups = self._common_tensors()
        stored, keep, nbytes = replay_tensors(self.replay, self.cfg.replay_checkpoint_max_bytes)
        tensors.update(stored)
        meta = {
            **self._common_meta("nitro.impact_learner/1"),
            "n_target_updates": self.n_target_updates,
            "last_n_new_batches": self.last_n_new_batches,
            "optim_param_groups": param_groups,
            "replay": self.replay.bookkeeping(),
            "replay_batches_included": keep,
            "replay_bytes": nbytes,
        }
        return tensors, json.loads(json.dumps(meta))

    def load_state_dict(self, tensors: Mapping[str, ArrayLike], meta: Mapping[str, Any]) -> None:
        """Inverse of ``state_dict``; ``meta`` values may be JSON strings, tensors numpy arrays.
        Replayed batches that did not fit the checkpoint are lost (``replay_dropped_on_load``
        counts their uses)."""
        t, meta = self._load_common(tensors, meta, fmt="nitro.impact_learner/1")
        self.n_target_updates = int(meta["n_target_updates"])
        self.last_n_new_batches = int(meta["last_n_new_batches"])
        self.replay = ReplayBuffer(self.cfg.replay_capacity, self.cfg.replay_max_reuse, check=self._check_batch)
        self.replay_dropped_on_load = self.replay.restore(meta["replay"], replay_batches(t))
