"""Int per-row states (`type: int` on a state; docs/spec-language.md): exact int64 storage read
and written as `int64_t` in snippets, checked exactly against the reference, and kept exact where
float32 would not be (step numbers beyond 2^24). rowwise_adagrad_with_counter's `prev_iter` is the
shipped user; the numerical grid (tests/test_numerics.py) runs it against its reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tbegen import harness
from tbegen.layout import POOLING, make_layout
from tbegen.module import TableBatchedEmbeddingBags

NAME = "rowwise_adagrad_with_counter"


def test_harness_compares_int_states_exactly(load_ops):
    spec, ops = load_ops(NAME)
    case = harness.Case(seed=8)
    assert not harness.run_case(spec, ops, case).failures
    off_by_one = dataclasses.replace(spec, reference=dataclasses.replace(
        spec.reference, code=spec.reference.code.replace("torch.full_like(prev_iter, step)", "torch.full_like(prev_iter, step + 1)")))
    assert off_by_one.reference.code != spec.reference.code
    failures = harness.run_case(off_by_one, ops, case).failures
    assert any("int state prev_iter" in f for f in failures), failures


def test_harness_catches_a_wrong_counter_decay(load_ops):
    spec, ops = load_ops(NAME)
    case = harness.Case(seed=9, hyper=(("counter_halflife", 5),))
    assert not harness.run_case(spec, ops, case).failures
    wrong = dataclasses.replace(spec, reference=dataclasses.replace(
        spec.reference, code=spec.reference.code.replace("math.log(2)", "math.log(2.2)")))
    assert wrong.reference.code != spec.reference.code
    assert any("row_counter" in f for f in harness.run_case(wrong, ops, case).failures)


def test_step_numbers_beyond_float32_stay_exact(load_ops):
    """At step 2^25 + 1 a float32 would round the step to 2^25; the int state holds it."""
    spec, ops = load_ops(NAME)
    layout = make_layout([(10, 8)])
    step = 2**25 + 1
    w = torch.rand(80)
    states = {"momentum": torch.zeros(10), "prev_iter": torch.zeros(10, dtype=torch.int64),
              "row_counter": torch.zeros(10), "max_counter": torch.ones(1)}
    hyper = harness.default_hyperparameters(spec, {})
    idx = torch.tensor([3, 7, 3])
    off = torch.tensor([0, 2, 3])
    ops.backward(torch.randn(2, 8), w, layout.features_tensor("cpu"), 8, 8, 10, idx, off, None,
                 POOLING["sum"], 32, False, 0, *harness.state_args(spec, layout, states, "cpu"),
                 *[hyper[h.name] for h in spec.hyperparameters], step)
    assert states["prev_iter"].tolist() == [0, 0, 0, step, 0, 0, 0, step, 0, 0]
    assert float(step) != float(torch.tensor(step, dtype=torch.float32))  # (what float32 would have stored)
    assert states["row_counter"].tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]  # once per step, not per occurrence


def test_operator_refuses_a_float_int_state(load_ops):
    spec, ops = load_ops(NAME)
    layout = make_layout([(10, 8)])
    hyper = harness.default_hyperparameters(spec, {})
    states = {"momentum": torch.zeros(10), "prev_iter": torch.zeros(10), "row_counter": torch.zeros(10),
              "max_counter": torch.ones(1)}
    with pytest.raises(RuntimeError, match="int state 'prev_iter' must be int64, got Float"):
        ops.backward(torch.randn(1, 8), torch.rand(80), layout.features_tensor("cpu"), 8, 8, 10, torch.tensor([1]),
                     torch.tensor([0, 1]), None, 0, 32, False, 0, *harness.state_args(spec, layout, states, "cpu"),
                     *[hyper[h.name] for h in spec.hyperparameters], 1)


def test_module_holds_int_states_as_int64():
    m = TableBatchedEmbeddingBags([(30, 8), (20, 4)], optimizer=NAME, learning_rate=0.1)
    assert m.optimizer_state("prev_iter").dtype == torch.int64
    assert m.state_dict()["states.prev_iter"].dtype == torch.int64
    idx, off = torch.tensor([1, 2, 2, 5]), torch.tensor([0, 2, 3, 4, 4])  # B = 2 bags per table
    for _ in range(3):
        m(idx, off).sum().backward()
    views = m.split_optimizer_states()
    assert views[0]["prev_iter"].dtype == torch.int64
    assert views[0]["prev_iter"][[1, 2]].tolist() == [3, 3] and views[0]["prev_iter"][0].item() == 0
    assert views[1]["prev_iter"][5].item() == 3
    assert views[0]["row_counter"][[1, 2]].tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="an int state"):
        TableBatchedEmbeddingBags([(30, 8)], optimizer=NAME, state_dtypes={"prev_iter": torch.bfloat16})
