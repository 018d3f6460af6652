"""Atari actors on one core against ``ale.act`` alone (the P2 ratio for Atari), and the learner's
samples/s for the CNN's PPO update on this CPU (issue 49, item 1); ``--cnn`` names the CNN
(``model.cnn``: the paper's, or the Nature CNN).

Everything runs in this one process with one torch thread (OMP_NUM_THREADS=1), so each number is
what one core does. An env step is an agent step: FRAME_SKIP (4) emulator frames. Per game
(Qbert, SpaceInvaders, Gravitar: the emulators are configured as their ``ALE/...-v5`` ids say,
sticky actions 0.25 included), each repeat measures, in this order, on the same number of steps:

* ale_act: a bare ``ale_py.ALEInterface`` doing 4 ``ale.act`` per step with uniformly random
  actions (drawn beforehand), ``reset_game`` at game over. No screen is read. The denominator.
* make_env: ``nitro.envs.make_env`` (gymnasium's AtariPreprocessing and frame stack) stepped with
  random actions; make_env_cnn: the same env acted on by ``rollout_env`` with the CNN, one
  observation per forward (how a per-env actor would act).
* games_env: ``nitro.envs.AtariGames`` of E games stepped with random actions (the actor's env
  side alone: emulation, screens, max-pool, resize, frame stack).
* actor: ``nitro.actors.rollout.rollout`` over E games, as a warm worker calls it: the same policy
  games every invocation, the acting policy built from the weights each time, each invocation of steps_per_actor
  steps continuing the episodes the last one left (snapshots restored and taken). Redis and
  serialisation are not in it. A second, instrumented pass (``rollout_games`` with timed games and
  CNN) splits its time into env (step, reset, snapshot restore and state), policy (the batched
  forward, and the Gumbel sampling beside it), preparing the policy (weights, CNNActor), and the
  rest (the rollout's bookkeeping).
* ale_vector_env: ale-py's ``AtariVectorEnv`` with the largest E, one worker thread, the same
  preprocessing (no-op starts, max-pool, 84x84 grayscale, 4 frames; no fire reset, no reward
  clipping), random actions. envpool: envpool's Atari env, the same E, thread and preprocessing,
  where envpool is installed (it is not a dependency: ``pip install envpool``).

P2 = actor env-steps/s / ale_act env-steps/s per game and E, from the medians (goal: >= 0.8).

The learner: ``bench/gpu_timing.py``'s helpers on the CPU alone: ``--actors`` actor batches of the
nitro preset's shape (steps_per_actor steps over envs_per_actor games), then one untimed update and
``--learner-repeats`` timed updates (and detections) with ``learner_threads`` torch threads.

Usage:  python bench/atari_actor.py [--quick] [--games Qbert,SpaceInvaders,Gravitar] [--envs 1,4,8]
                                    [--steps 4096] [--repeats 3] [--actors 8] [--cnn paper]
                                    [--out PATH]
        --quick: a smoke test in under a minute (256 steps, one repeat, 2 learner batches);
        its numbers are noisy. Default PATH: bench/results/atari_actor.json (--quick:
        atari_actor_quick.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from importlib import util
from importlib.metadata import version
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"  # one core: set before numpy and torch start their thread pools

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ale_py  # noqa: E402  # after the thread settings above
import cv2  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import machine  # noqa: E402
from gpu_timing import batches_for, time_device  # noqa: E402

from nitro.actors.rollout import games_for, rollout, rollout_env, rollout_games  # noqa: E402
from nitro.config import NitroConfig  # noqa: E402
from nitro.envs import FRAME_SKIP, NOOP_MAX, AtariGames, env_spec, make_env  # noqa: E402
from nitro.models import Architecture  # noqa: E402
from nitro.models.acting import acting_policy  # noqa: E402
from nitro.models.networks import build_policy  # noqa: E402

GAMES = ("Qbert", "SpaceInvaders", "Gravitar")
P2_TARGET = 0.8


def emulator_kwargs(env_id: str) -> dict[str, Any]:
    """The ROM and emulator settings of ``env_id``'s registration (ale-py's gymnasium ids)."""
    gym.register_envs(ale_py)
    return dict(gym.spec(env_id).kwargs or {})


def ale_act(env_id: str, steps: int, seed: int) -> float:
    """Env steps/s of a bare emulator: FRAME_SKIP ``ale.act`` per step, random actions."""
    kw = emulator_kwargs(env_id)
    ale = ale_py.ALEInterface()
    ale.setLoggerMode(ale_py.LoggerMode.Error)
    ale.setInt("random_seed", seed)
    ale.setFloat("repeat_action_probability", float(kw.get("repeat_action_probability", 0.25)))
    ale.setInt("max_num_frames_per_episode", int(kw.get("max_num_frames_per_episode", 108_000)))
    ale.loadROM(ale_py.roms.get_rom_path(kw["game"]))
    action_set = ale.getMinimalActionSet()
    actions = [action_set[i] for i in np.random.default_rng(seed).integers(len(action_set), size=steps)]
    start = time.perf_counter()
    for action in actions:
        for _ in range(FRAME_SKIP):
            ale.act(action, 1.0)
        if ale.game_over():
            ale.reset_game()
    return steps / (time.perf_counter() - start)


def make_env_random(env_id: str, steps: int, seed: int) -> float:
    """Env steps/s of ``make_env``'s preprocessed env with random actions."""
    env = make_env(env_id, seed=seed)
    actions = np.random.default_rng(seed).integers(env.action_space.n, size=steps)  # type: ignore[attr-defined]
    start = time.perf_counter()
    for action in actions:
        _obs, _r, term, trunc, _ = env.step(int(action))
        if term or trunc:
            env.reset()
    elapsed = time.perf_counter() - start
    env.close()
    return steps / elapsed


def make_env_cnn(env_id: str, weights: dict[str, np.ndarray], arch: Architecture, steps: int, seed: int) -> float:
    """Env steps/s of ``rollout_env`` in ``make_env``'s env, the CNN acting on one observation at a time."""
    spec = env_spec(env_id)
    env = make_env(env_id)
    start = time.perf_counter()
    rollout_env(acting_policy(spec, arch, weights), spec, env, seed, steps)
    elapsed = time.perf_counter() - start
    env.close()
    return steps / elapsed


def games_random(games: AtariGames, steps: int, seed: int) -> float:
    """Env steps/s of ``games`` stepped side by side with random actions (no policy)."""
    rng = np.random.default_rng(seed)
    for i in range(games.n):
        games.reset(i, seed=seed + i)
    per_game = math.ceil(steps / games.n)
    actions = rng.integers(len(games.action_set), size=(per_game, games.n))
    start = time.perf_counter()
    for acts in actions:
        _r, term, trunc, _lost = games.step(acts)
        for i in np.flatnonzero(term | trunc):
            games.reset(int(i))
    return per_game * games.n / (time.perf_counter() - start)


class Stopwatch:
    """Seconds spent in chosen methods of chosen objects, by bucket: ``wrap`` shadows a method
    with a timed one on the instance, ``unwrap`` removes the shadows."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._wrapped: list[tuple[object, str]] = []

    def wrap(self, obj: object, name: str, bucket: str) -> None:
        method = getattr(obj, name)
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[bucket] += time.perf_counter() - start

        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def unwrap(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)
        self._wrapped.clear()


class ActorChain:
    """A warm actor of E games: each ``rollout`` continues the episodes the previous one left."""

    def __init__(self, env_id: str, weights: dict[str, np.ndarray], arch: Architecture, n_envs: int,
                 steps_per_actor: int):
        self.env_id, self.weights, self.arch = env_id, weights, arch
        self.n_envs, self.steps_per_actor = n_envs, steps_per_actor
        self.games = games_for(env_id, n_envs, steps_per_actor)
        self.invocations = 0
        self.carry = self._rollout().carry  # the first invocation starts fresh games (untimed)

    def _rollout(self):
        self.invocations += 1
        return rollout(self.weights, self.env_id, seed=self.invocations, n_steps=self.steps_per_actor,
                       n_envs=self.n_envs, resume=self.carry if self.invocations > 1 else (),
                       arch=self.arch, env=self.games)

    def run(self, steps: int) -> float:
        """Env steps/s of invocations of ``rollout`` worth at least ``steps`` steps."""
        n = math.ceil(steps / self.steps_per_actor)
        start = time.perf_counter()
        for _ in range(n):
            self.carry = self._rollout().carry
        return n * self.steps_per_actor / (time.perf_counter() - start)

    def split(self, steps: int) -> dict[str, float]:
        """Microseconds per env step in env (of it: step, reset, snapshot restore and state),
        policy (of it: the forward), preparing the policy, and the rest, from ``rollout``'s steps
        with the games and the CNN timed."""
        n = math.ceil(steps / self.steps_per_actor)
        watch = Stopwatch()
        for name in ("step", "reset", "restore", "state"):
            watch.wrap(self.games, name, f"env_{name}")
        total = prepare = 0.0
        try:
            for _ in range(n):
                self.invocations += 1
                start = time.perf_counter()
                actor = acting_policy(env_spec(self.env_id), self.arch, self.weights)  # rollout's preparation
                prepare += time.perf_counter() - start
                watch.wrap(actor, "sample_batch", "policy")
                watch.wrap(actor, "logits", "forward")
                self.carry = rollout_games(actor, self.games, self.invocations, self.steps_per_actor, self.carry,
                                           started=start).carry
                total += time.perf_counter() - start
        finally:
            watch.unwrap()
        per_step = 1e6 / (n * self.steps_per_actor)  # seconds -> microseconds per env step
        parts = {name: watch.seconds[f"env_{name}"] for name in ("step", "reset", "restore", "state")}
        env, policy, forward = sum(parts.values()), watch.seconds["policy"], watch.seconds["forward"]
        return {"total_us": total * per_step, "env_us": env * per_step,
                **{f"env_{name}_us": seconds * per_step for name, seconds in parts.items()},
                "policy_us": policy * per_step, "policy_forward_us": forward * per_step,
                "prepare_us": prepare * per_step, "other_us": (total - env - policy - prepare) * per_step}


def vector_env(env_id: str, n_envs: int, steps: int, seed: int) -> float:
    """Env steps/s of ale-py's AtariVectorEnv (one worker thread) with random actions."""
    from ale_py.vector_env import AtariVectorEnv

    kw = emulator_kwargs(env_id)
    envs = AtariVectorEnv(kw["game"], n_envs, num_threads=1, frameskip=FRAME_SKIP, noop_max=NOOP_MAX,
                          repeat_action_probability=float(kw.get("repeat_action_probability", 0.25)),
                          max_num_frames_per_episode=int(kw.get("max_num_frames_per_episode", 108_000)),
                          use_fire_reset=False, reward_clipping=False, episodic_life=False)
    envs.reset(seed=seed)
    return random_steps_per_s(envs, envs.single_action_space.n, n_envs, steps, seed)


def envpool_env(env_id: str, n_envs: int, steps: int, seed: int) -> float:
    """Env steps/s of envpool's Atari env (one worker thread, synchronous) with random actions."""
    import envpool  # type: ignore[import-not-found]  # optional: measured where installed

    sticky = float(emulator_kwargs(env_id).get("repeat_action_probability", 0.25))
    envs = envpool.make(env_id.removeprefix("ALE/"), env_type="gymnasium", num_envs=n_envs, batch_size=n_envs,
                        num_threads=1, seed=seed, frame_skip=FRAME_SKIP, noop_max=NOOP_MAX, img_height=84,
                        img_width=84, stack_num=4, gray_scale=True, episodic_life=False, reward_clip=False,
                        use_fire_reset=False, repeat_action_probability=sticky)
    envs.reset()
    return random_steps_per_s(envs, envs.action_space.n, n_envs, steps, seed)


def random_steps_per_s(envs: Any, n_actions: int, n_envs: int, steps: int, seed: int) -> float:
    """Env steps/s of a vector env of ``n_envs`` stepped with uniformly random actions; closes it."""
    per_env = math.ceil(steps / n_envs)
    actions = np.random.default_rng(seed).integers(n_actions, size=(per_env, n_envs))
    start = time.perf_counter()
    for acts in actions:
        envs.step(acts)
    elapsed = time.perf_counter() - start
    envs.close()
    return per_env * n_envs / elapsed


def summary(values: list[float]) -> dict[str, Any]:
    return {"steps_per_s": [round(v, 1) for v in values], "median": round(statistics.median(values), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: 256 steps, 1 repeat, 2 learner batches")
    ap.add_argument("--games", default=",".join(GAMES), help="comma-separated, e.g. Qbert,Gravitar")
    ap.add_argument("--envs", default="1,4,8", help="envs_per_actor values for the actor")
    ap.add_argument("--steps", type=int, default=None, help="env steps per measurement (default 4096)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3")
    ap.add_argument("--actors", type=int, default=None, help="learner batches of steps_per_actor (default 8)")
    ap.add_argument("--learner-repeats", type=int, default=None, help="timed updates (default 3)")
    ap.add_argument("--cnn", choices=("paper", "nature"), default="paper", help="the CNN (model.cnn)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    steps = args.steps or (256 if args.quick else 4096)
    repeats = args.repeats or (1 if args.quick else 3)
    actors = args.actors or (2 if args.quick else 8)
    learner_repeats = args.learner_repeats or (1 if args.quick else 3)
    out = args.out or ROOT / "bench" / "results" / ("atari_actor_quick.json" if args.quick else "atari_actor.json")
    env_ids = [f"ALE/{g}-v5" for g in args.games.split(",")]
    envs_per_actor = sorted({int(e) for e in args.envs.split(",")})
    torch.set_num_threads(1)
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()

    results: dict[str, Any] = {}
    for env_id in env_ids:
        config = NitroConfig.load({"env_id": env_id, "seed": 0, "model": {"cnn": args.cnn}})
        arch = config.model.architecture()
        policy = build_policy(env_spec(env_id), seed=0, arch=arch)
        weights = {k: v.numpy() for k, v in policy.state_dict().items()}
        chains = {e: ActorChain(env_id, weights, arch, e, config.steps_per_actor) for e in envs_per_actor}
        games = {e: AtariGames(env_id, e) for e in envs_per_actor}
        runs: dict[str, list[float]] = defaultdict(list)
        splits: dict[int, list[dict[str, float]]] = defaultdict(list)
        for r in range(repeats):
            seed = 1000 * r
            runs["ale_act"].append(ale_act(env_id, steps, seed))
            runs["make_env"].append(make_env_random(env_id, steps, seed))
            runs["make_env_cnn"].append(make_env_cnn(env_id, weights, arch, steps, seed))
            for e in envs_per_actor:
                runs[f"games_env_{e}"].append(games_random(games[e], steps, seed))
                runs[f"actor_{e}"].append(chains[e].run(steps))
                splits[e].append(chains[e].split(steps))
            runs["ale_vector_env"].append(vector_env(env_id, envs_per_actor[-1], steps, seed))
            if util.find_spec("envpool"):
                runs["envpool"].append(envpool_env(env_id, envs_per_actor[-1], steps, seed))
            line = "  ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items())
            print(f"{env_id} repeat {r + 1}/{repeats} (env steps/s): {line}", flush=True)
        ale_med = statistics.median(runs["ale_act"])
        actor = {}
        for e in envs_per_actor:
            sps = runs[f"actor_{e}"]
            split = {k: round(statistics.median(s[k] for s in splits[e]), 1) for k in splits[e][0]}
            actor[str(e)] = {**summary(sps), "p2_ratio": round(statistics.median(sps) / ale_med, 3),
                             "p2_ratio_per_repeat": [round(a / b, 3) for a, b in zip(sps, runs["ale_act"])],
                             "split_us_per_step": split,
                             "games_env_only": summary(runs[f"games_env_{e}"])}
        results[env_id] = {
            "ale_act": {**summary(runs["ale_act"]), "frames_per_s_median": round(ale_med * FRAME_SKIP, 1)},
            "make_env": summary(runs["make_env"]),
            "make_env_cnn": summary(runs["make_env_cnn"]),
            "actor": actor,
            f"ale_vector_env_{envs_per_actor[-1]}": summary(runs["ale_vector_env"]),
            **({f"envpool_{envs_per_actor[-1]}": summary(runs["envpool"])} if runs["envpool"] else {}),
        }
        for chain in chains.values():
            chain.games.close()
        for g in games.values():
            g.close()

    config = NitroConfig.load({"env_id": env_ids[0], "seed": 0, "model": {"cnn": args.cnn}})
    batches = batches_for(config, actors)
    learner = time_device(config, batches, "cpu", config.torch_threads(), learner_repeats)
    torch.set_num_threads(1)
    print(f"learner ({config.torch_threads()} thread(s)): update of {learner['samples']} samples in "
          f"{learner['update_s_median']:.3f} s = {learner['samples_per_s']:.0f} samples/s", flush=True)

    result = {
        "benchmark": "atari_actor",
        "quick": args.quick,
        "settings": {"cnn": args.cnn, "steps_per_measurement": steps, "repeats": repeats,
                     "envs_per_actor": envs_per_actor,
                     "steps_per_actor": config.steps_per_actor, "frame_skip": FRAME_SKIP,
                     "torch_threads": 1, "omp_num_threads": os.environ["OMP_NUM_THREADS"]},
        "p2_target": P2_TARGET,
        "p2_ratio": {env_id: {e: row["p2_ratio"] for e, row in r["actor"].items()} for env_id, r in results.items()},
        "games": results,
        "learner": {**learner, "actors": actors, "steps_per_actor": config.steps_per_actor,
                    "envs_per_actor": config.envs_per_actor, "learner_threads": config.torch_threads()},
        "envpool": (f"envpool {version('envpool')}, measured as envpool_E" if util.find_spec("envpool")
                    else "not installed here (not measured): pip install envpool"),
        "wall_s": round(time.perf_counter() - started, 1),
        "notes": "env steps are agent steps of 4 frames; all on one core (torch 1 thread, OMP_NUM_THREADS=1); "
                 "actor = nitro.actors.rollout.rollout as a warm worker calls it, without Redis; "
                 "split_us_per_step from a second, instrumented pass (module docstring of bench/atari_actor.py)",
        "machine": machine(load_avg_before=load_before, load_avg_after=[round(x, 2) for x in os.getloadavg()],
                           ale_py=ale_py.__version__, opencv=cv2.__version__),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for env_id, ratios in result["p2_ratio"].items():
        print(f"{env_id}: ale.act {results[env_id]['ale_act']['median']:.0f} env steps/s; P2 (actor / ale.act) "
              + ", ".join(f"E={e}: {v:.2f}" for e, v in ratios.items()) + f" (goal >= {P2_TARGET})")
    print(f"wrote {out} in {result['wall_s']} s")


if __name__ == "__main__":
    main()
