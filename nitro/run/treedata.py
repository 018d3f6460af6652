"""A nested state as JSON-able data and tensors apart, and back: what a checkpoint stores."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

TENSOR = "__tensor__"
INTKEYS = "__intkeys__"
NDARRAY = "__ndarray__"


def split_tensors(state: Any, tensors: dict[str, torch.Tensor], path: str = "s") -> Any:
    """``state`` as JSON-able data, each tensor or array moved into ``tensors`` under its path."""
    import torch  # here, not at the top: `nitro runs` and `nitro status` read checkpoints without torch

    if isinstance(state, torch.Tensor):
        tensors[path] = state.detach().cpu().contiguous()
        return {TENSOR: path}
    if isinstance(state, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(state))
        return {NDARRAY: path}
    if isinstance(state, dict):
        if state and all(isinstance(k, int) for k in state):
            return {INTKEYS: {str(k): split_tensors(v, tensors, f"{path}/{k}") for k, v in state.items()}}
        return {str(k): split_tensors(v, tensors, f"{path}/{k}") for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [split_tensors(v, tensors, f"{path}/{i}") for i, v in enumerate(state)]
    if isinstance(state, (np.integer, np.floating, np.bool_)):
        return state.item()
    return state


def join_tensors(tree: Any, tensors: dict[str, torch.Tensor] | None) -> Any:
    """Inverse of ``split_tensors``; with ``tensors`` None, each tensor's placeholder stays."""
    if isinstance(tree, dict):
        if set(tree) in ({TENSOR}, {NDARRAY}):
            if tensors is None:
                return tree
            return tensors[tree[TENSOR]] if TENSOR in tree else tensors[tree[NDARRAY]].numpy()
        if set(tree) == {INTKEYS}:
            return {int(k): join_tensors(v, tensors) for k, v in tree[INTKEYS].items()}
        return {k: join_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(v, tensors) for v in tree]
    return tree
