"""The PyTorch side of the networks (the package's docstring says what is where): the modules the
learner trains, ``Policy`` and ``Critic``, and ``CNNActor``, the batched CNN forward an Atari actor
steps with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal

from nitro.envs import EnvSpec
from nitro.models import HIDDEN, OBS_CLIP, Action, Architecture, layer_of

# What one merge may do to the normaliser once it has seen MERGE_BOUNDED_AFTER samples: move each
# input's mean by at most MERGE_MAX_SHIFT_STD of its standard deviations, and scale its variance
# by at most MERGE_MAX_VAR_RATIO either way. Before that the first batches set the scale, within
# the door's magnitude bounds (nitro/validation.py). An iid batch of 256 among 1000 samples moves
# the mean by a fifth of its own distance from it, so honest batches stay far inside these bounds
# and merge exactly; a new regime of an input is followed over a few batches, never refused.
MERGE_MAX_SHIFT_STD = 1.0
MERGE_MAX_VAR_RATIO = 10.0
MERGE_BOUNDED_AFTER = 1000.0


class ObsNorm(nn.Module):
    """Running mean and variance of raw observations (parallel Welford merge).

    Frozen during a round: actors normalise with the statistics they received, and the learner
    merges the round's raw observations in (PPO before its update, IMPACT after it).
    """

    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor

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
        """Fold in the observations whose every value is finite: one inf would make the mean
        non-finite for good, and with it every later action. No merge moves the statistics
        further than the MERGE_* bounds above."""
        x = torch.as_tensor(obs, dtype=torch.float64, device=self.mean.device).reshape(-1, *self.mean.shape)
        x = x[torch.isfinite(x).reshape(len(x), -1).all(dim=1)]
        if len(x) == 0:
            return
        b_mean, b_var, b_count = x.mean(0), x.var(0, unbiased=False), float(len(x))
        delta = b_mean - self.mean
        total = self.count + b_count
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        mean, var = self.mean + delta * b_count / total, m2 / total
        if float(self.count) >= MERGE_BOUNDED_AFTER:
            step = MERGE_MAX_SHIFT_STD * torch.sqrt(self.var)
            mean = torch.minimum(torch.maximum(mean, self.mean - step), self.mean + step)
            var = torch.minimum(torch.maximum(var, self.var / MERGE_MAX_VAR_RATIO), self.var * MERGE_MAX_VAR_RATIO)
        self.mean.copy_(mean)
        self.var.copy_(var)
        self.count.copy_(total)


_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def _mlp(n_in: int, n_out: int, out_gain: float, arch: Architecture) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in arch.hidden or (HIDDEN, HIDDEN):
        layers += [nn.Linear(n_in, width), _ACTIVATIONS[arch.activation]()]
        n_in = width
    layers.append(nn.Linear(n_in, n_out))
    for layer in layers:
        if isinstance(layer, nn.Linear):  # orthogonal init, as in CleanRL and SB3
            gain = out_gain if layer is layers[-1] else math.sqrt(2)
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class AtariTrunk(nn.Module):
    """RLlib's 84x84 filters: 16@8x8/4 and 32@4x4/2 with 'same' padding, then 256@11x11/1 valid.

    The first convolution pads inside itself: a separate pad copied every 84x84 stack of a
    minibatch, about a tenth of the trunk's forward and backward (measured on 2 CPU threads). The
    Identity in its place keeps the parameters' names (``net.1``, ``net.4``, ``net.6``), which
    checkpoints and published weights carry."""

    out_features = HIDDEN

    def __init__(self, in_channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Identity(), nn.Conv2d(in_channels, 16, 8, stride=4, padding=2), nn.ReLU(),  # 84 -> 21
            nn.ZeroPad2d((1, 2, 1, 2)), nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),  # 21 -> 11
            nn.Conv2d(32, 256, 11, stride=1), nn.ReLU(),  # 11 -> 1
            nn.Flatten(),
        )
        # Orthogonal with gain sqrt(2), as CleanRL and SB3 initialise their CNNs. PyTorch's default
        # leaves the features about 12x smaller on Qbert's frames (rms 0.019 against 0.22), and
        # since Adam's steps have a fixed size, the logits then move that much slower.
        for conv in self.net:
            if isinstance(conv, nn.Conv2d) and conv.bias is not None:
                nn.init.orthogonal_(conv.weight, math.sqrt(2))
                nn.init.zeros_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NatureTrunk(nn.Module):
    """DQN's Nature CNN, SB3's ``NatureCNN`` and CleanRL's ``ppo_atari`` trunk: 32@8x8/4, 64@4x4/2
    and 64@3x3/1 valid (84 -> 20 -> 9 -> 7), then a dense layer of 512. About 2.4x the paper
    trunk's multiply-adds (9.3M against 3.8M a frame), so one shared by the policy and the
    critic has about 1.2x the multiply-adds of the paper's two trunks."""

    out_features = 512

    def __init__(self, in_channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(64 * 7 * 7, self.out_features), nn.ReLU(),
        )
        for layer in self.net:  # orthogonal with gain sqrt(2), as SB3 and CleanRL start it
            if isinstance(layer, (nn.Conv2d, nn.Linear)) and layer.bias is not None:
                nn.init.orthogonal_(layer.weight, math.sqrt(2))
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


CNN_TRUNKS: dict[str, type[AtariTrunk] | type[NatureTrunk]] = {"paper": AtariTrunk, "nature": NatureTrunk}


def cnn_trunk_type(arch: Architecture) -> type[AtariTrunk] | type[NatureTrunk]:
    """The class of the CNN trunk ``arch.cnn`` names."""
    if arch.cnn not in CNN_TRUNKS:
        raise ValueError(f"model.cnn: {arch.cnn!r} is not one of {sorted(CNN_TRUNKS)}")
    return CNN_TRUNKS[arch.cnn]


class Policy(nn.Module):
    """pi(a|s). ``features`` normalises raw observations; ``distribution`` gives pi(.|s)."""

    def __init__(self, spec: EnvSpec, arch: Architecture = Architecture()):
        super().__init__()
        self.spec, self.arch = spec, arch
        if spec.is_image:
            self.obs_norm = None
            trunk = cnn_trunk_type(arch)(spec.obs_shape[0])
            head = nn.Linear(trunk.out_features, spec.action_dim)
            nn.init.orthogonal_(head.weight, 0.01)
            nn.init.zeros_(head.bias)
            self.body = nn.Sequential(trunk, head)
        else:
            self.obs_norm = ObsNorm(spec.obs_shape)
            self.body = _mlp(spec.obs_shape[0], spec.action_dim, out_gain=0.01, arch=arch)
        if spec.continuous:
            self.log_std = nn.Parameter(torch.full((spec.action_dim,), float(arch.log_std_init)))

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        if self.obs_norm is None:
            return obs.float() / 255.0
        return self.obs_norm(obs)

    def distribution_from_features(self, x: torch.Tensor) -> Distribution:
        return self.distribution_of(self.body(x))

    def distribution_of(self, out: torch.Tensor) -> Distribution:
        """pi(.|s) from the body's output: the Gaussian's mean, or the logits."""
        if self.spec.continuous:
            # validate_args=False: torch's argument checks cost ~90 us per distribution,
            # and these arguments come from our own network
            return Independent(Normal(out, self.log_std.exp().expand_as(out), validate_args=False), 1,
                               validate_args=False)
        return Categorical(logits=out, validate_args=False)

    def distribution(self, obs: torch.Tensor) -> Distribution:
        return self.distribution_from_features(self.features(obs))

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> Action:
        """The deterministic action for one raw observation: the mean, or the likeliest action."""
        out = self.body(self.features(torch.as_tensor(obs).unsqueeze(0)))[0]
        return out.numpy() if self.spec.continuous else np.int64(int(out.argmax()))

    @torch.no_grad()
    def sample(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[Action, float]:
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


class CNNActor:
    """A CNN policy's forward pass for actors, on a batch of observations (one per game).

    An Atari actor steps several games and runs the network once per step on all of their
    observations (``nitro.actors.rollout``); a batch of 8 costs about a quarter per observation of
    one at a time. The paper trunk's last convolution, 256 filters of 11x11 over an 11x11 map, is a
    dense layer, and one matrix product computes it in about a third of the convolution's time on
    CPU. The numbers are ``Policy``'s to float32 rounding, and it samples each observation's action
    from that observation's RNG exactly as ``Policy.sample`` does, so the two are interchangeable.
    """

    def __init__(self, weights: Mapping[str, np.ndarray], arch: Architecture = Architecture()):
        """From a CNN ``Policy``'s state dict, as published, and its architecture (which CNN)."""

        def layer(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            w, b = layer_of(weights, name)
            return torch.tensor(w, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)

        self.paper = cnn_trunk_type(arch) is AtariTrunk
        if self.paper:  # AtariTrunk's names
            self.convs = [layer("body.0.net.1"), layer("body.0.net.4")]
            w3, b3 = layer("body.0.net.6")
            self.dense = (w3.reshape(len(w3), -1).t().contiguous(), b3)  # (32*11*11, 256): x.flatten(1) @ it
        else:  # NatureTrunk's names
            self.convs = [layer("body.0.net.0"), layer("body.0.net.2"), layer("body.0.net.4")]
            w4, b4 = layer("body.0.net.7")
            self.dense = (w4.t().contiguous(), b4)
        wh, bh = layer("body.1")
        self.head = (wh.t().contiguous(), bh)

    @torch.inference_mode()
    def logits(self, obs: np.ndarray) -> torch.Tensor:
        """(k, n_actions) float32 logits for k raw uint8 observations (k, 4, 84, 84)."""
        x = torch.from_numpy(np.ascontiguousarray(obs)).float().div_(255.0)  # Policy.features
        if self.paper:  # AtariTrunk's paddings
            x = F.conv2d(x, *self.convs[0], stride=4, padding=2).relu_()
            x = F.conv2d(F.pad(x, (1, 2, 1, 2)), *self.convs[1], stride=2).relu_()
        else:
            for (w, b), stride in zip(self.convs, (4, 2, 1)):
                x = F.conv2d(x, w, b, stride=stride).relu_()
        x = torch.addmm(self.dense[1], x.flatten(1), self.dense[0]).relu_()
        return torch.addmm(self.head[1], x, self.head[0])

    def sample_batch(self, obs: np.ndarray, rngs: list[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """One action per observation, observation i's noise from ``rngs[i]``: (actions int64,
        log-probabilities float32), each (k,)."""
        logp_all = torch.log_softmax(self.logits(obs), -1).numpy().astype(np.float64)
        actions = np.empty(len(logp_all), np.int64)
        for i, rng in enumerate(rngs):
            gumbel = -np.log(-np.log(rng.uniform(1e-12, 1.0, size=logp_all.shape[1])))
            actions[i] = np.argmax(logp_all[i] + gumbel)
        return actions, logp_all[np.arange(len(actions)), actions].astype(np.float32)

    def act(self, obs: np.ndarray) -> Action:
        return np.int64(int(self.logits(obs[None])[0].argmax()))

    def sample(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[Action, float]:
        actions, logp = self.sample_batch(obs[None], [rng])
        return actions[0], float(logp[0])


class Critic(nn.Module):
    """V(s): a separate network of the policy's shape on the policy's normalised features, or, with
    ``arch.shared_trunk`` on an image env, a value head on the policy's CNN trunk (``reads_trunk``;
    ``evaluate`` feeds it the trunk's output)."""

    def __init__(self, spec: EnvSpec, arch: Architecture = Architecture()):
        super().__init__()
        self.reads_trunk = spec.is_image and arch.shared_trunk
        if self.reads_trunk:
            self.net: nn.Module = nn.Linear(cnn_trunk_type(arch).out_features, 1)
            nn.init.orthogonal_(self.net.weight, 1.0)  # SB3's and CleanRL's value head on their shared trunk
            nn.init.zeros_(self.net.bias)
        elif spec.is_image:
            trunk = cnn_trunk_type(arch)(spec.obs_shape[0])
            self.net = nn.Sequential(trunk, nn.Linear(trunk.out_features, 1))
        else:
            self.net = _mlp(spec.obs_shape[0], 1, out_gain=1.0, arch=arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """V on the policy's features, or on its trunk's output where the critic reads the trunk."""
        return self.net(x).squeeze(-1)


def evaluate(policy: Policy, critic: Critic, features: torch.Tensor) -> tuple[Distribution, torch.Tensor]:
    """pi(.|s) and V(s) on the policy's features: the trunk runs once where the critic reads it,
    and its gradient is then the sum of the policy's loss and the value loss through it."""
    if critic.reads_trunk:
        trunk, head = policy.body
        latent = trunk(features)
        return policy.distribution_of(head(latent)), critic(latent)
    return policy.distribution_from_features(features), critic(features)


def build_policy(spec: EnvSpec, seed: int | None = None, arch: Architecture = Architecture()) -> Policy:
    if seed is not None:
        torch.manual_seed(seed)
    return Policy(spec, arch)


def build_critic(spec: EnvSpec, seed: int | None = None, arch: Architecture = Architecture()) -> Critic:
    if seed is not None:
        torch.manual_seed(seed + 1)
    return Critic(spec, arch)


M = TypeVar("M", bound=nn.Module)


def holding(build: Callable[[], M], state: Mapping[str, torch.Tensor]) -> M:
    """The module ``build()`` makes, holding ``state`` (every parameter and buffer, strictly): built
    on the meta device and handed the state's tensors, so no initialisation is computed only to be
    overwritten. For a decoded snapshot that initialisation was most of the work: Hopper's policy
    and critic took 4.0 ms to build (orthogonal init) and 0.5 ms to load."""
    with torch.device("meta"):
        module = build()
    module.load_state_dict(state, strict=True, assign=True)
    if left := [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]:
        raise ValueError(f"state leaves {left[:3]} without values")
    return module
