"""MinionsRL's settings: how a run deploys a pre-trained scheduler (``scaler.minionsrl``) and how
``nitro minionsrl pretrain`` trains one (``PretrainConfig``), with the scheduler code's values as
defaults (docs/decisions.md, "MinionsRL")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MinionsRLConfig(_Strict):
    """A run's use of a pre-trained MinionsRL scheduler (``scaler.name: minionsrl``)."""

    path: str | None = Field(None, description="the scheduler's safetensors file (`nitro minionsrl pretrain`)")
    greedy: bool = Field(False, description="pick the most probable actor count; the code samples even when "
                         "deployed (false), the notes recommend greedy (true)")
    mask_out_of_range: bool = Field(False, description="give counts outside [I_min, I_max] no probability; the "
                                    "code samples over all counts and clips (false)")


class SimulatorConfig(_Strict):
    """The surrogate training run the scheduler is pre-trained on (``nitro.scaling.minionsrl.simulator``).
    By default its shape is an assumption: the return a round gains peaks at ``peak_actors``; its
    times follow the Lambda-projected clock with the per-sample and per-step costs measured here.
    ``nitro minionsrl pretrain --fit-from`` fits the gain curve, noise and learner times to logged
    runs instead (``nitro.scaling.minionsrl.fit``)."""

    rounds: int = Field(50, ge=1, description="rounds of one simulated run (the code's stop_max_round)")
    steps_per_actor: int = Field(256, ge=1)
    peak_actors: float = Field(32.0, gt=0, description="the actor count at which a round's return gain peaks")
    peak_gain: float = Field(20.0, ge=0, description="return gained by a round at the peak")
    width: float = Field(16.0, gt=0, description="actors from the peak at which the gain falls to 1/e")
    noise: float = Field(0.2, ge=0, description="relative noise of a round's gain")
    learner_fixed_s: float = Field(0.5, ge=0, description="a round's learner time before its samples")
    learner_s_per_sample: float = Field(0.0012, ge=0, description="PPO 2x256 on one core (nitro/scaling/budget.py)")
    actor_s_per_step: float = Field(0.00025, ge=0, description="Hopper with a 2x256 forward, ~4k steps/s")
    memory_mb: int = Field(1024, ge=128)
    fitted_from: str = Field("", description="the rounds.csv the fields above were fitted from (--fit-from); "
                             "empty: the assumed shape")


class PretrainConfig(_Strict):
    """``nitro minionsrl pretrain``: the meta-PPO of the scheduler's code on the simulator."""

    episodes: int = Field(100, ge=1, description="whole simulated training runs (the code's max_episode_train)")
    seed: int = Field(0, ge=0)
    n_actions: int = Field(64, ge=1, description="the network's actor counts 1..n_actions (the code's 64 logits)")
    i_min: int = Field(8, ge=1)
    i_max: int = Field(64, ge=1)
    hidden: int = Field(64, ge=1, description="two tanh layers of this width, actor and critic apart")
    lr: float = Field(1e-3, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    clip: float = Field(0.2, gt=0)
    vf_coef: float = Field(0.5, ge=0)
    entropy_coef: float = Field(0.01, ge=0)
    beta: float = Field(0.1, ge=0, description="reward per round: -beta x the round's seconds on the clock")
    target_return: float = Field(600.0, description="R*: a run ending below it adds (best return - R*); Hopper's")
    budget_usd: float = Field(1.0, gt=0, description="each simulated run's budget: a state feature and a stop")
    normalize_state: bool = Field(False, description="running mean/std of the 8 features (the notes' deviation); "
                                  "the code feeds them raw")
    mask_out_of_range: bool = False
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)

    @model_validator(mode="after")
    def _bounds(self) -> PretrainConfig:
        if not self.i_min <= self.i_max <= self.n_actions:
            raise ValueError(f"need i_min <= i_max <= n_actions, got {self.i_min}, {self.i_max}, {self.n_actions}")
        return self
