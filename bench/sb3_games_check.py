"""Check that ``bench/learning.py --sb3-games nitro`` gives SB3 the games Nitro's actors play.

    python bench/sb3_games_check.py                  # Gravitar and Qbert, 6000 steps x 2 games each

Plays the same random actions in ``nitro_games``' vector env (SB3's side) and in ``AtariGames``
under ``rollout_games``' rule (a lost life ends the training episode; a game that ends is reset),
from the same seeds, and asserts at every step: the same observations, the same sign-clipped
rewards, the same episode ends, and SB3's terminal observation equal to Nitro's. Prints the lives
lost and games ended that it covered. Nothing is timed.
"""

from __future__ import annotations

import argparse

import numpy as np
from learning import nitro_games

from nitro.envs import AtariGames


def check(env_id: str, steps: int, n: int = 2, seed: int = 7) -> tuple[int, int]:
    """(lives lost, games ended) over ``steps`` steps of ``n`` games; AssertionError at a difference."""
    venv = nitro_games(env_id, n, seed=seed)
    obs = venv.reset()
    games = AtariGames(env_id, n)
    for i in range(n):
        games.reset(i, seed=seed + i)  # as venv.seed(seed) seeds game i's first reset
    assert (obs == games.obs).all(), f"{env_id}: first observations differ"
    rng = np.random.default_rng(0)
    lost = ended = 0
    for t in range(steps):
        actions = rng.integers(venv.action_space.n, size=n)
        obs, rewards, dones, infos = venv.step(actions)
        reward, term, trunc, life_lost = games.step(actions)
        assert (np.sign(reward) == rewards).all() and ((term | life_lost | trunc) == dones).all(), f"{env_id} step {t}"
        for i in np.flatnonzero(dones):
            assert (infos[i]["terminal_observation"] == games.obs[i]).all(), f"{env_id} step {t}: terminal obs"
            lost += int(life_lost[i] and not term[i])
            if term[i] or trunc[i]:
                ended += 1
                games.reset(i)
        assert (obs == games.obs).all(), f"{env_id} step {t}: observations differ"
    return lost, ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="ALE/Gravitar-v5,ALE/Qbert-v5")
    parser.add_argument("--steps", type=int, default=6000)
    args = parser.parse_args()
    for env_id in args.envs.split(","):
        lost, ended = check(env_id, args.steps)
        print(f"{env_id}: {args.steps} steps x 2 games identical; {lost} lives lost, {ended} games ended")


if __name__ == "__main__":
    main()
