"""Global importance-sampling truncation across the live policy versions (Stellaris's, which PPO's
loss applies when it is given the live versions: ``ppo_loss.ppo_gradients``).

A learner function computes its gradient against snapshot version v_k while other functions hold
other versions of the policy. Each sample's importance ratio rho = pi_vk(a|s) / mu(a|s) (mu: the
behaviour policy that acted) is truncated with the ratios the live versions give the same sample:

    rho_tilde = min(rho, max(c, min_j rho_j))        j over the live versions, rho itself included

so a sample that one live version already finds much more likely than the behaviour policy did
cannot push the snapshot further in that direction: stale gradients cannot compound one another's
steps. With c = 1: rho < 1 trains as usual; rho >= 1 gives a constant (no policy gradient) when a
live version's ratio is smaller, and half the gradient when rho is itself the minimum, because
``torch.minimum`` splits the gradient of a tie.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def truncated_ratio(logp_new: torch.Tensor, logp_behaviour: torch.Tensor, live_logps: Sequence[torch.Tensor],
                    c: float) -> torch.Tensor:
    """rho_tilde per sample. ``logp_new``: the snapshot's log-probabilities (differentiated);
    ``live_logps``: each live version's (constants); ``c``: the floor of the truncation."""
    rho = torch.exp(logp_new - logp_behaviour)
    floor = rho.detach()
    for logp_j in live_logps:
        floor = torch.minimum(floor, torch.exp(logp_j.detach() - logp_behaviour))
    return torch.minimum(rho, torch.clamp(floor, min=c))


def clipped_surrogate_of_ratio(ratio: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """-mean(min(ratio * A, clip(ratio, 1-clip, 1+clip) * A)): PPO's surrogate for a given ratio."""
    return -torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv).mean()
