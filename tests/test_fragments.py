"""The learner's side of the gradient noise measurement (nitro/learners/fragments.py): the rows of
each fragment, the norms against hand-worked values, and a PPO update that reports them without
changing what it trains."""

from __future__ import annotations

import pytest
import torch

from nitro.config import NitroConfig
from nitro.envs import env_spec
from nitro.learners import PPOLearner, make_learner
from nitro.learners.fragments import (
    FRAGMENT_SAMPLES,
    FRAGMENTS,
    NOISE_DIAGNOSTICS,
    POLICY_FRAG_SQNORM,
    POLICY_MEAN_SQNORM,
    SECONDS,
    VALUE_FRAG_SQNORM,
    VALUE_MEAN_SQNORM,
    fragment_norms,
    fragment_rows,
)
from nitro.learners.gradients import Gradients
from nitro.scaling.noise import measurement_from
from tests.test_ppo import CFG, ENV, _flat, hopper_batches  # noqa: F401  hopper_batches is a fixture


def test_fragment_rows_follow_the_concatenation_strided_to_the_cap():
    rows = fragment_rows([10, 0, 130, 64], cap=64)
    assert [r.tolist() for r in rows[:1]] == [list(range(10))]  # under the cap: every row
    assert rows[1].tolist() == list(range(10, 140, 3))  # ceil(130 / 64) = 3: 44 rows spanning the fragment
    assert rows[2].tolist() == list(range(140, 204))  # exactly the cap: every row
    assert len(rows) == 3  # the empty batch is no fragment, as prepare_batches skips it


def test_fragment_norms_by_hand():
    grads = {0: {"policy.w": [1.0, 2.0], "critic.v": [2.0]}, 1: {"policy.w": [3.0, 0.0], "critic.v": [0.0]}}

    def compute(rows: torch.Tensor) -> Gradients:
        i = int(rows[0])
        return Gradients({k: torch.tensor(v) for k, v in grads[i].items()}, samples=len(rows), loss=0.5)

    out = fragment_norms(compute, [torch.tensor([0, 5, 7]), torch.tensor([1])])
    # policy: |g_1|^2 = 5, |g_2|^2 = 9 -> mean 7; mean gradient (2, 1) -> 5
    # critic: |g_1|^2 = 4, |g_2|^2 = 0 -> mean 2; mean gradient (1) -> 1
    assert out.pop(SECONDS) >= 0
    assert out == {FRAGMENTS: 2.0, FRAGMENT_SAMPLES: 2.0, POLICY_FRAG_SQNORM: 7.0, POLICY_MEAN_SQNORM: 5.0,
                   VALUE_FRAG_SQNORM: 2.0, VALUE_MEAN_SQNORM: 1.0}
    assert fragment_norms(compute, [torch.tensor([0])]) == {}  # one fragment says nothing about noise

    def not_finite(rows: torch.Tensor) -> Gradients:
        return Gradients({}, samples=len(rows), loss=float("nan"))

    assert fragment_norms(not_finite, [torch.tensor([0]), torch.tensor([1])]) == {}


def test_a_measuring_update_reports_the_fragments_and_trains_the_same(hopper_batches):  # noqa: F811
    round1, round2 = hopper_batches
    plain, measuring = PPOLearner(env_spec(ENV), CFG, seed=0), PPOLearner(env_spec(ENV), CFG, seed=0,
                                                                          fragment_noise=True)
    for batches in (round1, round2):
        a, b = plain.update(batches).diagnostics, measuring.update(batches).diagnostics
    assert torch.equal(_flat(plain.policy), _flat(measuring.policy))
    assert torch.equal(_flat(plain.critic), _flat(measuring.critic))
    assert not any(k in a for k in NOISE_DIAGNOSTICS)
    assert b[FRAGMENTS] == 2.0 and b[FRAGMENT_SAMPLES] == 64.0  # two 256-step batches, 64 rows of each
    m = measurement_from(b)
    assert m is not None and m.value is not None
    assert m.policy.frag_sqnorm >= m.policy.mean_sqnorm > 0  # mean of squares >= square of mean
    assert 0 < b[SECONDS] < b["seconds"]


def test_the_config_asks_the_learner_to_measure_only_where_a_scaler_reads_it():
    assert make_learner(NitroConfig.load({"scaler": {"name": "goodput"}})).fragment_noise is True
    assert make_learner(NitroConfig.load({"scaler": {"name": "fixed"}})).fragment_noise is False
    with pytest.raises(ValueError, match="scaler: 'goodput' reads the gradient noise PPO's learner measures; "
                                         "algo=impact does not measure it"):
        NitroConfig.load({"algo": "impact", "scaler": {"name": "goodput"}})
    # Stellaris measures it from its learner functions' gradients (tests/test_stellaris_parts.py)
    assert NitroConfig.load({"learner": {"mode": "stellaris"}, "scaler": {"name": "goodput"}}).scaler.measures_noise
