"""A learner's state as checkpoint data: flat named tensors plus JSON-able meta, nothing pickled.

Modules and Adam's per-parameter state become ``{prefix}.{key}`` / ``optim.{i}.{key}`` tensors;
scalars (KL coefficient, reward statistics, counters, Adam's param groups) go into the meta, whose
values come back from ``loads_tensors`` as JSON strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from nitro.learners.arrays import ArrayLike
from nitro.learners.statistics import RunningMeanStd


def module_tensors(modules: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """``{prefix}.{key}`` detached CPU copies of each module's state dict."""
    return {f"{prefix}.{k}": v.detach().cpu().clone()
            for prefix, module in modules.items() for k, v in module.state_dict().items()}


def load_module_tensors(modules: Mapping[str, nn.Module], tensors: Mapping[str, torch.Tensor]) -> None:
    """Inverse of ``module_tensors`` (strict: every key of every module there, and no other). Tensors
    of another network are a one-line error that names the config's model section."""
    for prefix, module in modules.items():
        n = len(prefix) + 1
        state = {k[n:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        differing = sorted(state.keys() ^ module.state_dict().keys())
        if differing:
            raise ValueError(f"the checkpoint's {prefix} is not the network this config builds (tensors "
                             f"{', '.join(differing[:3])} differ): set the model section as the run that wrote "
                             "it had it (model.hidden, model.shared_trunk, model.cnn)")
        module.load_state_dict(state, strict=True)


def as_tensors(tensors: Mapping[str, ArrayLike]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors as torch tensors (``loads_tensors`` gives numpy arrays)."""
    return {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An optimizer's state as flat ``optim.{i}.{key}`` tensors plus its (JSON-able) param groups."""
    opt = optimizer.state_dict()
    tensors = {f"optim.{i}.{key}": torch.as_tensor(v).detach().cpu().clone()
               for i, st in opt["state"].items() for key, v in st.items()}
    return tensors, opt["param_groups"]


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor],
                   param_groups: list[dict]) -> None:
    """Inverse of ``optimizer_tensors`` (param groups as JSON gave them back: betas as lists)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g) for g in param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def reward_stats_meta(stats: RunningMeanStd) -> dict[str, float]:
    """The reward statistics as checkpoint meta (``reward_mean``/``reward_var``/``reward_count``)."""
    return {"reward_mean": stats.mean, "reward_var": stats.var, "reward_count": stats.count}


def load_reward_stats(stats: RunningMeanStd, meta: Mapping[str, Any]) -> None:
    """Inverse of ``reward_stats_meta``."""
    stats.mean, stats.var = float(meta["reward_mean"]), float(meta["reward_var"])
    stats.count = float(meta["reward_count"])


def maybe_json(v: Any) -> Any:
    """A JSON string decoded, anything else (or a string that is not JSON) as it is."""
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def decode_meta(meta: Mapping[str, Any], env_id: str, fmt: str | None = None) -> dict[str, Any]:
    """Checkpoint meta with its values decoded (``loads_tensors`` returns them as JSON strings),
    after checking that it is in format ``fmt`` (when given) and for this environment."""
    out = {k: maybe_json(v) for k, v in meta.items()}
    if fmt is not None and out.get("format") != fmt:
        raise ValueError(f"not a {fmt} learner state (format {out.get('format')!r})")
    if out.get("env_id") != env_id:
        raise ValueError(f"learner state is for {out.get('env_id')!r}, this learner is for {env_id!r}")
    return out
