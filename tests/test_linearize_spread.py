"""Several warps per group of 32 bags in the backward's linearize (TBEGEN_LINEARIZE_SPREAD; issue 29).

The linearize (templates/include/tbegen/cuda_kernels.cuh, linearize_kernel) writes each index's
key and value, a warp per 32 bags walking their indices 32 at a time. A batch of few, long bags
(the sweep's "random 3": T=8 B=4096 L=80) gives 1024 such warps, 8 per multiprocessor of the H200;
with the switch at 1 (the default since landing11: random 3's backward 10-31% faster on the H100)
up to 8 warps share a group, each walking every spread-th block of 32 of its
indices, so every index gets the same key and value: every weight, state and output must be
bitwise those of one warp per group (=0), in batches where the choice is 2, 4 and 8 warps (few bags of up to 400
indices), and 1 (many short bags: the switch changes nothing there), weighted, mean and sum,
int32 and int64 indices, with hot rows.
CUDA only (`pytest -m cuda`; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness

from test_any_width import _train, assert_switch_gives_default_bits

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_LINEARIZE_SPREAD"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]

CASES = {
    # 2 features x 16 bags: one group of 32 bags (and the empty one after it), ~200 indices a bag
    "fp32-D32-16-long-bags": harness.Case(tables=((500, 32), (300, 16)), B=16, max_L=400, hot=600, steps=2,
                                          seed=1201),
    # mean pooling and per-sample weights: the positions' bags and scales written beside the keys
    "fp32-D32-mean-weighted-long-bags": harness.Case(tables=((800, 32),), B=48, max_L=300, pooling="mean",
                                                     weighted=True, hot=400, steps=2, seed=1202),
    "fp16-D64-i32-long-bags": harness.Case(tables=((400, 64), (200, 8)), B=24, max_L=200,
                                           weights_dtype=torch.float16, index_dtype=torch.int32, hot=300,
                                           steps=2, seed=1203),
    # many short bags: one warp per group whatever the switch says
    "fp32-D32-many-short-bags": harness.Case(tables=((300, 32), (200, 8)), B=512, max_L=4, hot=100, steps=2,
                                             seed=1204),
}


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_spread_gives_the_default_bits(load_ops, monkeypatch, name, case_id):
    spec, ops = load_ops(name)
    assert_switch_gives_default_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH, default="one warp per group",
                                     variant="spread linearize")


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_spread_matches_reference(load_ops, monkeypatch, name):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, "1")
    result = harness.run_case(spec, ops, CASES["fp32-D32-mean-weighted-long-bags"], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("value", ["2", "yes", "true"])
def test_spread_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D32-many-short-bags"], "cuda")
