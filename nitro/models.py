"""The paper's networks (SPEC.md): a 2x256 tanh Gaussian policy with a separate critic of the same
shape for MuJoCo, and RLlib's 84x84 CNN for Atari.

The policy carries its observation normaliser as buffers, so ``policy.state_dict()`` is the whole
thing an actor needs: the statistics ship with the weights. The critic stays on the learner and
reads the policy's normalised features (``critic(policy.features(obs))``), so both see one set of
statistics.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal

from nitro.envs import EnvSpec

HIDDEN = 256
OBS_CLIP = 10.0


class ObsNorm(nn.Module):
    """Running mean and variance of raw observations (parallel Welford merge).

    Frozen during a round: actors normalise with the statistics they received, and the learner
    merges the round's raw observations in after its update.
    """

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        z = (obs.double() - self.mean) / torch.sqrt(self.var + 1e-8)
        return z.clamp(-OBS_CLIP, OBS_CLIP).float()

    @torch.no_grad()
    def merge(self, obs: np.ndarray | torch.Tensor) -> None:
        x = torch.as_tensor(obs, dtype=torch.float64).reshape(-1, *self.mean.shape)
        if len(x) == 0:
            return
        b_mean, b_var, b_count = x.mean(0), x.var(0, unbiased=False), float(len(x))
        delta = b_mean - self.mean
        total = self.count + b_count
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.mean.copy_(self.mean + delta * b_count / total)
        self.var.copy_(m2 / total)
        self.count.copy_(total)


def _mlp(n_in: int, n_out: int, out_gain: float) -> nn.Sequential:
    layers = [nn.Linear(n_in, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, n_out)]
    for layer in layers:
        if isinstance(layer, nn.Linear):  # orthogonal init, as in CleanRL and SB3
            gain = out_gain if layer is layers[-1] else math.sqrt(2)
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class AtariTrunk(nn.Module):
    """RLlib's 84x84 filters: 16@8x8/4 and 32@4x4/2 with 'same' padding, then 256@11x11/1 valid."""

    def __init__(self, in_channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.ZeroPad2d(2), nn.Conv2d(in_channels, 16, 8, stride=4), nn.ReLU(),  # 84 -> 21
            nn.ZeroPad2d((1, 2, 1, 2)), nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),  # 21 -> 11
            nn.Conv2d(32, 256, 11, stride=1), nn.ReLU(),  # 11 -> 1
            nn.Flatten(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Policy(nn.Module):
    """pi(a|s). ``features`` normalises raw observations; ``distribution`` gives pi(.|s)."""

    def __init__(self, spec: EnvSpec):
        super().__init__()
        self.spec = spec
        if spec.is_atari:
            self.obs_norm = None
            self.body = nn.Sequential(AtariTrunk(spec.obs_shape[0]), nn.Linear(HIDDEN, spec.action_dim))
            nn.init.orthogonal_(self.body[-1].weight, 0.01)
            nn.init.zeros_(self.body[-1].bias)
        else:
            self.obs_norm = ObsNorm(spec.obs_shape)
            self.body = _mlp(spec.obs_shape[0], spec.action_dim, out_gain=0.01)
            self.log_std = nn.Parameter(torch.zeros(spec.action_dim))

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        if self.obs_norm is None:
            return obs.float() / 255.0
        return self.obs_norm(obs)

    def distribution_from_features(self, x: torch.Tensor) -> Distribution:
        out = self.body(x)
        if self.spec.continuous:
            return Independent(Normal(out, self.log_std.exp().expand_as(out)), 1)
        return Categorical(logits=out)

    def distribution(self, obs: torch.Tensor) -> Distribution:
        return self.distribution_from_features(self.features(obs))

    @torch.no_grad()
    def sample(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, float]:
        """One action for one raw observation, with noise from ``rng`` (so rollouts are
        reproducible without touching torch's global RNG). Returns (action, log-prob)."""
        x = self.features(torch.as_tensor(obs).unsqueeze(0))
        out = self.body(x)[0]
        if self.spec.continuous:
            std = self.log_std.exp()
            action = out + std * torch.from_numpy(rng.standard_normal(out.shape[0]).astype(np.float32))
            logp = Normal(out, std).log_prob(action).sum()
            return action.numpy(), float(logp)
        logp_all = torch.log_softmax(out, -1).numpy().astype(np.float64)
        gumbel = -np.log(-np.log(rng.uniform(1e-12, 1.0, size=logp_all.shape)))
        a = int(np.argmax(logp_all + gumbel))
        return np.int64(a), float(logp_all[a])


class Critic(nn.Module):
    """V(s) on the policy's normalised features; a separate network of the policy's shape."""

    def __init__(self, spec: EnvSpec):
        super().__init__()
        if spec.is_atari:
            self.net = nn.Sequential(AtariTrunk(spec.obs_shape[0]), nn.Linear(HIDDEN, 1))
        else:
            self.net = _mlp(spec.obs_shape[0], 1, out_gain=1.0)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)


def build_policy(spec: EnvSpec, seed: int | None = None) -> Policy:
    if seed is not None:
        torch.manual_seed(seed)
    return Policy(spec)


def build_critic(spec: EnvSpec, seed: int | None = None) -> Critic:
    if seed is not None:
        torch.manual_seed(seed + 1)
    return Critic(spec)
