"""PPO's on-policy learner: it trains on each round's fresh batches, epochs of minibatches of
``nitro.learners.ppo_loss``'s loss, and adapts the KL coefficient to the KL of the whole update.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nitro.config import PPOConfig
from nitro.envs import EnvSpec
from nitro.learners.arrays import ArrayLike
from nitro.learners.base import ActorCriticLearner, with_diagnostics
from nitro.learners.compiled import CompiledOrEager
from nitro.learners.contract import Batch, Progress, UpdateResult
from nitro.learners.fragments import fragment_norms, fragment_rows
from nitro.learners.gradients import Gradients
from nitro.learners.ppo_loss import PPOBatch, ppo_gradients, ppo_minibatch_loss, ppo_objective, prepare_batches
from nitro.learners.sgd import annealed_lr, minibatch_count
from nitro.learners.statistics import action_std, explained_variance


class PPOLearner(ActorCriticLearner[PPOBatch]):
    """The PPO learner (a ``nitro.learners.Learner``): policy, critic, one Adam over both,
    adaptive KL, reward scale (``base.ActorCriticLearner``), trained on each round's fresh batches
    and, when ``cfg.anneal_lr``, at the learning rate ``sgd.annealed_lr`` gives the round."""

    name = "ppo"
    cfg: PPOConfig

    def __init__(self, spec: EnvSpec, cfg: PPOConfig, seed: int, *, compile_loss: bool = False, **common: Any):
        """``ActorCriticLearner``'s arguments; ``compile_loss``: the minibatch loss through
        ``torch.compile`` (``compiled.CompiledOrEager``), else eager PyTorch."""
        super().__init__(spec, cfg, seed, **common)
        self.minibatch_loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = (
            CompiledOrEager(ppo_minibatch_loss) if compile_loss else ppo_minibatch_loss)

    def _minibatch_count(self, n: int) -> int:
        """``cfg.minibatches`` when set (constant Adam steps per update), else n / minibatch_size."""
        return minibatch_count(n, self.cfg.minibatch_size, self.cfg.minibatches)

    def prepare(self, batches: Sequence[Batch]) -> PPOBatch:
        """``prepare_batches`` with this learner's networks, gamma, lambda and reward scale."""
        return prepare_batches(batches, self.policy, self.critic, self.cfg.gamma, self.cfg.gae_lambda,
                               self.reward_scale)

    def _coefs(self) -> dict[str, float]:
        """``ppo_policy_loss``'s coefficients, with the KL coefficient now in force."""
        return {"clip": self.cfg.clip, "kl_coef": self.kl_coef, "entropy_coef": self.cfg.entropy_coef}

    def schedule(self, progress: Progress | None) -> None:
        """The round's learning rate when ``progress`` says which round it is: ``cfg.lr``, annealed
        (``sgd.annealed_lr``) when ``cfg.anneal_lr``, times the round's ``lr_gain``."""
        if progress is not None:
            lr = annealed_lr(self.cfg.lr, progress.round, progress.rounds) if self.cfg.anneal_lr else self.cfg.lr
            self.set_learning_rate(lr * progress.lr_gain)

    def compute_gradients(self, data: PPOBatch, rows: torch.Tensor) -> Gradients:
        """``ppo_gradients`` on ``rows`` of ``data`` at this learner's networks and coefficients,
        through its minibatch loss (compiled or not, as the learner was made)."""
        cfg = self.cfg
        return ppo_gradients(self.policy, self.critic, data, rows, clip=cfg.clip, kl_coef=self.kl_coef,
                             vf_clip=cfg.vf_clip, vf_coef=cfg.vf_coef, entropy_coef=cfg.entropy_coef,
                             loss=self.minibatch_loss)

    def update(self, batches: Sequence[Batch], *, progress: Progress | None = None,
               deadline: float | None = None) -> UpdateResult:
        """One PPO update on a round's batches.

        (0) the round's learning rate (``schedule``); (1) fold the round's raw observations into
        policy.obs_norm and its discounted returns into the reward statistics, then prepare the
        batch with them, frozen for the update; (2) with ``fragment_noise`` (goodput), the
        gradients of the round's actor fragments at the pre-update parameters
        (``fragments.fragment_norms``); (3) ``_optimise``: the gradient noise scale (kungfu only),
        epochs x minibatches, each ``compute_gradients`` then ``apply_gradients`` (Adam,
        per-minibatch advantage normalisation, gradient clipping), none started after
        ``deadline``, then the exact KL of the final policy against the pre-update one on the
        whole batch -> adaptive KL coefficient.
        Merging before preparing means the actors acted under slightly older statistics than the
        update sees (``logp_drift`` reports by how much; clipping bounds it); it is the order
        that learns best on Hopper-v5 (docs/decisions.md has the measurement).
        """
        self.schedule(progress)
        start = time.perf_counter()
        self.policy.train()
        self.critic.train()
        self.merge_statistics(batches)
        data = self.prepare(batches)
        noise = fragment_norms(lambda rows: self.compute_gradients(data, rows), fragment_rows(
            [len(b["rewards"]) for b in batches], device=self.device)) if self.fragment_noise else {}
        result = self._optimise(data, lambda idx: ppo_objective(self.policy, data, idx, **self._coefs())(),
                                lambda idx: self.compute_gradients(data, idx), epochs=self.cfg.epochs,
                                deadline=deadline)
        return with_diagnostics(result, {
            "explained_variance": explained_variance(data.values, data.returns),
            "logp_drift": float((data.logp - data.anchor.distribution().log_prob(data.actions)).abs().mean()),
            "reward_scale": self.reward_scale,
            "n_samples": float(len(data.rewards)),
            **action_std(self.policy),
            "seconds": time.perf_counter() - start,
            **noise,
        })

    def objective(self, indices: ArrayLike) -> Callable[[], torch.Tensor]:
        """``ppo_objective`` on ``indices`` of the last update's batch, a differentiable function
        of ``policy_parameters()``. Advantages are normalised over the subset; kl_coef is the one
        in force when the closure is made; features are computed once, with the normaliser as it
        is now (after the update's statistics merge)."""
        return ppo_objective(self.policy, self._require_batch(), indices, **self._coefs())

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta): flat named tensors and JSON-able scalars, ready for
        ``dumps_tensors(tensors, meta)``. Tensors: ``policy.*``, ``critic.*``, ``optim.{i}.{key}``
        (Adam's per-parameter state). Meta: kl_coef, reward statistics, update count, Adam's
        param groups, and the spec/seed for a sanity check on load (the seed, with n_updates,
        fixes the minibatch order of the next update)."""
        tensors, param_groups = self._common_tensors()
        meta = {**self._common_meta("nitro.ppo_learner/1"), "optim_param_groups": param_groups}
        return tensors, json.loads(json.dumps(meta))  # proves it is JSON-able

    def load_state_dict(self, tensors: Mapping[str, ArrayLike], meta: Mapping[str, Any]) -> None:
        """Inverse of ``state_dict``. ``meta`` values may be JSON strings (as ``loads_tensors``
        returns them) or plain values; tensors may be numpy arrays."""
        self._load_common(tensors, meta)
