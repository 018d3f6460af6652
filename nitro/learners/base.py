"""What a PPO and an IMPACT learner hold alike, and the optimisation loop both run.

Both hold a policy, a critic, one Adam over both, the adaptive KL coefficient, the reward-scale
statistics and the last update's prepared batch (what the boosting detector differentiates). An
update is: the gradient noise scale at the pre-update parameters, epochs x shuffled minibatches of
guarded, clipped steps until the deadline, then the whole-batch KL of the final policy against the
batch's anchor, which adapts the KL coefficient. A subclass prepares its batch, defines its losses
and its ``objective``, and writes its checkpoint format.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from nitro.config import ImpactConfig, PPOConfig
from nitro.envs import EnvSpec
from nitro.learners.arrays import ArrayLike
from nitro.learners.checkpoint import (
    as_tensors,
    decode_meta,
    load_module_tensors,
    load_optimizer,
    load_reward_stats,
    module_tensors,
    optimizer_tensors,
    reward_stats_meta,
)
from nitro.learners.contract import Batch, Progress, UpdateResult
from nitro.learners.distributions import DistParams, forward_dist_params
from nitro.learners.gradients import Gradients, clipped, gradients_of, parameter_names, weighted_mean
from nitro.learners.objective import adapt_kl_coef, whole_batch_kl
from nitro.learners.sgd import gradient_noise_scale, minibatch_count, minibatch_indices
from nitro.learners.statistics import RunningMeanStd, merge_round_statistics
from nitro.models import Architecture
from nitro.models.networks import Critic, Policy, build_critic, build_policy

log = logging.getLogger("nitro")

MinibatchLoss = Callable[[torch.Tensor], tuple[torch.Tensor, Mapping[str, torch.Tensor]]]


class PreparedBatch(Protocol):
    """What the shared loop reads of a subclass's prepared batch (one row per sample)."""

    @property
    def obs(self) -> torch.Tensor: ...

    @property
    def anchor(self) -> DistParams: ...  # the KL anchor's distribution parameters


BatchT = TypeVar("BatchT", bound=PreparedBatch)


def with_diagnostics(result: UpdateResult, extra: Mapping[str, float]) -> UpdateResult:
    """``result`` with ``extra`` added to its diagnostics (a key already there keeps its place)."""
    return dataclasses.replace(result, diagnostics={**result.diagnostics, **extra})


class ActorCriticLearner(Generic[BatchT]):
    """The part of ``PPOLearner`` and ``ImpactLearner`` that is not the algorithm (see the module
    docstring); ``BatchT``: the subclass's prepared batch."""

    name: str

    def __init__(self, spec: EnvSpec, cfg: PPOConfig | ImpactConfig, seed: int, device: str | torch.device = "cpu",
                 arch: Architecture = Architecture(), noise_scale: bool = False, fragment_noise: bool = False):
        self.spec, self.cfg, self.seed = spec, cfg, int(seed)
        self.device = torch.device(device)
        self.policy: Policy = build_policy(spec, seed, arch).to(self.device)
        self.critic: Critic = build_critic(spec, seed, arch).to(self.device)
        # The gradient noise scale costs one extra backward per minibatch; only the kungfu scaler reads it.
        self.noise_scale = noise_scale
        self.fragment_noise = fragment_noise  # the round's fragment gradients (learners/fragments.py): goodput's
        # eps as CleanRL/SB3; fused: one kernel for the whole step (a third faster on a 64x64 MLP)
        self.optimizer = torch.optim.Adam(
            [*self.policy_parameters(), *self.critic.parameters()], lr=cfg.lr, eps=1e-5, fused=True
        )
        self._named = parameter_names(self.policy, self.critic)  # fixed for the learner's life: named once
        self.kl_coef: float = float(cfg.kl_coef)
        self.reward_stats = RunningMeanStd()
        self.n_updates = 0
        # The last update's prepared batch: what ``objective`` differentiates; None before the first update.
        self.trained_batch: BatchT | None = None

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate from the next optimiser step on; Adam's moments are kept."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)

    def schedule(self, progress: Progress | None) -> None:
        """Set what follows the run's progress (None: outside a run, nothing moves); no schedule here."""

    def prepare(self, batches: Sequence[Batch]) -> BatchT:
        """The batches as training tensors (each algorithm its own)."""
        raise NotImplementedError

    # -- what other modules read ----------------------------------------------------------------

    def policy_parameters(self) -> list[nn.Parameter]:
        """The trainable policy parameters (the normaliser's statistics are buffers, not these)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def parameter_names(self) -> dict[str, nn.Parameter]:
        """Every trainable parameter (policy, then critic) by the name its gradient carries."""
        return dict(self._named)

    def weights(self) -> dict[str, torch.Tensor]:
        """policy.state_dict() (normaliser included), detached copies on the CPU, for publishing."""
        return {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}

    @property
    def reward_scale(self) -> float:
        """1 / std of the discounted returns seen so far; 1 when reward normalisation is off."""
        if not self.cfg.normalize_rewards:
            return 1.0
        return 1.0 / math.sqrt(self.reward_stats.var + 1e-8)

    def trained_samples(self) -> int:
        """Samples in the last update's batch; 0 before the first update."""
        return 0 if self.trained_batch is None else len(self.trained_batch.obs)

    def _require_batch(self) -> BatchT:
        if self.trained_batch is None:
            raise RuntimeError(f"{type(self).__name__}.objective: no update has run yet")
        return self.trained_batch

    # -- the update -----------------------------------------------------------------------------

    def _minibatch_count(self, n: int) -> int:
        return minibatch_count(n, self.cfg.minibatch_size)

    def _minibatches(self, n: int, rng: np.random.Generator) -> list[torch.Tensor]:
        return minibatch_indices(n, self._minibatch_count(n), rng, self.device)

    def loss_gradients(self, loss: MinibatchLoss, rows: torch.Tensor) -> Gradients:
        """The gradients of ``loss(rows)`` at this learner's parameters."""
        return gradients_of(*loss(rows), self.parameter_names(), len(rows))

    def apply_gradients(self, gradients: Sequence[Gradients], *, weights: Sequence[float] | None = None,
                        progress: Progress | None = None) -> bool:
        """One optimiser step on the mean of ``gradients`` weighted by their samples times
        ``weights`` (default 1), at the learning rate of ``progress``'s schedule times the weights'
        mean (``gradients.weighted_mean``). The policy's and the critic's parts are clipped
        separately: the critic's gradient (large while returns are being learnt) must not shrink
        the policy's step through a shared norm. False, and no step, when a loss or a clipped
        gradient is not finite: once Adam has taken a NaN its weights and moments are NaN for good.
        Leaves no ``.grad`` behind."""
        self.schedule(progress)
        if not gradients or not all(g.finite for g in gradients):
            return False
        mean, lr_factor = weighted_mean(gradients, [1.0] * len(gradients) if weights is None else weights)
        self.optimizer.zero_grad(set_to_none=True)  # a parameter no gradient reached: Adam leaves it alone
        norms = []
        for network in ("policy.", "critic."):
            group = [(p, mean[name]) for name, p in self._named.items() if name.startswith(network) and name in mean]
            scaled, norm = clipped([grad.to(p.device, p.dtype) for p, grad in group], self.cfg.max_grad_norm)
            for (p, _), grad in zip(group, scaled):
                p.grad = grad
            norms.append(norm)
        took = all(math.isfinite(float(norm)) for norm in norms)
        if took:
            rates = [g["lr"] for g in self.optimizer.param_groups]
            if lr_factor != 1.0:
                for g, lr in zip(self.optimizer.param_groups, rates):
                    g["lr"] = lr * lr_factor
            self.optimizer.step()
            for g, lr in zip(self.optimizer.param_groups, rates):
                g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        return took

    def close_update(self, batches: Sequence[Batch], behaviour: Policy) -> dict[str, float]:
        """The end of an update made of gradients applied one group at a time (Stellaris's round):
        the whole-batch KL of the policy now against ``behaviour`` (the policy that acted) adapts
        the KL coefficient; then the batches' statistics merge, their prepared batch is what
        ``objective`` differentiates, and the update counts. Returns the KL diagnostics."""
        data = self.prepare(batches)
        kl = whole_batch_kl(self.policy, data.obs, forward_dist_params(behaviour, data.obs))
        used, self.kl_coef = self.kl_coef, adapt_kl_coef(self.kl_coef, kl, self.cfg.kl_target)
        self.merge_statistics(batches)
        self.trained_batch = self.prepare(batches)
        self.n_updates += 1
        return {"kl": kl, "kl_coef_used": used, "kl_coef": self.kl_coef}

    def _optimise(self, data: BatchT, policy_loss: Callable[[torch.Tensor], torch.Tensor],
                  minibatch_gradients: Callable[[torch.Tensor], Gradients], *, epochs: int,
                  deadline: float | None) -> UpdateResult:
        """Train on a prepared batch; the result's diagnostics are those both algorithms report.

        (1) the gradient noise scale of ``policy_loss(minibatch)`` at the pre-update parameters
        (NaN unless ``self.noise_scale``), (2) ``epochs`` passes of shuffled minibatches, each one
        ``minibatch_gradients`` then ``apply_gradients``, none started after ``deadline``, (3) the
        whole-batch KL of the final policy against the batch's anchor -> adaptive KL coefficient.
        The minibatch order is reproducible from (seed, update count), independent of torch's
        global RNG. Leaves no ``.grad`` behind (for the detector's autograd) and counts the update."""
        cfg = self.cfg
        self.trained_batch = data  # the boosting detector differentiates the policy loss on it
        n = len(data.obs)
        rng = np.random.default_rng([self.seed, self.n_updates])
        first_epoch = self._minibatches(n, rng)
        # Fewer than two minibatches: gradient_noise_scale reports NaN.
        metrics = gradient_noise_scale(policy_loss, self.policy_parameters(),
                                       first_epoch if self.noise_scale else first_epoch[:1])

        minibatches = (idx for epoch in range(epochs)
                       for idx in (first_epoch if epoch == 0 else self._minibatches(n, rng)))
        sums, n_steps, skipped, cut = self._steps(minibatches, minibatch_gradients, deadline)

        kl_final = whole_batch_kl(self.policy, data.obs, data.anchor)
        kl_coef_used = self.kl_coef
        self.kl_coef = adapt_kl_coef(self.kl_coef, kl_final, cfg.kl_target)
        self.optimizer.zero_grad(set_to_none=True)
        self.n_updates += 1

        metrics.update({k: v / max(n_steps, 1) for k, v in sums.items()})
        metrics.update({
            "kl": kl_final,
            "kl_minibatch_mean": sums.get("kl", 0.0) / max(n_steps, 1),
            "kl_coef_used": kl_coef_used,
            "kl_coef": self.kl_coef,
            "skipped_minibatches": float(skipped),
            "sgd_steps": float(n_steps),
            "update_cut_short": float(cut),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        })
        return UpdateResult(sgd_steps=n_steps, skipped_minibatches=skipped, cut_short=cut,
                            grad_noise_scale=metrics["grad_noise_scale"], diagnostics=metrics)

    def _steps(self, minibatches: Iterable[torch.Tensor], minibatch_gradients: Callable[[torch.Tensor], Gradients],
               deadline: float | None) -> tuple[dict[str, float], int, int, bool]:
        """``apply_gradients`` of each minibatch's gradients until ``deadline`` (a
        ``time.perf_counter()`` value); a minibatch whose loss or gradient is not finite is
        skipped, not stepped on. Returns (loss-term sums, steps, skipped, whether the deadline cut
        the update short)."""
        sums: dict[str, float] = {}
        n_steps = skipped = 0
        for idx in minibatches:
            if deadline is not None and time.perf_counter() > deadline:
                log.warning("%s: update stopped after %d minibatch steps at the budget's deadline",
                            type(self).__name__, n_steps)
                return sums, n_steps, skipped, True
            gradients = minibatch_gradients(idx)
            if self.apply_gradients([gradients]):
                for k, v in {**gradients.terms, "loss": gradients.loss}.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_steps += 1
            else:
                skipped += 1
        if skipped:
            log.warning("%s: skipped %d of %d minibatches with a non-finite loss or gradient",
                        type(self).__name__, skipped, skipped + n_steps)
        return sums, n_steps, skipped, False

    def merge_statistics(self, batches: Sequence[Batch]) -> None:
        """``merge_round_statistics`` on a round's new batches (never replayed ones), with this
        learner's reward statistics when it scales rewards."""
        stats = self.reward_stats if self.cfg.normalize_rewards else None
        merge_round_statistics(self.policy, stats, batches, self.spec.is_atari, self.cfg.gamma)

    # -- checkpoints ------------------------------------------------------------------------------

    def _modules(self) -> dict[str, nn.Module]:
        """The modules a checkpoint holds, by tensor-name prefix."""
        return {"policy": self.policy, "critic": self.critic}

    def _common_tensors(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """The modules' and Adam's tensors, and Adam's param groups (for the meta)."""
        optim, param_groups = optimizer_tensors(self.optimizer)
        return {**module_tensors(self._modules()), **optim}, param_groups

    def _common_meta(self, fmt: str) -> dict[str, Any]:
        """The checkpoint meta both learners write (format, env, KL coefficient, reward
        statistics, update count, seed)."""
        return {"format": fmt, "env_id": self.spec.env_id, "kl_coef": self.kl_coef,
                **reward_stats_meta(self.reward_stats), "n_updates": self.n_updates, "seed": self.seed}

    def _load_common(self, tensors: Mapping[str, ArrayLike], meta: Mapping[str, Any],
                     fmt: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Restore what ``_common_tensors`` and ``_common_meta`` wrote; returns the decoded
        (tensors, meta) for the subclass's own part."""
        meta = decode_meta(meta, self.spec.env_id, fmt)
        t = as_tensors(tensors)
        load_module_tensors(self._modules(), t)
        load_optimizer(self.optimizer, t, meta["optim_param_groups"])
        self.kl_coef = float(meta["kl_coef"])
        load_reward_stats(self.reward_stats, meta)
        self.n_updates = int(meta["n_updates"])
        self.seed = int(meta["seed"])
        return t, meta
