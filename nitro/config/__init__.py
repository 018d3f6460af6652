"""The whole configuration of a Nitro run: one typed, validated object.

Loaded from YAML (``NitroConfig.from_yaml``), overridden from the command line with dotted
``key=value`` pairs (``apply_overrides``), and logged whole with every run. Invalid input raises
``ConfigError`` with a one-line message that names the field.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from nitro.config.algorithms import ImpactConfig, ModelConfig, PPOConfig
from nitro.config.backend import BackendConfig, LambdaConfig, RayConfig, Section as _Section
from nitro.config.learner import LearnerConfig
from nitro.config.minionsrl import MinionsRLConfig
from nitro.config.presets import EnvFamily, Preset, beneath, env_family, preset_values
from nitro.envs import EnvId

# sections whose home is another module of the package, imported from here like the rest
__all__ = ["BackendConfig", "ImpactConfig", "LambdaConfig", "ModelConfig", "PPOConfig", "RayConfig"]


RESOLVED = "resolved"  # the key that marks a dump (NitroConfig.dump_yaml)


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line and names the field."""


def read_yaml_mapping(path: str | os.PathLike, what: str, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The mapping a YAML file holds (an empty file holds an empty one); ``error``, one line naming
    ``what`` and the path, when the file is missing, is not YAML or holds something else."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except yaml.YAMLError as exc:
        raise error(f"{what} {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{what} {path} must hold a mapping at the top level")
    return data


ScalerName = Literal["nitro", "fixed", "always", "hydrozoa", "kungfu", "random", "vm-pause", "vm-replay", "minionsrl",
                     "goodput", "replay"]
READS_R = ("nitro", "vm-pause", "vm-replay")  # the scalers that boost on the Hessian ratio
BOOSTS_ON_VMS = ("vm-pause", "vm-replay")  # the scalers whose extra actors wait for VMs to start


class ScalerConfig(_Section):
    """How many actors each round gets: Nitro's scaler and the baselines (docs/decisions.md)."""

    name: ScalerName = "nitro"
    window: int = Field(6, ge=2, description="n: rounds in the sliding window of R values")
    decay: float = Field(0.96, gt=0, lt=1, description="d in S_k = (R_max - R_k)/(R_max - R_min) * d^k")
    i_min: int = Field(8, ge=1)
    i_max: int = Field(64, ge=1)
    fixed_actors: int = Field(16, ge=1, description="actors per round for the `fixed` scaler")
    hydrozoa_start: int = Field(8, ge=1)
    hydrozoa_every: int = Field(10, ge=1)
    random_boost_prob: float = Field(0.25, gt=0, le=1, description="share of rounds `random` boosts")
    random_mean_actors: float | None = Field(
        None, ge=0, description="`random`: mean actors/round of the Nitro run to match; sets the boost probability"
    )
    actors_at: dict[int, int] = Field(
        default_factory=dict, description="actors for these rounds whatever the scaler wants, e.g. {12: 64} "
        "(the boostability probe's boosted branches); still capped by the budget")
    minionsrl: MinionsRLConfig = Field(default_factory=MinionsRLConfig)
    objective: Literal["money", "time"] = Field(
        "money", description="`goodput`: the count that maximises predicted progress per dollar (money) or per "
        "second of the run's clock (time); the budget cap is the engine's either way")
    switch_gain: float = Field(0.05, ge=0, description="`goodput`: change the count only for a predicted gain over "
                               "the current one above this share (AdaptDL switches batch size above 5%)")
    noise_decay: float = Field(0.9, gt=0, lt=1, description="`goodput`: per-round decay of the bias-corrected "
                               "moving averages of |G|^2 and tr(Sigma), each smoothed before their ratio")
    scale_step: bool = Field(False, description="`goodput`: the sync learner's learning rate times AdaScale's gain r "
                             "of its minibatches against an I_min round's (GoodputScaler.step_gain); 1 when off")
    measure_noise: bool | None = Field(
        None, description="the learner measures its gradients across the round's actor fragments (the gradient noise "
        "scale, nitro/scaling/noise.py); default (null): when the scaler reads it (goodput); true: logged anyway")
    replay_actors: list[int] = Field(
        default_factory=list, description="`replay`: the actor counts of another run, replayed in a shuffled order "
        "(the experiment fills it from the partner cell: nitro/experiments/cells.py)")

    @property
    def measures_noise(self) -> bool:
        """Whether the learner measures the gradient noise: as set, else when the scaler reads it."""
        return self.measure_noise if self.measure_noise is not None else self.name == "goodput"

    @model_validator(mode="after")
    def _bounds(self) -> ScalerConfig:
        if self.i_min > self.i_max:
            raise ValueError(f"i_min ({self.i_min}) must not exceed i_max ({self.i_max})")
        bad = [f"{k}: {n}" for k, n in self.actors_at.items() if k < 0 or n < 1]
        if bad:
            raise ValueError(f"actors_at wants round >= 0: actors >= 1, got {', '.join(bad)}")
        if any(n < 1 for n in self.replay_actors):
            raise ValueError(f"replay_actors wants counts >= 1, got {self.replay_actors}")
        if self.name == "minionsrl" and not self.minionsrl.path:
            raise ValueError("minionsrl.path: scaler minionsrl needs a scheduler file (nitro minionsrl pretrain)")
        if self.scale_step and self.name != "goodput":
            raise ValueError(f"scale_step: AdaScale's gain comes from goodput's noise estimate; scaler {self.name!r} "
                             "has none")
        return self


class DetectorConfig(_Section):
    """Hessian boosting detection (paper §5.2; docs/decisions.md, "The round")."""

    enabled: bool | None = Field(
        None, description="run it every round; default (null): only when the scaler reads R (nitro), since "
        "for the others it is work nothing uses (~0.3 s of a 3.4 s Hopper round here); true logs R anyway")
    subset_size: int = Field(1024, ge=8, description="samples of the round's batch used for the Hessian")
    lanczos_steps: int = Field(12, ge=4, description="12 steps matched 60 to 1e-4 on Hopper (bench/detector.py)")

    def runs_for(self, scaler: str) -> bool:
        """Whether the round computes R: as set, else when the scaler reads it."""
        return self.enabled if self.enabled is not None else scaler in READS_R


class EvalConfig(_Section):
    """Evaluation, as SB3's EvalCallback and RLlib's evaluation_interval: the current policy plays
    whole episodes on the same backend as the actors, billed like them."""

    every_rounds: int = Field(10, ge=0, description="evaluate in round 0, every N rounds and in the last "
                              "round; 0: never (the target reward is then judged on training returns)")
    episodes: int = Field(5, ge=1, description="whole episodes per evaluation, with the mean action and "
                          "again with sampled actions; one invocation each")
    max_steps: int | None = Field(None, ge=1, description="step cap of one evaluation episode "
                                  "(default: the env's time limit, else 27000)")


class RedisConfig(_Section):
    url: str | None = Field(None, description="external Redis (redis:// or rediss://); None starts a local one")
    password_env: str = Field("NITRO_REDIS_PASSWORD", description="env var that holds the password, if any")
    ttl_s: int = Field(86_400, ge=60, description="every key expires after this")
    connect_timeout_s: float = Field(3.0, gt=0)
    lease_ttl_s: float = Field(60.0, ge=1, description="the run's writer lease (nitro/cache/lease.py) expires this "
                               "long after its holder last renewed it (every third of it): how long a resume waits "
                               "after a holder on another machine died")


class DoorConfig(_Section):
    """The stated bounds of a plausible batch at the learner's door (nitro/validation.py says why each)."""

    max_abs_obs: float = Field(1e6, gt=0, description="largest |observation| where the env's space is unbounded")
    max_abs_action: float = Field(1e3, gt=0, description="largest |continuous action| an actor may have sampled")
    max_abs_reward: float = Field(1e6, gt=0, description="largest |reward| of one step")
    logp_atol: float = Field(1e-3, gt=0, description="allowed |behaviour log-prob - recomputed| (plus logp_rtol)")
    logp_rtol: float = Field(1e-3, ge=0, description="allowed relative disagreement of the behaviour log-prob")


class PriceTable(_Section):
    """Prices in USD (paper §8.1 defaults). One table; every cost in the ledger comes from it."""

    learner_per_hour: float = Field(0.68, ge=0, description="c5.4xlarge; p3.2xlarge is 3.06")
    lambda_gb_s_x86: float = Field(0.0000166667, ge=0)
    lambda_gb_s_arm: float = Field(0.0000133334, ge=0)
    lambda_per_million_requests: float = Field(0.20, ge=0)
    provisioned_gb_s: float = Field(0.0000041667, ge=0)
    provisioned_duration_gb_s: float = Field(0.0000097222, ge=0)
    provisioned_gb_s_arm: float = Field(0.0000033334, ge=0)
    provisioned_duration_gb_s_arm: float = Field(0.0000077778, ge=0)


class ClockConfig(_Section):
    """The clock the learner is billed by (``nitro.pricing.clock``): the round as measured here, or as it
    would have run had its invocations run at once on Lambda. The budget cap uses the same clock."""

    kind: Literal["measured", "lambda"] = Field(
        "measured", description="measured: the round's wall time here; lambda: learner-side steps as measured "
        "plus the slowest invocation's duration and the allowances below (local actors on a few cores)")
    dispatch_s_per_invocation: float = Field(
        0.0003, ge=0, description="client time to put one more Invoke request on the wire: bench/fanout.py "
        "measured 0.29 s for 1000 (aiohttp invoker, 2-core client)")
    invoke_s: float = Field(
        0.05, ge=0, description="one request's trip to Lambda and its invoke overhead before the handler "
        "runs: an assumption (same-region round trip plus the service's own latency)")
    cold_start_s: float = Field(
        3.0, ge=0, le=10, description="a round with more invocations than any before starts new instances "
        "first: an assumption for a container image that imports torch; AWS caps the init phase at 10 s")


class CheckpointConfig(_Section):
    """Which round checkpoints a run keeps (``nitro.run.rundir``): the newest ``keep_last`` and the
    ``keep_best`` with the highest evaluation return; the rest are deleted once a newer checkpoint
    is on disk, so a run's folder holds at most ``keep_last + keep_best`` of them."""

    keep_last: int = Field(3, ge=1, description="the newest checkpoints kept (resume falls back through them)")
    keep_best: int = Field(1, ge=0, description="the checkpoints of the best evaluation returns kept beside them")


class TrackingConfig(_Section):
    mlflow_uri: str | None = Field(None, description="default: sqlite:///<home>/mlflow.db")
    experiment: str = "nitro"


class NitroConfig(_Section):
    """Everything a run needs: the preset's values for the env's family, under what the user set."""

    preset: Preset = Field("nitro", description="defaults: 'nitro' (tuned here) or 'paper' (the paper's Table 1)")
    env_id: EnvId = "Hopper-v5"
    algo: Literal["ppo", "impact"] = "ppo"
    seed: int = Field(0, ge=0)
    rounds: int = Field(50, ge=1)
    target_reward: float | None = Field(None, description="stop once the evaluation return reaches it")
    budget_usd: float | None = Field(None, ge=0, description="stop when spent; None: no limit")
    steps_per_actor: int = Field(512, ge=1)
    envs_per_actor: int = Field(8, ge=1, le=256, description=(
        "Atari: games one actor steps side by side, with one CNN forward per step for all; its steps_per_actor "
        "transitions are split among them, so a round's batch is still actors x steps_per_actor, in segments of "
        "steps_per_actor / envs_per_actor steps (other envs: one per actor)"))
    round_deadline_s: float = Field(600.0, gt=0, description="how long the learner waits for a round's actors")
    device: str = "cpu"
    learner_threads: int | None = Field(
        None, ge=1, description="torch threads of the learner. None: 2 (at most the machine's cores, or "
        "OMP_NUM_THREADS where set) where the actors wait for the update (PPO's synchronous round): a compiled "
        "update of the 2x256 MLPs took 0.73x one thread's time; 1 where actor processes run beside the learner "
        "(IMPACT, Stellaris's parameter server): OpenMP spin-waiting made an update 40x slower when they shared "
        "the cores (measured here)")
    learner_compile: bool | Literal["auto"] = Field(
        "auto", description="PPO's minibatch loss through torch.compile (nitro/learners/compiled.py): an update in "
        "0.70-0.77x eager PyTorch's time on the 2x256 MLPs, for a first compile of about 10 s (under 2 s once "
        "cached); auto: compile a run of at least 100 rounds, which earns that back, and no budget run (the "
        "budget's deadline cannot stop the compile, so true on a budget may pass it); false: eager PyTorch, as is "
        "a compile that fails")
    home: Path = Field(Path(".nitro"), description="checkpoints, local Redis data, default MLflow store")
    model: ModelConfig = Field(default_factory=ModelConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    impact: ImpactConfig = Field(default_factory=ImpactConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    scaler: ScalerConfig = Field(default_factory=ScalerConfig)
    detector: DetectorConfig = Field(default_factory=DetectorConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    door: DoorConfig = Field(default_factory=DoorConfig)
    prices: PriceTable = Field(default_factory=PriceTable)
    clock: ClockConfig = Field(default_factory=ClockConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if isinstance(data.get(RESOLVED), bool):
            resolved, data = data[RESOLVED], {k: v for k, v in data.items() if k != RESOLVED}
            if resolved:  # a dump (dump_yaml): its preset was applied when it was written
                return data
        return beneath(preset_values(data.get("preset", "nitro"), data.get("env_id", "Hopper-v5")), data)

    @property
    def env_family(self) -> EnvFamily:
        """"image" (a CNN policy; the preset's Atari settings) or "vector" (an MLP policy)."""
        return env_family(self.env_id)

    @model_validator(mode="after")
    def _vm_scalers_need_vm_pricing(self) -> NitroConfig:
        if self.scaler.name in BOOSTS_ON_VMS and self.backend.pricing != "vm":
            raise ValueError(f"backend.pricing: scaler {self.scaler.name} boosts on VMs; set backend.pricing=vm")
        return self

    @model_validator(mode="after")
    def _cnn_fields_on_images(self) -> NitroConfig:
        if self.model.shared_trunk and self.env_family != "image":
            raise ValueError(f"model.shared_trunk: {self.env_id} has vector observations; only a CNN's trunk is shared")
        if self.model.cnn != "paper" and self.env_family != "image":
            raise ValueError(f"model.cnn: {self.env_id} has vector observations; its networks are MLPs (model.hidden)")
        return self

    @model_validator(mode="after")
    def _cluster_reaches_redis(self) -> NitroConfig:
        # The run's own Redis listens on loopback only: a cluster's nodes could not write a batch.
        if self.backend.kind == "ray" and self.backend.ray.address is not None and self.redis.url is None:
            raise ValueError(f"backend.ray.address={self.backend.ray.address!r} needs redis.url: the nodes of a "
                             "Ray cluster cannot reach the run's own Redis, which listens on loopback only")
        return self

    def torch_threads(self) -> int:
        """The learner's torch threads: ``learner_threads``, or its default (see the field)."""
        if self.learner_threads is not None:
            return self.learner_threads
        if self.algo != "ppo" or self.learner.mode != "sync":
            return 1
        limit = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
        return max(1, min(2, int(limit) if limit.isdigit() else os.cpu_count() or 1))

    # -- loading ---------------------------------------------------------------------------

    @model_validator(mode="after")
    def _stellaris_trains_ppo(self) -> NitroConfig:
        if self.learner.mode == "stellaris" and self.algo != "ppo":
            raise ValueError("learner.mode: stellaris computes PPO gradients; set algo=ppo (IMPACT learns while "
                             "acting already, and its replay has no place in a function that sees one slice)")
        if self.learner.mode == "stellaris" and self.backend.pricing == "vm":
            raise ValueError("learner.mode: stellaris bills its learner functions as Lambda; backend.pricing=vm "
                             "has no learner functions")
        return self

    @model_validator(mode="after")
    def _noise_from_the_ppo_learner(self) -> NitroConfig:
        # The fragments' gradients come from PPOLearner.update (nitro/learners/fragments.py) or, under
        # Stellaris, from the learner functions' gradients (nitro/stellaris/round.py).
        if self.scaler.measures_noise and self.algo != "ppo":
            raise ValueError(f"scaler: {self.scaler.name!r} reads the gradient noise PPO's learner measures; "
                             f"algo={self.algo} does not measure it")
        if self.scaler.scale_step and self.learner.mode != "sync":
            raise ValueError("scaler.scale_step scales the sync learner's minibatch steps; learner.mode=stellaris "
                             "steps on groups of slices")
        return self

    @property
    def update_mode(self) -> Literal["sync", "learn-while-acting", "stellaris"]:
        """How a round's policy update meets its actors (``nitro.run.updates``): before them on the
        last round's batches, beside them as their batches land (asynchronous IMPACT), or on
        Stellaris's learner functions."""
        if self.learner.mode == "stellaris":
            return "stellaris"
        return "learn-while-acting" if self.algo == "impact" and self.impact.asynchronous else "sync"

    @classmethod
    def load(cls, data: dict[str, Any] | None = None, overrides: list[str] | None = None) -> NitroConfig:
        """Validate ``data`` with dotted ``key=value`` overrides applied; raise ConfigError."""
        merged = copy.deepcopy(dict(data or {}))  # overrides write into nested dicts: never the caller's
        for item in overrides or []:
            apply_override(merged, item)
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(validation_message(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | None = None) -> NitroConfig:
        return cls.load(read_yaml_mapping(path, "config file") if path is not None else {}, overrides)

    def to_flat_dict(self) -> dict[str, Any]:
        """Dotted keys to plain values: what MLflow logs as params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.model_dump(mode="json", by_alias=True))
        return out

    def dump_yaml(self) -> str:
        """Every field, marked ``resolved: true``. Loaded again (``nitro resume`` reads a run's
        ``config.yaml``), presets fill none of the fields it lacks, those added to Nitro after it was
        written: they take their defaults, which keep what such a run did before they existed."""
        header = ("# Every field of a Nitro config. resolved: true, so a field added to Nitro after this was "
                  "written takes its default, not the preset's value.\n")
        return header + yaml.safe_dump({RESOLVED: True, **self.model_dump(mode="json", by_alias=True)}, sort_keys=False)


def apply_override(data: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. ppo.lr=1e-4)")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value


SpecT = TypeVar("SpecT", bound=BaseModel)


def load_spec_model(source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str], model: type[SpecT],
                    what: str, error: type[ConfigError]) -> tuple[SpecT, str]:
    """A spec of ``model`` (an experiment's, a probe's) from a YAML path or a mapping, with extra
    dotted config ``overrides`` appended to its own; ``error`` (one line naming the first bad
    field) when invalid. Also returns where it came from, for the messages of later checks."""
    if isinstance(source, Mapping):
        data, where = dict(source), what
    else:
        data, where = read_yaml_mapping(source, what, error), str(source)
    if overrides:
        data = {**data, "overrides": list(data.get("overrides") or []) + list(overrides)}
    try:
        return model.model_validate(data), where
    except ValidationError as exc:
        raise error(validation_message(exc, what)) from None


def validation_message(exc: ValidationError, what: str = "config") -> str:
    """A pydantic error as one line naming the first bad field: ``invalid <what>: <field>: <why>``."""
    errors = exc.errors()
    first = errors[0]
    field = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"invalid {what}: {field}: {msg}{more}" if field else f"invalid {what}: {msg}{more}"
