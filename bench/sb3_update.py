"""Nitro's PPO update against Stable-Baselines3's, from the same weights on the same data.

    python bench/sb3_update.py                      # SpaceInvaders, both layouts, 3 rollouts each
    python bench/sb3_update.py --env ALE/Gravitar-v5 --reps 2

SB3's ``PPO("CnnPolicy")`` with the rl-zoo's Atari settings (clip range fixed at 0.1 here, as the
``nitro`` preset's) collects 128 steps in 8 games; Nitro's learner (the ``nitro`` preset with
``model.cnn=nature``: SB3's ``NatureCNN``) is handed SB3's weights and the same steps as 8 actor
batches. Per rollout it prints and records:

* the largest difference between the two learners' GAE advantages;
* the loss of one 256-row minibatch (the same rows) under each learner's code, and how far
  Nitro's gradient is from SB3's, per part of the network (relative L2 distance);
* one whole update each (4 epochs of 256-row minibatches, each from a fresh Adam): the exact KL
  from the policy before the update to the one after it over the rollout, and the clipped fraction.

Layouts: ``shared`` (one trunk, SB3's default, ``model.shared_trunk=true``) and ``separate``
(a trunk each, SB3's ``share_features_extractor=False``, ``model.shared_trunk=false``). Nitro
clips the policy's and the critic's gradients separately and SB3 clips one norm over both, so in
the separate layout the updates may differ by that; the gradients before clipping may not.
Writes bench/results/<--out>.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from _common import RESULTS, machine

# Nitro's parameter -> SB3's, by the module that holds it (``.weight`` / ``.bias`` follow).
NATURE_CNN = {"0.net.0": "cnn.0", "0.net.2": "cnn.2", "0.net.4": "cnn.4", "0.net.7": "linear.0"}
SHARED = {**{f"policy.body.{k}": f"features_extractor.{v}" for k, v in NATURE_CNN.items()},
          "policy.body.1": "action_net", "critic.net": "value_net"}
SEPARATE = {**{f"policy.body.{k}": f"pi_features_extractor.{v}" for k, v in NATURE_CNN.items()},
            **{f"critic.net.{k}": f"vf_features_extractor.{v}" for k, v in NATURE_CNN.items()},
            "policy.body.1": "action_net", "critic.net.1": "value_net"}
# The parts whose gradients are compared: Nitro's parameters whose names start so.
PARTS = {"policy trunk": "policy.body.0.", "policy head": "policy.body.1.", "value head": ("critic.net.weight",
         "critic.net.bias", "critic.net.1."), "critic trunk": "critic.net.0."}


def relative_distance(ours: list, theirs: list) -> float:
    import torch

    a, b = torch.cat([t.flatten() for t in ours]), torch.cat([t.flatten() for t in theirs])
    return float((a - b).norm() / b.norm())


def layout_reps(env_id: str, layout: str, reps: int, seed: int) -> list[dict]:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack
    from torch.nn import functional as F

    from nitro.config import NitroConfig
    from nitro.envs import make_env
    from nitro.learners import make_learner
    from nitro.learners.objective import kl_penalty

    make_env(env_id)  # registers the ALE ids with gymnasium
    shared = layout == "shared"
    config = NitroConfig.load({"env_id": env_id, "seed": seed}, ["model.cnn=nature", f"model.shared_trunk={shared}"])
    ppo = config.ppo
    venv = VecFrameStack(make_atari_env(env_id, n_envs=8, seed=seed, env_kwargs={"frameskip": 1}), n_stack=4)
    model = PPO("CnnPolicy", venv, n_steps=128, n_epochs=ppo.epochs, batch_size=ppo.minibatch_size,
                learning_rate=ppo.lr, clip_range=ppo.clip, vf_coef=ppo.vf_coef, ent_coef=ppo.entropy_coef,
                max_grad_norm=ppo.max_grad_norm, gamma=ppo.gamma, gae_lambda=ppo.gae_lambda, seed=seed,
                device="cpu", verbose=0, policy_kwargs={"share_features_extractor": shared})
    names = SHARED if shared else SEPARATE
    _, callback = model._setup_learn(10**9, None)
    callback.on_training_start(locals(), globals())
    rb = model.rollout_buffer

    def sb3_param(name: str) -> torch.nn.Parameter:
        module, kind = name.rsplit(".", 1)
        return model.policy.get_parameter(f"{names[module]}.{kind}")

    def distribution(policy, obs: np.ndarray) -> torch.distributions.Categorical:
        with torch.no_grad():
            return policy(torch.as_tensor(obs))

    def sb3_policy(obs: torch.Tensor):
        return model.policy.get_distribution(obs.float()).distribution

    def flat(a: np.ndarray) -> np.ndarray:  # (steps, envs, ...) -> env-major rows, as Nitro's batches
        return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])

    out = []
    for rep in range(reps):
        model.collect_rollouts(model.env, callback, rb, n_rollout_steps=128)
        batches = []
        for j in range(8):
            starts = rb.episode_starts[:, j].astype(bool)
            terminated = np.append(starts[1:], bool(model._last_episode_starts[j]))
            ends_mid_game = not terminated[-1]
            batches.append({
                "obs": rb.observations[:, j].astype(np.uint8), "actions": rb.actions[:, j, 0].astype(np.int64),
                "logp": rb.log_probs[:, j].astype(np.float32), "rewards": rb.rewards[:, j].astype(np.float32),
                "terminated": terminated, "bootstrap_idx": np.array([127] if ends_mid_game else [], np.int64),
                "bootstrap_obs": model._last_obs[j:j + 1].astype(np.uint8) if ends_mid_game
                else np.empty((0, 4, 84, 84), np.uint8)})
        learner = make_learner(config)
        with torch.no_grad():
            for name, p in learner.parameter_names().items():
                p.copy_(sb3_param(name))
        obs = flat(rb.observations).astype(np.uint8)
        before = distribution(sb3_policy, torch.as_tensor(obs))
        assert torch.allclose(distribution(learner.policy.distribution, obs).logits, before.logits, atol=1e-4), \
            "weights not copied"

        # One minibatch, the same rows, each learner's loss and gradient.
        data = learner.prepare(batches)
        rows = np.arange(0, len(obs), len(obs) // ppo.minibatch_size)[:ppo.minibatch_size]
        idx = torch.as_tensor(rows)
        loss, _ = learner.minibatch_loss(learner.policy, learner.critic, data, idx, clip=ppo.clip, kl_coef=0.0,
                                         vf_clip=ppo.vf_clip, vf_coef=ppo.vf_coef, entropy_coef=ppo.entropy_coef)
        learner.optimizer.zero_grad()
        loss.backward()
        values, logp, entropy = model.policy.evaluate_actions(torch.as_tensor(flat(rb.observations)[rows]),
                                                              torch.as_tensor(flat(rb.actions)[rows, 0]).long())
        adv = torch.as_tensor(flat(rb.advantages)[rows])
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # PPO.train's normalisation
        ratio = torch.exp(logp - torch.as_tensor(flat(rb.log_probs)[rows]))
        surrogate = -torch.min(adv * ratio, adv * torch.clamp(ratio, 1 - ppo.clip, 1 + ppo.clip)).mean()
        sb3_loss = (surrogate - ppo.entropy_coef * entropy.mean()
                    + ppo.vf_coef * F.mse_loss(torch.as_tensor(flat(rb.returns)[rows]), values.flatten()))
        model.policy.zero_grad()
        sb3_loss.backward()
        gradients = {}
        for part, prefix in PARTS.items():
            ours = [(n, p) for n, p in learner.parameter_names().items() if n.startswith(prefix)]
            if ours:
                gradients[part] = relative_distance([p.grad for _, p in ours], [sb3_param(n).grad for n, _ in ours])
        learner.optimizer.zero_grad()
        model.policy.zero_grad()

        # One whole update each, from the same weights and a fresh Adam.
        model.policy.optimizer = model.policy.optimizer_class(model.policy.parameters(), lr=ppo.lr,
                                                              **model.policy.optimizer_kwargs)
        model.train()
        sb3_after = distribution(sb3_policy, torch.as_tensor(obs))
        result = learner.update(batches)
        nitro_after = distribution(learner.policy.distribution, obs)
        row = {
            "rollout": rep, "rewards": float(rb.rewards.sum()), "lost_lives_or_games": int(rb.episode_starts[1:].sum()),
            "gae_max_abs_diff": float(np.abs(data.advantages.numpy() - flat(rb.advantages)).max()),
            "advantage_std": float(rb.advantages.std()),
            "minibatch_loss": {"sb3": sb3_loss.item(), "nitro": loss.item()},
            "gradient_relative_distance": gradients,
            "update_kl": {"sb3": float(kl_penalty(before, sb3_after)), "nitro": float(kl_penalty(before, nitro_after))},
            "update_clip_frac": {"sb3": float(model.logger.name_to_value["train/clip_fraction"]),
                                 "nitro": float(result.diagnostics["clip_frac"])},
        }
        print(f"{env_id} {layout} rollout {rep}: GAE max |diff| {row['gae_max_abs_diff']:.1e}; minibatch loss "
              f"SB3 {sb3_loss.item():.6f} Nitro {loss.item():.6f}; gradient distance "
              + ", ".join(f"{k} {v:.1e}" for k, v in gradients.items())
              + f"; update KL SB3 {row['update_kl']['sb3']:.5f} Nitro {row['update_kl']['nitro']:.5f}, clipped "
              f"{row['update_clip_frac']['sb3']:.3f} / {row['update_clip_frac']['nitro']:.3f}", flush=True)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="ALE/SpaceInvaders-v5")
    parser.add_argument("--layouts", default="shared,separate")
    parser.add_argument("--reps", type=int, default=3, help="rollouts (and updates) per layout")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="sb3_update.json", help="file under bench/results/")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    layouts = {layout: layout_reps(args.env, layout, args.reps, args.seed) for layout in args.layouts.split(",")}
    report = {"benchmark": "sb3_update", "env": args.env, "seed": args.seed, "layouts": layouts,
              "machine": machine(load_avg_before=load_before, load_avg_after=os.getloadavg())}
    out = RESULTS / args.out
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
