"""MinionsRL's scheduler network and its meta-PPO, as the scheduler code defines them.

Network: separate actor and critic MLPs, 8 -> hidden -> hidden -> {n_actions logits, 1 value},
tanh. Meta-PPO: one update per episode (a whole training run) on its transitions: Monte Carlo
returns G_t (gamma), advantages A_t = G_t - V(s_t) unnormalised, one epoch on the full batch,
clip 0.2, loss = -clipped surrogate + 0.5 SmoothL1(V, G) - 0.01 entropy, Adam at lr 1e-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from nitro.scaling.minionsrl.state import FEATURES


def _mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class SchedulerNet(nn.Module):
    """The actor (logits over N = 1..n_actions) and the critic, apart."""

    def __init__(self, n_actions: int = 64, hidden: int = 64):
        super().__init__()
        self.n_actions, self.hidden = int(n_actions), int(hidden)
        self.actor = _mlp(len(FEATURES), hidden, n_actions)
        self.critic = _mlp(len(FEATURES), hidden, 1)

    def distribution(self, states: torch.Tensor, mask: torch.Tensor) -> torch.distributions.Categorical:
        logits = self.actor(states).masked_fill(~mask, float("-inf"))
        return torch.distributions.Categorical(logits=logits, validate_args=False)

    def value(self, states: torch.Tensor) -> torch.Tensor:
        return self.critic(states).squeeze(-1)


class Choice(NamedTuple):
    action: int
    logp: float


def choose(net: SchedulerNet, state: np.ndarray, mask: np.ndarray, *, greedy: bool,
           generator: torch.Generator | None = None) -> Choice:
    """One action for ``state``: the most probable allowed one, or a sample."""
    with torch.no_grad():
        dist = net.distribution(torch.as_tensor(state)[None], torch.as_tensor(mask)[None])
        if greedy:
            action = int(torch.argmax(dist.probs[0]))
        else:
            action = int(torch.multinomial(dist.probs[0], 1, generator=generator))
        return Choice(action, float(dist.log_prob(torch.tensor([action]))[0]))


@dataclass
class Episode:
    """One training run's transitions, as the meta-PPO trains on them."""

    states: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def add(self, state: np.ndarray, mask: np.ndarray, choice: Choice, reward: float) -> None:
        self.states.append(state)
        self.masks.append(mask)
        self.actions.append(choice.action)
        self.logps.append(choice.logp)
        self.rewards.append(float(reward))


def monte_carlo_returns(rewards: list[float], gamma: float) -> np.ndarray:
    """G_t = r_t + gamma G_{t+1}, from the episode's end."""
    out, g = np.zeros(len(rewards), np.float32), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = rewards[t] + gamma * g
        out[t] = g
    return out


def meta_ppo_update(net: SchedulerNet, optimiser: torch.optim.Optimizer, episode: Episode, *, gamma: float,
                    clip: float, vf_coef: float, entropy_coef: float) -> dict[str, float]:
    """The code's one update on one episode (module docstring); returns its loss terms."""
    states = torch.as_tensor(np.stack(episode.states))
    masks = torch.as_tensor(np.stack(episode.masks))
    actions = torch.as_tensor(episode.actions)
    old_logp = torch.as_tensor(episode.logps)
    returns = torch.as_tensor(monte_carlo_returns(episode.rewards, gamma))
    dist = net.distribution(states, masks)
    values = net.value(states)
    advantages = (returns - values).detach()
    ratio = torch.exp(dist.log_prob(actions) - old_logp)
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip) * advantages).mean()
    value_loss = nn.functional.smooth_l1_loss(values, returns)
    entropy = dist.entropy().mean()
    loss = -surrogate + vf_coef * value_loss - entropy_coef * entropy
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()
    return {"loss": float(loss.detach()), "surrogate": float(surrogate.detach()),
            "value_loss": float(value_loss.detach()), "entropy": float(entropy.detach()), "return": float(returns[0])}
