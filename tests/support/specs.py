"""Env specs for learner tests that need no emulator."""

from nitro.envs import EnvSpec

# Qbert's observation and action spaces (4 stacked 84x84 uint8 frames, 6 actions): the CNN and
# Categorical path on synthetic frames.
ATARI_SHAPED = EnvSpec("ALE/Qbert-v5", "atari", (4, 84, 84), "uint8", False, 6, None)
