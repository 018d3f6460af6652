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
* every float finite (observations, actions, log-probabilities, rewards),
* with ``bounds`` (``bounds_for``; the engine always passes them), every value plausible:
  observations (``obs`` and ``bootstrap_obs``) inside the env's observation space where it states
  finite bounds, widened by a tenth of their range (gymnasium's classic-control envs state loose
  bounds, and an env may step a hair past one before it terminates), and within
  ``door.max_abs_obs`` where it states none (MuJoCo's); continuous actions within
  ``door.max_abs_action`` (a Gaussian policy's samples exceed the action space, which the env
  clips, but 1e3 is a thousand standard deviations of the initial policy); rewards within
  ``door.max_abs_reward`` (gymnasium 1.x states no reward range; the largest per-step Atari
  rewards are in the thousands). A fixed magnitude rather than an outlier rule against the
  running statistics: a rule that refuses what the statistics have not yet seen could refuse an
  input's new regime for ever, and the normaliser's own bound (``nitro.models.networks.ObsNorm.merge``)
  already limits what one batch that passes can do to it.

The behaviour log-probabilities are checked behind this door, against the policy version the
batch names (``nitro.learners.behaviour``): that needs the weights the learner published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from nitro.config import DoorConfig
from nitro.envs import EnvSpec, observation_bounds
from nitro.serialization import SerializationError, loads_tensors

BATCH_FORMAT = "nitro.batch/1"
BATCH_KEYS = ("obs", "actions", "logp", "rewards", "terminated", "bootstrap_idx", "bootstrap_obs")
HEADER_ALLOWANCE_BYTES = 64 * 1024  # safetensors' JSON header: names, shapes, offsets, metadata


BOUND_SLACK = 0.1  # a stated finite observation bound is widened by this share of its range


class BatchError(ValueError):
    """A trajectory batch the learner must not train on; the message is one line."""


@dataclass(frozen=True)
class Bounds:
    """The largest plausible values of a batch (see the module docstring for each rule)."""

    obs_low: np.ndarray | None  # per input, float64; None: image observations (uint8 bounds them)
    obs_high: np.ndarray | None
    max_abs_action: float
    max_abs_reward: float


def bounds_for(spec: EnvSpec, door: DoorConfig) -> Bounds:
    """The run's bounds: the env's observation space where finite (plus ``BOUND_SLACK``), else
    ``door.max_abs_obs``; the door's action and reward magnitudes."""
    if spec.is_image:
        return Bounds(None, None, door.max_abs_action, door.max_abs_reward)
    low, high = observation_bounds(spec.env_id)
    both = np.isfinite(low) & np.isfinite(high)
    slack = np.where(both, BOUND_SLACK * (high - low), 0.0)
    low = np.where(np.isfinite(low), low - slack, -door.max_abs_obs)
    high = np.where(np.isfinite(high), high + slack, door.max_abs_obs)
    return Bounds(low, high, door.max_abs_action, door.max_abs_reward)


def batch_version(payload_meta: Mapping[str, str]) -> int | None:
    """The policy version a batch's metadata says its actor acted with; None if it names none."""
    version = payload_meta.get("weights_version")
    return int(version) if version is not None and str(version).lstrip("-").isdigit() else None


def max_payload_bytes(spec: EnvSpec, max_steps: int) -> int:
    """The most bytes a valid batch of at most ``max_steps`` steps can take: every step's row of
    each array, a bootstrap observation for every step (the worst case), and the header."""
    obs_row = int(np.prod(spec.obs_shape)) * np.dtype(spec.obs_dtype).itemsize
    action_row = 4 * spec.action_dim if spec.continuous else 8
    per_step = 2 * obs_row + action_row + 4 + 4 + 1 + 8
    return max_steps * per_step + HEADER_ALLOWANCE_BYTES


def decode_batch(payload: bytes, spec: EnvSpec, max_steps: int, invocation_id: str | None = None,
                 bounds: Bounds | None = None) -> dict[str, np.ndarray]:
    """Parse and check one payload from the cache; raises ``BatchError`` (one line) if it is not
    a batch this run may train on."""
    return decode_batch_meta(payload, spec, max_steps, invocation_id, bounds)[0]


def decode_batch_meta(payload: bytes, spec: EnvSpec, max_steps: int, invocation_id: str | None = None,
                      bounds: Bounds | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``decode_batch`` and the batch's metadata (its ``weights_version`` among them)."""
    limit = max_payload_bytes(spec, max_steps)
    if len(payload) > limit:
        raise BatchError(
            f"payload of {len(payload)} bytes exceeds the {limit} bytes a batch of {max_steps} steps can need")
    try:
        arrays, meta = loads_tensors(payload, expect_format=BATCH_FORMAT)
    except SerializationError as exc:
        raise BatchError(str(exc)) from None
    if meta.get("env_id") not in (None, spec.env_id):
        raise BatchError(f"meta env_id is {meta.get('env_id')!r}, this run trains on {spec.env_id!r}")
    if invocation_id is not None and meta.get("invocation_id") not in (None, invocation_id):
        raise BatchError(
            f"meta invocation_id is {meta.get('invocation_id')!r}, the batch is stored as {invocation_id!r}")
    check_batch(arrays, spec, max_steps, bounds)
    return arrays, meta


def check_batch(batch: Mapping[str, np.ndarray], spec: EnvSpec, max_steps: int | None = None,
                bounds: Bounds | None = None) -> None:
    """Raise ``BatchError`` naming the first key that is missing, unexpected, of the wrong dtype or
    shape, out of range, not finite or (with ``bounds``) beyond its stated bound."""
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
        finite(batch[key], key)
    if bounds is not None:
        check_bounds(batch, spec, bounds)


def check_bounds(batch: Mapping[str, np.ndarray], spec: EnvSpec, bounds: Bounds) -> None:
    """Raise ``BatchError`` naming the first value beyond its bound (a batch of finite values of
    the right shapes)."""
    if bounds.obs_low is not None and bounds.obs_high is not None:
        for key in ("obs", "bootstrap_obs"):
            _within(np.asarray(batch[key], np.float64), bounds.obs_low, bounds.obs_high, key)
    if spec.continuous:
        _within(np.asarray(batch["actions"], np.float64), -bounds.max_abs_action, bounds.max_abs_action, "actions")
    _within(np.asarray(batch["rewards"], np.float64), -bounds.max_abs_reward, bounds.max_abs_reward, "rewards")


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


def finite(arr: np.ndarray, key: str) -> None:
    if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
        bad = int(arr.size - np.isfinite(arr).sum())
        raise BatchError(f"{key} has {bad} non-finite value(s) (NaN or inf)")


def _within(arr: np.ndarray, low: np.ndarray | float, high: np.ndarray | float, key: str) -> None:
    outside = (arr < low) | (arr > high)
    if arr.size and outside.any():
        where = tuple(int(i) for i in np.argwhere(outside)[0])
        lo, hi = np.broadcast_to(low, arr.shape)[where], np.broadcast_to(high, arr.shape)[where]
        raise BatchError(f"{key}[{', '.join(map(str, where))}] = {arr[where]:.3g} is outside its stated bound "
                         f"[{lo:.3g}, {hi:.3g}] ({int(outside.sum())} value(s) out of bounds)")
