"""The learner's door: every trajectory batch is checked against the run's env spec before it is
trained on.

Anyone who can write to the trajectory cache (a buggy actor, or worse) can hand the learner a
well-formed ``nitro.batch/1`` payload with the wrong content. Unchecked, one NaN reward makes the
update raise deep inside ``torch.distributions`` (after the optimiser has already written
non-finite weights), one ``inf`` observation poisons the observation normaliser for good, and a
wrong shape or a missing key crashes the round. ``check_batch`` turns each of those into a
``BatchError`` with one line naming the key and what is wrong; the engine drops that batch,
counts it as ``actors_corrupt`` and goes on with the rest. The IMPACT replay buffer admits only
batches that pass the same check.

What is checked (docs/ARCHITECTURE.md "Wire formats"):

* the payload's size before it is parsed (``max_payload_bytes``: what a batch of the run's
  ``steps_per_actor`` steps can need, plus room for the header),
* the format tag, the env and the invocation id in its metadata,
* exactly the seven keys, each with its dtype and shape: ``obs`` (T, *obs_shape), ``actions``
  (T, action_dim) float32 or (T,) int64 in [0, n_actions), ``logp``/``rewards`` (T,) float32,
  ``terminated`` (T,) bool, ``bootstrap_idx`` (K,) int64, ``bootstrap_obs`` (K, *obs_shape);
  1 <= T <= ``max_steps``, K <= T,
* ``bootstrap_idx`` strictly inside [0, T) without duplicates, and the last step terminated or
  bootstrapped (otherwise its successor is unknown),
* every float finite (observations, actions, log-probabilities, rewards).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from nitro.envs import EnvSpec
from nitro.serialization import SerializationError, loads_tensors

BATCH_FORMAT = "nitro.batch/1"
BATCH_KEYS = ("obs", "actions", "logp", "rewards", "terminated", "bootstrap_idx", "bootstrap_obs")
HEADER_ALLOWANCE_BYTES = 64 * 1024  # safetensors' JSON header: names, shapes, offsets, metadata


class BatchError(ValueError):
    """A trajectory batch the learner must not train on; the message is one line."""


def max_payload_bytes(spec: EnvSpec, max_steps: int) -> int:
    """The most bytes a valid batch of at most ``max_steps`` steps can take: every step's row of
    each array, a bootstrap observation for every step (the worst case), and the header."""
    obs_row = int(np.prod(spec.obs_shape)) * np.dtype(spec.obs_dtype).itemsize
    action_row = 4 * spec.action_dim if spec.continuous else 8
    per_step = 2 * obs_row + action_row + 4 + 4 + 1 + 8
    return max_steps * per_step + HEADER_ALLOWANCE_BYTES


def decode_batch(payload: bytes, spec: EnvSpec, max_steps: int, invocation_id: str | None = None) -> dict[str, np.ndarray]:
    """Parse and check one payload from the cache; raises ``BatchError`` (one line) if it is not
    a batch this run may train on."""
    limit = max_payload_bytes(spec, max_steps)
    if len(payload) > limit:
        raise BatchError(f"payload of {len(payload)} bytes exceeds the {limit} bytes a batch of {max_steps} steps can need")
    try:
        arrays, meta = loads_tensors(payload, expect_format=BATCH_FORMAT)
    except SerializationError as exc:
        raise BatchError(str(exc)) from None
    if meta.get("env_id") not in (None, spec.env_id):
        raise BatchError(f"meta env_id is {meta.get('env_id')!r}, this run trains on {spec.env_id!r}")
    if invocation_id is not None and meta.get("invocation_id") not in (None, invocation_id):
        raise BatchError(f"meta invocation_id is {meta.get('invocation_id')!r}, the batch is stored as {invocation_id!r}")
    check_batch(arrays, spec, max_steps)
    return arrays


def check_batch(batch: Mapping[str, np.ndarray], spec: EnvSpec, max_steps: int | None = None) -> None:
    """Raise ``BatchError`` naming the first key that is missing, unexpected, of the wrong dtype or
    shape, out of range or not finite."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise BatchError(f"missing key(s) {', '.join(missing)}")
    extra = sorted(set(batch) - set(BATCH_KEYS))
    if extra:
        raise BatchError(f"unexpected key(s) {', '.join(extra)}")
    T = _length(batch["rewards"], max_steps)
    K = _length(batch["bootstrap_idx"], T, allow_empty=True, name="bootstrap_idx")
    obs_dtype = np.dtype(spec.obs_dtype)
    _expect(batch, "obs", obs_dtype, (T, *spec.obs_shape))
    _expect(batch, "bootstrap_obs", obs_dtype, (K, *spec.obs_shape))
    if spec.continuous:
        _expect(batch, "actions", np.dtype(np.float32), (T, spec.action_dim))
    else:
        _expect(batch, "actions", np.dtype(np.int64), (T,))
        _in_range(batch["actions"], spec.action_dim, "actions")
    _expect(batch, "logp", np.dtype(np.float32), (T,))
    _expect(batch, "rewards", np.dtype(np.float32), (T,))
    _expect(batch, "terminated", np.dtype(np.bool_), (T,))
    _expect(batch, "bootstrap_idx", np.dtype(np.int64), (K,))
    idx = np.asarray(batch["bootstrap_idx"])
    _in_range(idx, T, "bootstrap_idx")
    if len(np.unique(idx)) != K:
        raise BatchError("bootstrap_idx has duplicates")
    if not (batch["terminated"][-1] or (K and idx.max() == T - 1)):
        raise BatchError("the last step is neither terminated nor bootstrapped: its successor is unknown")
    for key in ("obs", "bootstrap_obs", "actions", "logp", "rewards"):
        _finite(batch[key], key)


def _length(arr: np.ndarray, limit: int | None, *, allow_empty: bool = False, name: str = "rewards") -> int:
    shape = np.shape(arr)
    if len(shape) != 1:
        raise BatchError(f"{name} has shape {shape}, expected one dimension")
    n = shape[0]
    if n == 0 and not allow_empty:
        raise BatchError(f"{name} is empty: a batch has at least one step")
    if limit is not None and n > limit:
        raise BatchError(f"{name} has {n} entries, more than the {limit} allowed")
    return n


def _expect(batch: Mapping[str, np.ndarray], key: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    arr = batch[key]
    if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise BatchError(f"{key} has dtype {got}, expected {dtype}")
    if arr.shape != shape:
        raise BatchError(f"{key} has shape {arr.shape}, expected {shape}")


def _in_range(arr: np.ndarray, upper: int, key: str) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= upper):
        raise BatchError(f"{key} out of range: values in [{arr.min()}, {arr.max()}], allowed [0, {upper})")


def _finite(arr: np.ndarray, key: str) -> None:
    if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
        bad = int(arr.size - np.isfinite(arr).sum())
        raise BatchError(f"{key} has {bad} non-finite value(s) (NaN or inf)")
