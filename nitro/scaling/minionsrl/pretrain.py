"""``nitro minionsrl pretrain``: MinionsRL's meta-PPO on the simulator, and the scheduler file.

The file is safetensors (``nitro.serialization``): the network's tensors, the state normaliser's
mean and variance, and in the metadata the format, the network's shape, whether the state is
normalised, and the pre-training record: episodes, simulated env steps, and dollars (what the
simulated runs would have cost on the Lambda-projected clock at the run's prices). Every report
row that uses the scheduler shows that record beside the run's own spend.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from nitro.config import ClockConfig, ConfigError, PriceTable, apply_override, validation_message
from nitro.config.minionsrl import PretrainConfig
from nitro.scaling.minionsrl.fit import FitReport, fit_simulator, read_rounds
from nitro.scaling.minionsrl.policy import Episode, SchedulerNet, choose, meta_ppo_update
from nitro.scaling.minionsrl.simulator import TrainingSimulator
from nitro.scaling.minionsrl.state import StateNormaliser, action_mask, actors_for_action, round_reward, state_vector
from nitro.serialization import SerializationError, dumps_tensors, loads_tensors

FORMAT = "nitro.minionsrl/1"


@dataclass(frozen=True)
class PretrainRecord:
    """What pre-training the scheduler took."""

    episodes: int
    env_steps: int
    usd: float  # the simulated runs' cost on the projected clock
    simulator: str  # what the episodes ran on
    seed: int


@dataclass
class Scheduler:
    """A pre-trained MinionsRL scheduler: network, state normaliser (None: raw state), record."""

    net: SchedulerNet
    normaliser: StateNormaliser | None
    record: PretrainRecord
    budget_usd: float  # what the pre-training runs' budget feature was measured against
    config: dict[str, Any]

    def state(self, raw: np.ndarray) -> np.ndarray:
        return self.normaliser(raw) if self.normaliser is not None else raw


def pretrain(cfg: PretrainConfig, prices: PriceTable | None = None, clock: ClockConfig | None = None,
             log_every: int = 0) -> tuple[Scheduler, list[dict[str, float]]]:
    """Train a scheduler for ``cfg.episodes`` simulated runs; returns it and one row per episode."""
    prices, clock = prices or PriceTable(), clock or ClockConfig(kind="lambda")
    torch.manual_seed(cfg.seed)
    net = SchedulerNet(cfg.n_actions, cfg.hidden)
    optimiser = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    normaliser = StateNormaliser.empty() if cfg.normalize_state else None
    generator = torch.Generator().manual_seed(cfg.seed)
    mask = action_mask(cfg.n_actions, cfg.i_min, cfg.i_max, cfg.mask_out_of_range)
    rows, env_steps, usd = [], 0, 0.0
    for episode_idx in range(cfg.episodes):
        sim = TrainingSimulator(cfg.simulator, prices, clock, cfg.budget_usd, seed=cfg.seed * 1_000_003 + episode_idx)
        episode, counts = Episode(), []
        while not sim.done:
            raw = state_vector(sim.observation())
            if normaliser is not None:
                normaliser.update(raw)
            state = normaliser(raw) if normaliser is not None else raw
            choice = choose(net, state, mask, greedy=False, generator=generator)
            actors = actors_for_action(choice.action, cfg.i_min, cfg.i_max)
            done_round = sim.step(actors)
            reward = round_reward(done_round.round_s, cfg.beta, last=sim.done, final_return=sim.mean_return,
                                  best_return=sim.best_return, target_return=cfg.target_return)
            episode.add(state, mask, choice, reward)
            counts.append(actors)
            env_steps += done_round.env_steps
        usd += sim.spent_usd
        terms = meta_ppo_update(net, optimiser, episode, gamma=cfg.gamma, clip=cfg.clip, vf_coef=cfg.vf_coef,
                                entropy_coef=cfg.entropy_coef)
        rows.append({"episode": float(episode_idx), "final_return": sim.mean_return, "usd": sim.spent_usd,
                     "mean_actors": float(np.mean(counts)), **terms})
        if log_every and (episode_idx + 1) % log_every == 0:
            print(f"episode {episode_idx + 1}/{cfg.episodes}: return {sim.mean_return:.1f}, "
                  f"mean actors {np.mean(counts):.1f}, ${sim.spent_usd:.4f}", flush=True)
    fitted = cfg.simulator.fitted_from
    on = f"nitro.scaling.minionsrl.simulator fitted from {fitted}" if fitted else "nitro.scaling.minionsrl.simulator"
    record = PretrainRecord(cfg.episodes, env_steps, usd, on, cfg.seed)
    return Scheduler(net, normaliser, record, cfg.budget_usd, cfg.model_dump(mode="json")), rows


def save_scheduler(path: str | Path, scheduler: Scheduler) -> Path:
    """Write the scheduler file (module docstring)."""
    tensors = {f"net.{k}": v.detach().clone() for k, v in scheduler.net.state_dict().items()}
    if scheduler.normaliser is not None:
        tensors["norm.mean"] = torch.as_tensor(scheduler.normaliser.mean)
        tensors["norm.var"] = torch.as_tensor(scheduler.normaliser.var)
    meta = {"format": FORMAT, "n_actions": scheduler.net.n_actions, "hidden": scheduler.net.hidden,
            "normalize_state": scheduler.normaliser is not None,
            "norm_count": scheduler.normaliser.count if scheduler.normaliser is not None else 0.0,
            "budget_usd": scheduler.budget_usd, "record": asdict(scheduler.record), "config": scheduler.config}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(dumps_tensors(tensors, meta))
    return out


def load_scheduler(path: str | Path) -> Scheduler:
    """Read a scheduler file; ValueError (one line) when it is not one."""
    try:
        tensors, raw_meta = loads_tensors(Path(path).read_bytes())
    except FileNotFoundError:
        raise ValueError(f"no MinionsRL scheduler at {path} (train one: nitro minionsrl pretrain)") from None
    except SerializationError as exc:
        raise ValueError(f"{path} is not a MinionsRL scheduler: {exc}") from None
    meta = {k: _json(v) for k, v in raw_meta.items()}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a MinionsRL scheduler (format {meta.get('format')!r})")
    net = SchedulerNet(int(meta["n_actions"]), int(meta["hidden"]))
    net.load_state_dict({k[4:]: torch.as_tensor(np.asarray(v)) for k, v in tensors.items() if k.startswith("net.")})
    normaliser = None
    if meta["normalize_state"]:
        normaliser = StateNormaliser(np.asarray(tensors["norm.mean"], np.float64),
                                     np.asarray(tensors["norm.var"], np.float64), float(meta["norm_count"]))
    return Scheduler(net, normaliser, PretrainRecord(**meta["record"]), float(meta["budget_usd"]), meta["config"])


def _json(value: Any) -> Any:
    """``loads_tensors`` may hand metadata back as JSON strings."""
    import json

    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def fitted_pretrain_config(overrides: list[str] | tuple[str, ...],
                           fit_from: str | Path) -> tuple[PretrainConfig, FitReport]:
    """``pretrain_config`` on a simulator fitted from a ``rounds.csv`` (``nitro.scaling.minionsrl.fit``);
    the overrides still win over the fit, because they are what the user asked for by name.
    ``ConfigError`` (one line) when the file cannot be fitted."""
    base = pretrain_config(overrides)
    try:
        simulator, report = fit_simulator(read_rounds(fit_from), base.simulator)
    except ValueError as exc:
        raise ConfigError(f"--fit-from {fit_from}: {exc}") from None
    start = {"simulator": {**simulator.model_dump(mode="json"), "fitted_from": str(fit_from)}}
    return pretrain_config(overrides, start), report


def pretrain_config(overrides: list[str] | tuple[str, ...], start: dict[str, Any] | None = None) -> PretrainConfig:
    """A ``PretrainConfig`` from ``key=value`` overrides (on top of ``start``); ``ConfigError``
    (one line, naming the field) when one is bad."""
    data: dict[str, Any] = dict(start or {})
    for item in overrides:
        apply_override(data, item)
    try:
        return PretrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, "pretrain config")) from None
