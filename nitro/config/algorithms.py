"""The algorithms' sections of the config: PPO's and IMPACT's hyperparameters, the MLP's shape."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nitro.config.backend import Section


class PPOConfig(Section):
    """PPO hyperparameters (paper Table 1, RLlib's tuned examples)."""

    lr: float = Field(5e-5, gt=0)
    anneal_lr: bool = Field(False, description="decay lr linearly towards 0 over the run's rounds, as CleanRL's PPO; "
                            "off in both presets: it halved Hopper's return at 300k (docs/tuning.md)")
    gamma: float = Field(0.99, gt=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip: float = Field(0.3, gt=0)
    kl_coef: float = Field(0.2, ge=0)
    kl_target: float = Field(0.01, gt=0)
    entropy_coef: float = Field(0.0, ge=0)
    vf_coef: float = Field(1.0, ge=0)
    vf_clip: float = Field(10.0, gt=0, description="clip of the value loss, in (scaled) reward units")
    epochs: int = Field(10, ge=1)
    minibatch_size: int = Field(128, ge=1)
    minibatches: int | None = Field(None, ge=1, description=(
        "minibatches per epoch whatever the round's samples, so an update takes epochs x minibatches "
        "Adam steps and a boosted round's bigger batch makes bigger minibatches, not more of them; "
        "None: minibatches of minibatch_size samples"))
    max_grad_norm: float = Field(0.5, gt=0)
    normalize_rewards: bool = True


class ImpactConfig(Section):
    """IMPACT hyperparameters (paper Table 1)."""

    lr: float = Field(5e-4, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    clip: float = Field(0.4, gt=0)
    kl_coef: float = Field(1.0, ge=0)
    kl_target: float = Field(0.01, gt=0)
    entropy_coef: float = Field(0.01, ge=0)
    vf_coef: float = Field(1.0, ge=0)
    target_update_freq: int = Field(1, ge=1)
    rho_bar: float = Field(1.0, gt=0)
    c_bar: float = Field(1.0, gt=0)
    replay_capacity: int = Field(16, ge=1, description="batches held in the circular replay buffer")
    replay_max_reuse: int = Field(2, ge=1, description="K: each batch is trained on at most K times")
    minibatch_size: int = Field(512, ge=1)
    max_grad_norm: float = Field(0.5, gt=0)
    epochs: int = Field(2, ge=1, description="passes over each update's data (new + replayed batches)")
    replay_ratio: float = Field(1.0, ge=0, description="replayed batches per new batch in an update")
    vtrace_lambda: float = Field(1.0, ge=0, le=1, description="lambda in V-trace's trace cutters "
                                 "c_i = lambda * min(c_bar, pi/mu); 1 is the paper's V-trace")
    normalize_rewards: bool = Field(True, description="divide rewards by the running std of discounted "
                                    "returns, as PPO does")
    replay_checkpoint_max_bytes: int = Field(64 * 1024 * 1024, ge=0, description="checkpoints include the "
                                             "replay buffer's batches up to this size, else drop them")
    asynchronous: bool = Field(True, description="update while the round's actors run (paper §4); "
                               "False: update on the previous round's batches first, like PPO")


class ModelConfig(Section):
    """The MLP's shape for vector observations; for image observations, which CNN and whether the
    critic has a trunk of its own."""

    hidden: list[int] = Field(default_factory=lambda: [256, 256], min_length=1, description="hidden layer widths")
    activation: Literal["tanh", "relu"] = "tanh"
    log_std_init: float = Field(0.0, description="initial log standard deviation of the Gaussian policy")
    shared_trunk: bool = Field(False, description="image envs only: the critic is a value head on the policy's "
                               "CNN trunk (SB3's and CleanRL's Atari PPO); false: a critic of the policy's shape, "
                               "as the paper")
    cnn: Literal["paper", "nature"] = Field("paper", description="image envs only: the CNN trunk; paper: "
                                            "RLlib's 84x84 filters, 256 features (the paper's); nature: DQN's "
                                            "Nature CNN, 512 features (SB3's and CleanRL's)")

    def architecture(self):
        from nitro.models import Architecture

        return Architecture(hidden=tuple(self.hidden), activation=self.activation, log_std_init=self.log_std_init,
                            shared_trunk=self.shared_trunk, cnn=self.cnn)
