"""Conversions between what a learner is handed (numpy arrays or torch tensors) and what its
computations need: the return recursions run in numpy float64 whatever the input's kind, and
minibatch rows are indexed with a long tensor on the learner's device."""

from __future__ import annotations

import numpy as np
import torch

ArrayLike = np.ndarray | torch.Tensor


def as_float64(x: ArrayLike) -> np.ndarray:
    """A numpy float64 copy-or-view of an array or (detached) tensor."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def as_bool(x: ArrayLike) -> np.ndarray:
    """A numpy bool array of an array or (detached) tensor."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(bool)


def as_indices(indices: ArrayLike, device: torch.device) -> torch.Tensor:
    """Row indices (a numpy array or a tensor) as a long tensor on ``device``."""
    if isinstance(indices, torch.Tensor):
        return indices.to(device=device, dtype=torch.long)
    return torch.as_tensor(np.asarray(indices), dtype=torch.long, device=device)
