"""Learning: Nitro's PPO through the real pipeline against Stable-Baselines3's PPO, side by side.

    python bench/learning.py                                  # Hopper-v5 and Walker2d-v5, 3 seeds, ~300k steps
    python bench/learning.py --envs Hopper-v5 --seeds 1 --rounds 25     # a quick look
    python bench/learning.py --algo impact                    # another algorithm, same protocol
    python bench/learning.py --envs Humanoid-v5 --steps 1000000 --seeds 1,2   # Humanoid at 1M steps
    python bench/learning.py --envs ALE/Qbert-v5 --steps 250000 --seeds 1 --out learning_ppo_atari.json \
        ppo.anneal_lr=true                                    # an Atari game at 1M frames (250k agent steps)

Nitro runs as ``nitro train`` does (a Prefect flow per round, a local Redis, MLflow, warm local
actor processes) with its defaults, ``scaler.name=fixed`` and ``--actors`` actors per round, and
evaluates its policy on the actors every ``--eval-every`` rounds (whole episodes, the mean action
and sampled actions). SB3's PPO runs with its defaults and ``VecNormalize`` (the reference every
reader knows) in this same process, one env, and is evaluated at the same numbers of training
steps on the same kind of episodes. Both are timed by wall clock, evaluation included.

Nitro's runs are a user's second run and after: one Nitro home and one Prefect home for the
invocation, whose databases (Prefect's and the MLflow store) are migrated before the first timed
run. A first run on a new machine, or in a new home, migrates them first: on a 2-core host a
one-round Hopper run took 35.1 s in a new home against 22.3 s in a used one (3 alternated pairs,
2026-11-29; docs/results/learning-vs-sb3). Likewise, where the runs compile their loss
(``learner_compile``), an untimed 3-round run of each env compiles it first, and the timed runs
find its kernels in inductor's cache on disk, as a user's second run does; ``--cold-compile``
times a first run's compile instead (10-21 s on 2-core hosts, bench/update_step.py).

On an Atari game (``ALE/...``) SB3 runs as the rl-zoo trains Atari: ``CnnPolicy`` on
``make_atari_env`` (its ``AtariWrapper``: 30 no-ops, frame skip 4 with max-pooling, 84x84
grayscale, an episode ended at each lost life, sign-clipped rewards, FIRE pressed at a reset where
the game has it) and a 4-frame stack, 8 envs x 128 steps, 4 epochs of 256-sample minibatches,
learning rate 2.5e-4 and clip 0.1 both annealed linearly to 0, entropy 0.01. The base game is
the same id with ``frameskip=1`` (sticky actions as the id sets them), as Nitro's. Both are
evaluated on whole games (every life, raw score, at most 27,000 agent steps, Nitro's cap), and
the report gives a uniformly random policy's score on the same games beside them. A "step" is an
agent step of 4 frames. ``--sb3-games nitro`` trains SB3 on Nitro's games instead (``nitro_games``:
a new life keeps its frame stack, no FIRE), to tell the games from the learner; ``nitro-fire``
adds the presses SB3's pipeline forces (a no-op after a lost life, then FIRE and UP, scored by the
game but not trained on), to tell those presses from the rest of the games; ``nitro-sb3-life``
adds to those SB3's blank frame stack at each new life, so that only the pooling order differs
from SB3's own pipeline.

A Nitro evaluation in round k scores the policy trained on the k rounds before it (k x actors x
steps env steps), so the checkpoints are the steps trained on at evaluation rounds. Writes
bench/results/learning_<algo>.json: per run, the evaluation returns at each checkpoint, wall time
and env steps per second; per env and checkpoint, mean and 95% CI over seeds for both. Run it
alone on the machine (it records the load average): timings taken beside other work are noise.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from _common import RESULTS, isolated_home, machine, mlflow_uri, run_overrides

if TYPE_CHECKING:
    from nitro.run.result import RunResult

EVAL_EPISODES = 5


def env_slug(env_id: str) -> str:
    """``env_id`` as a part of a run id: "ALE/Qbert-v5" -> "ale-qbert-v5"."""
    return env_id.replace("/", "-").lower()


def run_overrides_for(env_id: str, seed: int, args: argparse.Namespace) -> list[str]:
    """A Nitro run's overrides: the invocation's home, the env, its rounds and seed, the fixed actors."""
    return [*run_overrides(args.home), f"env_id={env_id}", f"algo={args.algo}", f"rounds={args.rounds}",
            f"seed={seed}", "scaler.name=fixed", f"scaler.fixed_actors={args.actors}",
            f"eval.every_rounds={args.eval_every}", f"eval.episodes={EVAL_EPISODES}", *args.overrides]


def run_nitro(run_id: str, overrides: list[str]) -> tuple[RunResult, float]:
    """``nitro train``'s command path (its own temporary Prefect API server, started beside the
    run's set-up): (the run's result, its wall seconds)."""
    from cli.session import run_command
    from flows.training import train
    from nitro.config import NitroConfig

    config = NitroConfig.from_yaml(None, overrides)
    started = time.perf_counter()
    result, _ = run_command(config, run_id, lambda: asyncio.run(train(overrides=overrides, run_id=run_id)))
    return result, time.perf_counter() - started


def warm_compile_cache(env_id: str, args: argparse.Namespace) -> float | None:
    """Where the runs compile their loss (``learner_compile``), a 3-round run of ``env_id``,
    untimed, whose round 1 compiles it: inductor keeps the kernels on disk, as after a user's
    first run, so each timed run pays only the cached compile. Returns its wall seconds (None: the
    runs do not compile)."""
    from nitro.config import NitroConfig
    from nitro.learners.compiled import when_to_compile

    overrides = run_overrides_for(env_id, 0, args)
    config = NitroConfig.from_yaml(None, overrides)
    if config.algo != "ppo" or not when_to_compile(config.learner_compile, config.rounds, bool(config.budget_usd)):
        return None
    _, wall = run_nitro(f"bench-warm-{env_slug(env_id)}", [*overrides, "rounds=3", "learner_compile=true"])
    return round(wall, 1)


def nitro_run(env_id: str, seed: int, args: argparse.Namespace) -> dict:
    """One Nitro training run, as ``nitro train`` runs it; returns its evaluations, wall time and steps."""
    from nitro.run.rundir import RunDir

    run_id = f"bench-learning-{env_slug(env_id)}-{seed}"
    result, wall = run_nitro(run_id, run_overrides_for(env_id, seed, args))
    _, state = RunDir(args.home, run_id).load()
    history = state["history"]
    per_round = history[0]["env_steps"] if history else 0
    evals = [{"trained_steps": int(r["round"]) * int(per_round), "round": int(r["round"]),
              "deterministic": r["eval_return_mean"], "stochastic": r["eval_stochastic_return_mean"],
              "training": last_games_return(history[: i + 1])}
             for i, r in enumerate(history) if r.get("eval_episodes", 0) > 0]
    prefix = f"{args.algo}/"
    updates = [update_size(int(r["round"]) * int(per_round),
                           {name: r.get(prefix + key) for name, (key, _) in UPDATE_SIZE.items()})
               for r in history if prefix + "clip_frac" in r]
    return {"wall_s": round(wall, 1), "env_steps": int(history[-1]["env_steps_total"]),
            "rounds": result.rounds_done, "evals": evals, "updates": updates,
            "median_round_s": sorted(r["round_s"] for r in history)[len(history) // 2]}


def migrate_databases(home) -> None:
    """Prefect's database (in ``PREFECT_HOME``) and the MLflow store of ``home``, migrated as a
    user's first run migrates them, before any run is timed."""
    from mlflow.tracking import MlflowClient

    done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "server", "database", "upgrade", "-y"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"could not migrate Prefect's database: {(done.stderr or done.stdout).strip()[-300:]}")
    MlflowClient(tracking_uri=mlflow_uri(home)).search_experiments()


# How far each update moved the policy, under one name for both learners: (Nitro's diagnostic, SB3's
# logger key). The KLs are both the mean over an update's minibatches of KL(before the step || the
# policy stepped from): Nitro's exact, SB3's its estimator (r - 1) - log r on the minibatch's samples.
UPDATE_SIZE = {"clip_frac": ("clip_frac", "train/clip_fraction"), "kl": ("kl_minibatch_mean", "train/approx_kl"),
               "action_std": ("action_std", "train/std"),
               "explained_variance": ("explained_variance", "train/explained_variance")}


def update_size(trained_steps: int, values: dict) -> dict:
    """One update's ``UPDATE_SIZE`` values (``values`` maps its names to numbers), rounded."""
    return {"trained_steps": trained_steps, **{name: round(float(values[name]), 5) for name in UPDATE_SIZE
                                               if values.get(name) is not None}}


def update_summary(runs: list[dict]) -> dict:
    """Over ``runs``: each ``UPDATE_SIZE`` value's mean over every update, and over the last third."""
    out: dict = {}
    for part, share in (("all", 0), ("last_third", 2 / 3)):
        rows = [u for updates in (r.get("updates", []) for r in runs) for u in updates[int(len(updates) * share):]]
        out[part] = {name: round(sum(u[name] for u in rows if name in u) / n, 4)
                     for name in UPDATE_SIZE if (n := sum(name in u for u in rows))}
    return out


TRAINING_GAMES = 100  # the training curve: the mean return of the last 100 finished episodes, as SB3's ep_info_buffer


def last_games_return(history: list[dict]) -> float | None:
    """The mean whole-episode training return of the last rounds of ``history`` that together
    finished at least TRAINING_GAMES episodes (each round's mean weighted by its episodes)."""
    total, games = 0.0, 0
    for r in reversed(history):
        n = int(r.get("train_episodes", 0))
        if n:
            total, games = total + float(r["train_return_mean"]) * n, games + n
        if games >= TRAINING_GAMES:
            break
    return round(total / games, 1) if games else None


def sb3_run(env_id: str, seed: int, checkpoints: list[int], threads: int = 1, games: str = "sb3") -> dict:
    """SB3 PPO (defaults + VecNormalize; on Atari the rl-zoo's settings, on ``games``' pipeline),
    evaluated at ``checkpoints`` training steps."""
    if env_id.startswith("ALE/"):
        return sb3_atari_run(env_id, seed, checkpoints, threads, games)
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    torch.set_num_threads(threads)  # as many as Nitro's learner (NitroConfig.torch_threads)
    venv = VecNormalize(DummyVecEnv([lambda: gym.make(env_id)]), gamma=0.99)
    model = PPO("MlpPolicy", venv, seed=seed, device="cpu", verbose=0)
    eval_env = gym.make(env_id)

    def evaluate(deterministic: bool) -> float:
        rng = np.random.default_rng([seed, deterministic])
        returns = []
        for _ in range(EVAL_EPISODES):
            obs, _ = eval_env.reset(seed=int(rng.integers(2**31)))
            done, total = False, 0.0
            while not done:
                action, _ = model.predict(venv.normalize_obs(obs), deterministic=deterministic)
                obs, reward, term, trunc, _ = eval_env.step(action)
                total, done = total + float(reward), term or trunc
            returns.append(total)
        return float(np.mean(returns))

    return learn_at_checkpoints(model, checkpoints, evaluate)


def learn_at_checkpoints(model, checkpoints: list[int], evaluate, training=None) -> dict:
    """Train SB3's ``model`` to the last of ``checkpoints``, evaluating it before training and at
    each checkpoint (``evaluate(deterministic)``), with ``training(model)``'s training curve beside
    each evaluation where one is given; timed by wall clock, evaluation included."""
    from stable_baselines3.common.callbacks import BaseCallback

    evals: list[dict] = []
    updates: list[dict] = []

    def record_update(num_timesteps: int) -> None:
        """The last update's values, while SB3's logger holds them (it clears them each dump)."""
        logged = model.logger.name_to_value
        if UPDATE_SIZE["clip_frac"][1] in logged:
            updates.append(update_size(num_timesteps, {name: logged.get(key)
                                                       for name, (_, key) in UPDATE_SIZE.items()}))

    def checkpoint(steps: int) -> None:
        point = {"trained_steps": steps, "deterministic": evaluate(True), "stochastic": evaluate(False)}
        if training is not None:
            point["training"] = training(model) if steps else None
        evals.append(point)

    class Checkpoints(BaseCallback):
        def _on_step(self) -> bool:
            if len(evals) < len(checkpoints) and self.num_timesteps >= checkpoints[len(evals)]:
                checkpoint(self.num_timesteps)
            return True

        # SB3's loop: collect a rollout, dump the logs, train. A rollout's start (and the training's
        # end) is where the update before it is still in the logger.
        def _on_rollout_start(self) -> None:
            record_update(self.num_timesteps)

        def _on_training_end(self) -> None:
            record_update(self.num_timesteps)

    started = time.perf_counter()
    checkpoint(0)
    checkpoints = [0, *checkpoints]
    model.learn(checkpoints[-1], callback=Checkpoints())
    wall = time.perf_counter() - started
    return {"wall_s": round(wall, 1), "env_steps": int(model.num_timesteps), "evals": evals, "updates": updates}


def sb3_atari_run(env_id: str, seed: int, checkpoints: list[int], threads: int, games: str = "sb3") -> dict:
    """SB3 PPO with the rl-zoo's Atari settings (module docstring), evaluated on whole games, on
    SB3's Atari pipeline (``games="sb3"``) or on Nitro's (``"nitro"``, ``nitro_games``; ``"nitro-fire"``
    with the presses SB3's pipeline forces; ``"nitro-sb3-life"`` with those and its blank stack)."""
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    from nitro.envs import make_env
    from nitro.run.invocations import FALLBACK_EPISODE_STEPS  # Nitro's evaluation cap on Atari

    make_env(env_id)  # registers the ALE ids with gymnasium, as Nitro's actors do
    torch.set_num_threads(threads)
    if games != "sb3":
        venv = nitro_games(env_id, n_envs=8, seed=seed, forced_presses=games != "nitro",
                           blank_stack=games == "nitro-sb3-life")
        eval_env = nitro_games(env_id, 1, seed + 10_000, whole=True)
    else:
        game = {"frameskip": 1}  # AtariWrapper skips the frames itself
        venv = VecFrameStack(make_atari_env(env_id, n_envs=8, seed=seed, env_kwargs=game), n_stack=4)
        whole_games = {"terminal_on_life_loss": False, "clip_reward": False}
        eval_env = VecFrameStack(make_atari_env(env_id, n_envs=1, seed=seed + 10_000, env_kwargs=game,
                                                wrapper_kwargs=whole_games), n_stack=4)

    def linear(start: float):
        return lambda progress_remaining: start * progress_remaining

    model = PPO("CnnPolicy", venv, n_steps=128, n_epochs=4, batch_size=256, learning_rate=linear(2.5e-4),
                clip_range=linear(0.1), vf_coef=0.5, ent_coef=0.01, seed=seed, device="cpu", verbose=0)

    def evaluate(deterministic: bool) -> float:
        returns = []
        for _ in range(EVAL_EPISODES):
            obs, total = eval_env.reset(), 0.0
            for _ in range(FALLBACK_EPISODE_STEPS):
                action, _ = model.predict(obs, deterministic=deterministic)
                obs, reward, done, _ = eval_env.step(action)
                total += float(reward[0])
                if done[0]:
                    break
            returns.append(total)
        return float(np.mean(returns))

    def training(model) -> float | None:
        # Monitor sits beneath AtariWrapper: ep_info_buffer holds the last 100 whole games, raw score
        games = [float(info["r"]) for info in model.ep_info_buffer or []]
        return round(float(np.mean(games)), 1) if games else None

    result = learn_at_checkpoints(model, checkpoints, evaluate, training)
    if games != "nitro":  # how much of the training curve the forced presses scored
        result["forced_presses"] = venv.env_method("forced_tally")
    return result


def nitro_games(env_id: str, n_envs: int, seed: int, whole: bool = False, forced_presses: bool = False,
                blank_stack: bool = False):
    """SB3's vector env of ``n_envs`` games played as Nitro's actors play them (``make_env``'s
    preprocessing, ``rollout_games``' episodes): a lost life ends a training episode while the game
    goes on from the same frame stack, with no FIRE pressed, and rewards are sign-clipped; where
    SB3's pipeline zeroes the stack and presses FIRE then UP after each lost life. ``whole``: whole
    games, raw score (evaluation). Monitor sits beneath, so ``ep_info_buffer`` holds whole games.

    ``forced_presses``: the presses SB3's ``EpisodicLifeEnv`` and ``FireResetEnv`` make where the
    game's second action is FIRE, outside the agent's steps: a no-op at the start of a new life,
    then FIRE (action 1) and action 2 at every start, a game that ends during them started anew.
    Monitor counts their points, as in SB3's pipeline; ``forced_tally`` says how many.
    ``blank_stack``: a new life or game is seen as SB3's ``VecFrameStack`` shows it after an episode
    end, its older frames blank until its own fill the stack."""
    import gymnasium as gym
    import numpy as np
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    from nitro.envs import make_env

    class LostLifeEndsEpisode(gym.Wrapper):
        def __init__(self, env: gym.Env):
            super().__init__(env)
            self.lives, self.game_over, self.last_obs = 0, True, None
            meanings = env.unwrapped.get_action_meanings()
            self.presses = forced_presses and len(meanings) >= 3 and meanings[1] == "FIRE"
            self.points, self.steps = 0.0, 0  # what the forced presses scored, and how many there were
            self.since_start = 0  # agent steps since the life or game started

        def reset(self, **kwargs):
            new_game = self.game_over
            if new_game:
                self.last_obs, _ = self.env.reset(**kwargs)
            if self.presses:
                for action in ((1, 2) if new_game else (0, 1, 2)):
                    self.last_obs, reward, terminated, truncated, _ = self.env.step(action)
                    self.points, self.steps = self.points + float(reward), self.steps + 1
                    if terminated or truncated:
                        self.last_obs, _ = self.env.reset(**kwargs)
            self.lives, self.game_over, self.since_start = self.env.unwrapped.ale.lives(), False, 0
            return self.blanked(self.last_obs), {}

        def blanked(self, obs):
            older = len(obs) - 1 - self.since_start  # frames from before this life started
            if not blank_stack or older <= 0:
                return obs
            obs = obs.copy()
            obs[:older] = 0
            return obs

        def forced_tally(self) -> dict:
            return {"points": self.points, "steps": self.steps}

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            lives = self.env.unwrapped.ale.lives()
            lost, self.lives = lives < self.lives, lives
            self.game_over, self.last_obs, self.since_start = terminated or truncated, obs, self.since_start + 1
            return self.blanked(obs), float(np.sign(reward)), terminated or lost, truncated, info

    def one() -> gym.Env:
        game = Monitor(make_env(env_id))
        return game if whole else LostLifeEndsEpisode(game)

    venv = DummyVecEnv([one] * n_envs)
    venv.seed(seed)  # game i from seed + i at its first reset, as make_atari_env seeds them
    return venv


def random_score(env_id: str, episodes: int = 10) -> dict:
    """A uniformly random policy's whole-episode return on Nitro's preprocessed env (Atari: every
    life, raw score, at most Nitro's evaluation cap of agent steps)."""
    import numpy as np

    from nitro.envs import make_env
    from nitro.run.invocations import FALLBACK_EPISODE_STEPS

    env = make_env(env_id, seed=0)
    returns = []
    for episode in range(episodes):
        env.reset(seed=episode)
        total = 0.0
        for _ in range(FALLBACK_EPISODE_STEPS):
            _, reward, term, trunc, _ = env.step(env.action_space.sample())
            total += float(reward)
            if term or trunc:
                break
        returns.append(total)
    return {"episodes": episodes, "mean": round(float(np.mean(returns)), 1),
            "values": [round(r, 1) for r in returns]}


def summarize(runs: list[dict], key: str) -> list[dict]:
    """Per checkpoint: mean and 95% CI over seeds of the ``key`` return (evaluation, or the
    training curve where a checkpoint has one)."""
    from nitro.tracking.plots import mean_ci95

    out = []
    for i, point in enumerate(runs[0]["evals"]):
        values = [r["evals"][i].get(key) for r in runs if i < len(r["evals"])]
        values = [v for v in values if v is not None]
        if not values:
            continue
        mean, half = mean_ci95(values)
        out.append({"trained_steps": point["trained_steps"], "mean": round(mean, 1), "ci95": round(half, 1),
                    "values": [round(v, 1) for v in values]})
    return out


def evaluations(run: dict) -> str:
    """A run's evaluations for its progress line: trained steps, deterministic / stochastic return."""
    return ", ".join(f"{e['trained_steps']}: {e['deterministic']:.0f}/{e['stochastic']:.0f}" for e in run["evals"])


def write_report(report: dict, out) -> None:
    """Write ``report``, keeping the envs of an earlier run of the same protocol that this one did
    not run (so Hopper and Walker2d can be run one invocation at a time)."""
    report = {**report, "load_average_after": os.getloadavg(), "machine": machine()}
    if out.exists():
        old = json.loads(out.read_text())
        same = all(old.get(k) == report[k] for k in ("algo", "actors", "steps_per_round", "rounds", "overrides")) \
            and old.get("sb3_games", "sb3") == report["sb3_games"]  # reports before --sb3-games are SB3's games
        if same:
            report["envs"] = {**{k: v for k, v in old.get("envs", {}).items() if k not in report["envs"]},
                              **report["envs"]}
    out.write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="ppo")
    parser.add_argument("--envs", default="Hopper-v5,Walker2d-v5")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300_000, help="training env steps (default 300k)")
    parser.add_argument("--rounds", type=int, default=None, help="default: as many as --steps need, +1")
    parser.add_argument("--eval-every", type=int, default=None, help="default: a third of the rounds")
    parser.add_argument("--no-sb3", action="store_true", help="skip the SB3 reference runs")
    parser.add_argument("--cold-compile", action="store_true",
                        help="time a first run's compile: no untimed run fills inductor's cache first")
    parser.add_argument("--no-nitro", action="store_true", help="SB3 alone, evaluated where Nitro's runs would be "
                                                                 "(its update sizes beside an earlier Nitro run's)")
    parser.add_argument("--sb3-games", choices=("sb3", "nitro", "nitro-fire", "nitro-sb3-life"), default="sb3",
                        help="Atari: SB3 plays on its own pipeline (AtariWrapper) or on Nitro's (nitro_games; "
                             "nitro-fire: with the presses SB3's pipeline forces after a lost life; "
                             "nitro-sb3-life: with those and its blank frame stack at a new life)")
    parser.add_argument("--out", default=None, help="file under bench/results/ (default: learning_<algo>.json); "
                                                    "a trial of other settings writes beside the reference")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for Nitro, key=value")
    args = parser.parse_args()
    if args.no_sb3 and args.no_nitro:
        parser.error("--no-sb3 and --no-nitro leave nothing to run")
    if not args.no_sb3 and importlib.util.find_spec("stable_baselines3") is None:  # before hours of Nitro's runs
        parser.error("Stable-Baselines3 is not installed: .venv/bin/pip install -e '.[bench]' (or pass --no-sb3)")
    args.home = isolated_home("learning")
    migrate_databases(args.home)
    from nitro.config import NitroConfig
    from nitro.run.invocations import is_eval_round

    config = NitroConfig.load(overrides=[f"env_id={args.envs.split(',')[0]}", *args.overrides])
    steps_per_round = args.actors * config.steps_per_actor
    if args.rounds is None:
        args.rounds = -(-args.steps // steps_per_round) + 1  # the last round's policy has seen >= --steps
    if args.eval_every is None:
        args.eval_every = (args.rounds - 1) // 3
    # Nitro's evaluation schedule, for SB3's checkpoints where Nitro does not run beside it
    schedule = config.model_copy(update={"rounds": args.rounds,
                                         "eval": config.eval.model_copy(update={"every_rounds": args.eval_every})})
    load_before = os.getloadavg()
    report: dict = {"algo": args.algo, "sb3_games": args.sb3_games, "actors": args.actors,
                    "steps_per_round": steps_per_round,
                    "rounds": args.rounds, "eval_every": args.eval_every, "eval_episodes": EVAL_EPISODES,
                    "overrides": args.overrides, "load_average_before": load_before, "envs": {}}
    out = RESULTS / (args.out or f"learning_{args.algo}.json")
    for env_id in args.envs.split(","):
        nitro_runs, sb3_runs = [], []
        warm_s = None if args.no_nitro or args.cold_compile else warm_compile_cache(env_id, args)
        if warm_s is not None:
            print(f"nitro {env_id}: inductor's cache filled by an untimed 3-round run ({warm_s} s)", flush=True)
        for seed in (int(s) for s in args.seeds.split(",")):
            checkpoints = [k * steps_per_round for k in range(1, args.rounds) if is_eval_round(schedule, k)]
            if not args.no_nitro:
                run = {"seed": seed, **nitro_run(env_id, seed, args)}
                nitro_runs.append(run)
                print(f"nitro {env_id} seed {seed}: {run['env_steps']} steps in {run['wall_s']} s, evaluations "
                      + evaluations(run), flush=True)
                checkpoints = [e["trained_steps"] for e in run["evals"] if e["trained_steps"] > 0]
            if not args.no_sb3:
                ref = {"seed": seed, **sb3_run(env_id, seed, checkpoints, config.torch_threads(), args.sb3_games)}
                sb3_runs.append(ref)
                print(f"sb3   {env_id} seed {seed}: {ref['env_steps']} steps in {ref['wall_s']} s, evaluations "
                      + evaluations(ref), flush=True)
        entry: dict = {"nitro": {"runs": nitro_runs, "compile_cache_filled_s": warm_s}, "sb3": {"runs": sb3_runs}}
        if env_id.startswith("ALE/"):
            entry["random"] = random_score(env_id)
            print(f"random {env_id}: {entry['random']['mean']} over {entry['random']['episodes']} whole games",
                  flush=True)
        for name, runs in (("nitro", nitro_runs), ("sb3", sb3_runs)):
            if not runs:
                continue
            wall = sum(r["wall_s"] for r in runs) / len(runs)
            steps = sum(r["env_steps"] for r in runs) / len(runs)
            entry[name].update({"deterministic": summarize(runs, "deterministic"),
                                "stochastic": summarize(runs, "stochastic"), "training": summarize(runs, "training"),
                                "wall_s_mean": round(wall, 1), "env_steps_per_s": round(steps / wall, 1),
                                "update_size": update_summary(runs)})
        report["envs"][env_id] = entry
        write_report(report, out)  # after each env: a long run keeps what it has
    for env_id, entry in report["envs"].items():
        for name in ("nitro", "sb3"):
            if "deterministic" not in entry[name]:
                continue
            det, sto = entry[name]["deterministic"], entry[name]["stochastic"]
            cells = "  ".join(f"{d['trained_steps'] // 1000}k: {d['mean']:.0f}±{d['ci95']:.0f} "
                              f"/ {s['mean']:.0f}±{s['ci95']:.0f}" for d, s in zip(det, sto) if d["trained_steps"])
            print(f"{env_id:12s} {name:5s} eval return (deterministic / stochastic, mean ± 95% CI): {cells}; "
                  f"{entry[name]['wall_s_mean']:.0f} s per run, {entry[name]['env_steps_per_s']:.0f} env steps/s")
            moved = entry[name]["update_size"]["last_third"]
            if moved:
                print(f"{'':12s} {name:5s} an update in the last third of the run, mean: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in moved.items()))
    print(f"load average before {load_before}, after {os.getloadavg()}; wrote {out}")


if __name__ == "__main__":
    main()
