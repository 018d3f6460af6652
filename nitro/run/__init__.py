"""One training run: its folder, its update modes, its rounds and its live resources."""
