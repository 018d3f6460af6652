"""The learner's speed settings: the compiled minibatch loss (and its fallback), the gradient
clipping that copies nothing, and how many torch threads a learner gets."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributions import Categorical, Independent, Normal, kl_divergence

from nitro.actors.rollout import rollout
from nitro.config import NitroConfig, PPOConfig
from nitro.envs import env_spec
from nitro.learners import Gradients, PPOLearner, make_learner
from nitro.learners.compiled import AUTO_COMPILE_ROUNDS, CompiledOrEager, when_to_compile
from nitro.learners.gradients import clipped
from nitro.learners.objective import exact_kl
from nitro.learners.ppo_loss import ppo_minibatch_loss

ENV = "Hopper-v5"
CFG = PPOConfig(epochs=1, minibatch_size=64)


@pytest.fixture(scope="module")
def prepared():
    """An eager learner and a round of real Hopper batches, prepared."""
    learner = PPOLearner(env_spec(ENV), CFG, seed=0)
    weights = {k: v.numpy() for k, v in learner.weights().items()}
    batches = [rollout(weights, ENV, i, 128).batch for i in range(2)]
    learner.merge_statistics(batches)
    return learner, batches, learner.prepare(batches)


def _loss_kwargs(learner: PPOLearner) -> dict:
    cfg = learner.cfg
    return {"clip": cfg.clip, "kl_coef": 0.2, "vf_clip": cfg.vf_clip, "vf_coef": cfg.vf_coef,
            "entropy_coef": 0.01}


def test_exact_kl_is_torch_kl_divergence_for_both_families():
    g = torch.Generator().manual_seed(0)
    loc, scale = torch.randn(2, 5, 3, generator=g), torch.rand(2, 5, 3, generator=g) + 0.1
    old, new = (Independent(Normal(loc[i], scale[i]), 1) for i in range(2))
    torch.testing.assert_close(exact_kl(old, new), kl_divergence(old, new))
    logits = torch.randn(2, 5, 4, generator=g)
    old_c, new_c = Categorical(logits=logits[0]), Categorical(logits=logits[1])
    torch.testing.assert_close(exact_kl(old_c, new_c), kl_divergence(old_c, new_c))
    with pytest.raises(TypeError, match="no closed form"):
        exact_kl(old, old_c)


def test_the_minibatch_loss_is_one_graph_for_torch_compile(prepared):
    """No graph break (fullgraph=True raises on one): a break splits a step into several compiled
    pieces with eager PyTorch between them, which measured no faster than eager alone."""
    learner, _, data = prepared
    loss = torch.compile(ppo_minibatch_loss, backend="aot_eager", fullgraph=True)
    rows = torch.arange(64)
    # The adaptive KL coefficient changes between updates (a new value makes it a symbolic input)
    # and may be 0 (the nitro preset's), which leaves the KL out of the graph.
    for kl_coef in (0.2, 0.3, 0.45, 0.0):
        kwargs = {**_loss_kwargs(learner), "kl_coef": kl_coef}
        total, terms = loss(learner.policy, learner.critic, data, rows, **kwargs)
        want, want_terms = ppo_minibatch_loss(learner.policy, learner.critic, data, rows, **kwargs)
        torch.testing.assert_close(total, want)
        assert set(terms) == set(want_terms)


def test_a_compiled_learner_computes_the_eager_gradients(prepared):
    """Inductor's kernels (the real path a long run takes) sum in another order than eager
    PyTorch: the gradients agree to float32 rounding, and an update trains."""
    eager, batches, data = prepared
    compiled = PPOLearner(env_spec(ENV), CFG, seed=0, compile_loss=True)
    compiled.load_state_dict(*eager.state_dict())
    rows = torch.arange(64)
    got, want = compiled.compute_gradients(data, rows), eager.compute_gradients(data, rows)
    assert isinstance(compiled.minibatch_loss, CompiledOrEager) and compiled.minibatch_loss.compiled
    assert set(got.tensors) == set(want.tensors)
    for name, tensor in want.tensors.items():
        torch.testing.assert_close(got.tensors[name], tensor, rtol=1e-4, atol=1e-6)
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    before = torch.cat([p.detach().flatten() for p in compiled.policy.parameters()])
    assert compiled.update(batches).sgd_steps > 0
    assert not torch.equal(before, torch.cat([p.detach().flatten() for p in compiled.policy.parameters()]))


def test_a_compiler_that_fails_leaves_the_learner_eager_with_one_warning(prepared, caplog):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    eager, _, data = prepared
    learner = PPOLearner(env_spec(ENV), CFG, seed=0)
    learner.load_state_dict(*eager.state_dict())
    learner.minibatch_loss = CompiledOrEager(ppo_minibatch_loss, backend=broken_backend)
    rows = torch.arange(32)
    with caplog.at_level(logging.WARNING, logger="nitro"):
        got = learner.compute_gradients(data, rows)
        learner.compute_gradients(data, rows)
    warnings = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler here" in warnings[0].getMessage()
    assert not learner.minibatch_loss.compiled
    want = eager.compute_gradients(data, rows)
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)


def test_an_error_of_the_loss_itself_still_raises_through_the_fallback(prepared):
    learner, _, data = prepared
    loss = CompiledOrEager(ppo_minibatch_loss, backend="aot_eager")
    with pytest.raises(IndexError):
        loss(learner.policy, learner.critic, data, torch.tensor([10**6]), **_loss_kwargs(learner))


def test_auto_compiles_a_long_run_only():
    assert not when_to_compile("auto", AUTO_COMPILE_ROUNDS - 1)
    assert when_to_compile("auto", AUTO_COMPILE_ROUNDS)
    assert when_to_compile(True, 1) and not when_to_compile(False, 10**6)
    assert not when_to_compile("auto", 10**6, budgeted=True) and when_to_compile(True, 1, budgeted=True)
    short = make_learner(NitroConfig.load(overrides=["rounds=5"]))
    long = make_learner(NitroConfig.load(overrides=[f"rounds={AUTO_COMPILE_ROUNDS}"]))
    assert not isinstance(short.minibatch_loss, CompiledOrEager)
    assert isinstance(long.minibatch_loss, CompiledOrEager)


def test_clipping_scales_new_tensors_as_clip_grad_norm_does():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    originals = [t.clone() for t in grads]
    params = [nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t.clone()
    want_norm = nn.utils.clip_grad_norm_(params, 0.5)
    scaled, norm = clipped(grads, 0.5)
    torch.testing.assert_close(norm, want_norm)
    for got, p in zip(scaled, params):
        torch.testing.assert_close(got, p.grad)
    assert all(torch.equal(a, b) for a, b in zip(grads, originals))  # the inputs are left as they were
    small, _ = clipped(grads, 1e6)
    assert all(torch.equal(a, b) for a, b in zip(small, originals))  # under the limit: unchanged values


def test_applying_gradients_leaves_the_callers_gradients_as_they_were(prepared):
    learner, _, data = prepared
    step = PPOLearner(env_spec(ENV), CFG, seed=0)
    step.load_state_dict(*learner.state_dict())
    gradients = step.compute_gradients(data, torch.arange(64))
    held = {k: v.clone() for k, v in gradients.tensors.items()}
    assert step.apply_gradients([gradients])
    assert all(torch.equal(gradients.tensors[k], v) for k, v in held.items())
    big = Gradients({k: v * 1e6 for k, v in held.items()}, samples=64, loss=1.0)  # clipped, certainly
    assert step.apply_gradients([big])
    assert all(torch.equal(big.tensors[k], v * 1e6) for k, v in held.items())


def test_the_learner_threads_default_to_two_only_where_the_actors_wait(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert NitroConfig.load().torch_threads() == 2  # PPO's synchronous round
    assert NitroConfig.load(overrides=["algo=impact"]).torch_threads() == 1  # actors beside the learner
    assert NitroConfig.load(overrides=["learner.mode=stellaris"]).torch_threads() == 1
    assert NitroConfig.load(overrides=["learner_threads=4"]).torch_threads() == 4  # what the user set
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert NitroConfig.load().torch_threads() == 1
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the test session runs
    assert NitroConfig.load().torch_threads() == 1
