"""The learner's door (nitro/validation.py, nitro/learners/behaviour.py) and the guards behind it: real
rollouts on Hopper and CartPole, each broken in one way (malformed, non-finite, or finite but
absurd: beyond a stated bound, or log-probabilities that are not the policy's), are refused with a
one-line reason naming what is wrong; the normaliser, the reward statistics and the optimiser
never take in a non-finite value, and one merge never moves the normaliser beyond its bound; a run
whose updates keep failing stops with a clear error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nitro.actors.rollout import rollout
from nitro.config import DoorConfig, ImpactConfig, PPOConfig
from nitro.envs import env_spec
from nitro.learners import ImpactLearner, PPOLearner
from nitro.learners.behaviour import BehaviourPolicies
from nitro.learners.replay import ReplayBuffer
from nitro.learners.statistics import RunningMeanStd
from nitro.models import Architecture
from nitro.models.networks import MERGE_BOUNDED_AFTER, MERGE_MAX_SHIFT_STD, MERGE_MAX_VAR_RATIO, ObsNorm, build_policy
from nitro.serialization import dumps_tensors
from nitro.validation import BatchError, bounds_for, check_batch, decode_batch, max_payload_bytes

HOPPER, CARTPOLE = "Hopper-v5", "CartPole-v1"
STEPS = 64


def _weights(env_id: str) -> bytes:
    policy = build_policy(env_spec(env_id), seed=0)
    return dumps_tensors(policy.state_dict(), {"format": "nitro.policy/1", "env_id": env_id, "version": 0})


@pytest.fixture(scope="module")
def hopper() -> dict[str, np.ndarray]:
    return rollout(_weights(HOPPER), HOPPER, seed=1, n_steps=STEPS).batch


@pytest.fixture(scope="module")
def cartpole() -> dict[str, np.ndarray]:
    return rollout(_weights(CARTPOLE), CARTPOLE, seed=1, n_steps=STEPS).batch


def _payload(batch: dict, **meta) -> bytes:
    return dumps_tensors(batch, {"format": "nitro.batch/1", "env_id": HOPPER, "invocation_id": "inv-1", **meta})


def _with(batch: dict, key: str, value) -> dict:
    out = {k: v.copy() for k, v in batch.items()}
    if value is None:
        del out[key]
    else:
        out[key] = value
    return out


def test_a_real_batch_passes(hopper, cartpole):
    arrays = decode_batch(_payload(hopper), env_spec(HOPPER), STEPS, "inv-1")
    assert set(arrays) == set(hopper) and np.array_equal(arrays["obs"], hopper["obs"])
    check_batch(cartpole, env_spec(CARTPOLE), STEPS)


def _nan_at(arr: np.ndarray, value: float) -> np.ndarray:
    out = arr.copy()
    out.reshape(-1)[3] = value
    return out


BROKEN = [
    ("NaN reward", lambda b: _with(b, "rewards", _nan_at(b["rewards"], np.nan)), "rewards has 1 non-finite"),
    ("inf observation", lambda b: _with(b, "obs", _nan_at(b["obs"], np.inf)), "obs has 1 non-finite"),
    ("NaN log-prob", lambda b: _with(b, "logp", _nan_at(b["logp"], np.nan)), "logp has 1 non-finite"),
    ("-inf action", lambda b: _with(b, "actions", _nan_at(b["actions"], -np.inf)), "actions has 1 non-finite"),
    (
        "inf bootstrap obs",
        lambda b: _with(b, "bootstrap_obs", np.full_like(b["bootstrap_obs"], np.inf)),
        "bootstrap_obs has",
    ),
    (
        "obs too wide",
        lambda b: _with(b, "obs", np.zeros((STEPS, 12), np.float32)),
        "obs has shape (64, 12), expected (64, 11)",
    ),
    ("actions too narrow", lambda b: _with(b, "actions", b["actions"][:, :2].copy()), "actions has shape"),
    (
        "obs as float64",
        lambda b: _with(b, "obs", b["obs"].astype(np.float64)),
        "obs has dtype float64, expected float32",
    ),
    ("rewards shorter", lambda b: _with(b, "rewards", b["rewards"][:-1].copy()), "shape"),
    ("missing rewards", lambda b: _with(b, "rewards", None), "missing key(s) rewards"),
    ("extra key", lambda b: {**b, "evil": np.zeros(1, np.float32)}, "unexpected key(s) evil"),
    (
        "bootstrap index past the end",
        lambda b: {
            **_with(b, "bootstrap_idx", np.array([STEPS], np.int64)),
            "bootstrap_obs": b["bootstrap_obs"][-1:].copy(),
        },
        "bootstrap_idx out of range: values in [64, 64], allowed [0, 64)",
    ),
    (
        "more bootstrap entries than obs",
        lambda b: _with(b, "bootstrap_idx", np.arange(STEPS, dtype=np.int64)),
        "bootstrap_obs has shape",
    ),
    (
        "bootstrap index out of range",
        lambda b: _with(b, "bootstrap_idx", np.where(b["bootstrap_idx"] == STEPS - 1, STEPS + 5, b["bootstrap_idx"])),
        "bootstrap_idx out of range",
    ),
    (
        "negative bootstrap index",
        lambda b: _with(b, "bootstrap_idx", np.full_like(b["bootstrap_idx"], -1)),
        "out of range",
    ),
    (
        "duplicate bootstrap index",
        lambda b: {
            **_with(b, "bootstrap_idx", np.array([STEPS - 1, STEPS - 1], np.int64)),
            "bootstrap_obs": np.repeat(b["bootstrap_obs"][-1:], 2, axis=0),
        },
        "bootstrap_idx has duplicates",
    ),
    (
        "last step open",
        lambda b: {
            **_with(b, "bootstrap_idx", np.zeros(0, np.int64)),
            "bootstrap_obs": np.zeros((0, 11), np.float32),
            "terminated": np.zeros(STEPS, bool),
        },
        "neither terminated nor bootstrapped",
    ),
    (
        "oversize",
        lambda b: {
            k: np.concatenate([v] * 3) if k in ("obs", "actions", "logp", "rewards", "terminated") else v
            for k, v in b.items()
        },
        "rewards has 192 entries, more than the 64 allowed",
    ),
    ("empty", lambda b: {**{k: v[:0] for k, v in b.items()}}, "rewards is empty"),
]


@pytest.mark.parametrize(("name", "breaks", "reason"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_batch_is_refused_in_one_line(hopper, name, breaks, reason):
    with pytest.raises(BatchError) as info:
        decode_batch(_payload(breaks(hopper)), env_spec(HOPPER), STEPS, "inv-1")
    message = str(info.value)
    assert reason in message and "\n" not in message, message


def test_oversize_payload_is_refused_before_it_is_parsed(hopper):
    limit = max_payload_bytes(env_spec(HOPPER), STEPS)
    with pytest.raises(BatchError, match="exceeds"):
        decode_batch(b"\x00" * (limit + 1), env_spec(HOPPER), STEPS)


@pytest.mark.parametrize(("meta", "reason"), [({"format": "nitro.policy/1"}, "expected a 'nitro.batch/1'"),
                                              ({"env_id": "Walker2d-v5"}, "env_id"),
                                              ({"invocation_id": "someone-else"}, "invocation_id")])
def test_wrong_metadata_is_refused(hopper, meta, reason):
    with pytest.raises(BatchError, match=reason):
        decode_batch(_payload(hopper, **meta), env_spec(HOPPER), STEPS, "inv-1")


# Finite but absurd: each is refused with its bound by the door, where it names the value and where it is.
ABSURD = [
    (
        "obs",
        lambda b: _with(b, "obs", _nan_at(b["obs"], 1e30)),
        "obs[0, 3] = 1e+30 is outside its stated bound [-1e+06, 1e+06]",
    ),
    (
        "bootstrap_obs",
        lambda b: _with(b, "bootstrap_obs", np.full_like(b["bootstrap_obs"], 3e38)),
        "bootstrap_obs[0, 0] = 3e+38",
    ),
    (
        "actions",
        lambda b: _with(b, "actions", _nan_at(b["actions"], 1e30)),
        "actions[1, 0] = 1e+30 is outside its stated bound [-1e+03, 1e+03]",
    ),
    (
        "rewards",
        lambda b: _with(b, "rewards", _nan_at(b["rewards"], 1e30)),
        "rewards[3] = 1e+30 is outside its stated bound [-1e+06, 1e+06]",
    ),
]


@pytest.mark.parametrize(("name", "breaks", "reason"), ABSURD, ids=[a[0] for a in ABSURD])
def test_a_value_beyond_its_stated_bound_is_refused(hopper, name, breaks, reason):
    bounds = bounds_for(env_spec(HOPPER), DoorConfig())
    check_batch(hopper, env_spec(HOPPER), STEPS, bounds)  # the real batch is inside every bound
    with pytest.raises(BatchError) as info:
        decode_batch(_payload(breaks(hopper)), env_spec(HOPPER), STEPS, "inv-1", bounds)
    assert reason in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_finite_observation_bounds_come_from_the_env_space(cartpole):
    """CartPole states its cart position within +-4.8 (slack: a tenth of the range) and leaves its
    velocity unbounded (then the door's magnitude holds)."""
    spec, door = env_spec(CARTPOLE), DoorConfig(max_abs_obs=100.0)
    bounds = bounds_for(spec, door)
    assert bounds.obs_high[0] == pytest.approx(4.8 + 0.96) and bounds.obs_high[1] == 100.0
    check_batch(cartpole, spec, STEPS, bounds)
    far = cartpole["obs"].copy()
    far[3, 0] = 6.0
    with pytest.raises(BatchError, match=r"obs\[3, 0\] = 6 is outside"):
        check_batch(_with(cartpole, "obs", far), spec, STEPS, bounds)


def _behaviour(env_id: str) -> BehaviourPolicies:
    policies = BehaviourPolicies(env_spec(env_id), Architecture(), atol=1e-3, rtol=1e-3)
    policies.remember(0, build_policy(env_spec(env_id), seed=0).state_dict())  # what _weights published
    return policies


def test_behaviour_log_probabilities_are_recomputed_from_the_named_version(hopper, cartpole):
    for env_id, batch in ((HOPPER, hopper), (CARTPOLE, cartpole)):
        policies = _behaviour(env_id)
        policies.check(batch, 0)  # the actor's numpy arithmetic agrees with torch's to float tolerance
        assert np.allclose(policies.recompute(batch, 0), batch["logp"], atol=1e-5)
        with pytest.raises(
            BatchError, match=r"logp disagrees with policy version 0 at 1 of 64 steps \(step 3: -1e\+30 given"
        ):
            policies.check(_with(batch, "logp", _nan_at(batch["logp"], -1e30)), 0)
        with pytest.raises(BatchError, match="weights_version 7 is not a policy version the learner keeps"):
            policies.check(batch, 7)
    # an action of 1e30 has a recomputed log-probability of -inf: refused even without the bounds
    with pytest.raises(BatchError, match="logp disagrees"):
        _behaviour(HOPPER).check(_with(hopper, "actions", _nan_at(hopper["actions"], 1e30)), 0)


def test_only_the_last_few_versions_are_kept():
    policies = BehaviourPolicies(env_spec(CARTPOLE), Architecture(), atol=1e-3, rtol=1e-3, keep=3)
    for version in range(5):
        policies.remember(version, build_policy(env_spec(CARTPOLE), seed=version).state_dict())
    assert policies.versions() == [2, 3, 4]


def test_one_merge_never_moves_the_normaliser_beyond_its_bound():
    rng = np.random.default_rng(0)
    honest = rng.normal(2.0, 1.0, size=(int(MERGE_BOUNDED_AFTER) + 200, 3))
    norm, exact = ObsNorm((3,)), ObsNorm((3,))
    norm.merge(honest[:-200])
    exact.merge(honest[:-200])
    # an honest batch merges exactly as the plain Welford merge would
    norm.merge(honest[-200:])
    whole = torch.as_tensor(honest)
    assert torch.allclose(norm.mean, whole.mean(0)) and torch.allclose(norm.var, whole.var(0, unbiased=False))
    # a batch far out moves the mean by at most MERGE_MAX_SHIFT_STD stds, the variance by at most the ratio
    mean, var = norm.mean.clone(), norm.var.clone()
    norm.merge(np.full((256, 3), 1e5))
    assert torch.all((norm.mean - mean).abs() <= MERGE_MAX_SHIFT_STD * var.sqrt() * (1 + 1e-12))
    assert torch.all(norm.var <= var * MERGE_MAX_VAR_RATIO * (1 + 1e-12))
    assert float(norm.var.max()) < 20


def test_discrete_actions_out_of_range_and_of_the_wrong_dtype(cartpole):
    spec = env_spec(CARTPOLE)
    with pytest.raises(BatchError, match=r"actions out of range: values in \[0, 2\], allowed \[0, 2\)"):
        check_batch(_with(cartpole, "actions", np.where(np.arange(STEPS) == 5, 2, cartpole["actions"])), spec)
    with pytest.raises(BatchError, match="actions has dtype float32, expected int64"):
        check_batch(_with(cartpole, "actions", cartpole["actions"].astype(np.float32)), spec)


# -- the guards behind the door ------------------------------------------------------------------


def test_obs_norm_and_reward_statistics_ignore_non_finite_values():
    norm = ObsNorm((3,))
    good = np.random.default_rng(0).normal(2.0, 1.0, size=(100, 3))
    bad = good.copy()
    bad[7, 1], bad[9, 0] = np.inf, np.nan
    norm.merge(bad)
    clean = ObsNorm((3,))
    clean.merge(np.delete(good, [7, 9], axis=0))
    assert torch.isfinite(norm.mean).all() and torch.isfinite(norm.var).all()
    assert torch.allclose(norm.mean, clean.mean) and torch.allclose(norm.var, clean.var)
    stats = RunningMeanStd()
    stats.merge(np.array([1.0, np.nan, 3.0, -np.inf]))
    assert stats.mean == pytest.approx(2.0, rel=1e-3) and math.isfinite(stats.var)


def test_ppo_update_on_a_nan_batch_leaves_the_policy_finite(hopper):
    """Behind the door, for a learner used directly: a NaN reward makes every minibatch's loss
    non-finite; none is stepped on, so the weights stay exactly as they were."""
    learner = PPOLearner(env_spec(HOPPER), PPOConfig(epochs=2, minibatch_size=32), seed=0)
    learner.update([hopper])  # a good first update: the statistics are real
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    result = learner.update([_with(hopper, "rewards", _nan_at(hopper["rewards"], np.nan))])
    assert result.sgd_steps == 0 and result.skipped_minibatches == 4 and result.took_no_step
    assert result.diagnostics["sgd_steps"] == 0 and result.diagnostics["skipped_minibatches"] == 4
    after = learner.policy.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("obs_norm"))


def test_the_replay_buffer_admits_only_valid_batches(hopper):
    learner = ImpactLearner(env_spec(HOPPER), ImpactConfig(epochs=1, minibatch_size=32), seed=0)
    bad = _with(hopper, "obs", _nan_at(hopper["obs"], np.inf))
    assert learner.replay.add(bad, uses=1) == -1 and len(learner.replay) == 0 and learner.replay.n_rejected == 1
    learner.update([hopper, bad])
    assert len(learner.replay) == 1 and learner.replay.n_rejected == 2
    assert all(torch.isfinite(v).all() for v in learner.policy.state_dict().values())
    # restoring a checkpoint whose buffer holds a bad batch drops it
    buf = ReplayBuffer(4, 3, check=learner._check_batch)
    lost = buf.restore({"next_seq": 2, "cursor": -1, "n_added": 2, "n_exhausted": 0, "n_dropped": 0, "n_replays": 0,
                        "entries": [[0, 1], [1, 1]]}, {0: hopper, 1: bad})
    assert len(buf) == 1 and lost == 2
