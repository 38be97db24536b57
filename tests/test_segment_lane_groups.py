"""Narrow hot rows summed by all four lane groups (TBEGEN_SEGMENT_LANE_GROUPS; issue 29).

A hot row's run (at least max_segment_length_per_warp occurrences) is summed by the 4-wide
segment kernel, a segment per warp, and a run of several segments is finished by one more warp
that adds the segments' partial sums. For rows of at most 32 columns only lanes 0-7 hold columns;
with the switch at 1 the warp's four groups of 8 lanes load other occurrences' rows (and partial
sums) and lanes 0-7 add them in the same order, so every weight, state and output must be bitwise
the default's: rows of 4, 8, 20 and 32 columns, beside wider ones (whose kernels are unchanged),
weighted, mean, pooling none, one segment and many (TBEGEN_SEGMENT_LENGTH=16: more partial sums
than one round of the finish kernel's loads takes).
CUDA only (`pytest -m cuda`; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness

from test_any_width import _train, assert_switch_gives_default_bits

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_SEGMENT_LANE_GROUPS"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]

# Row 0 of the first table is hot (`hot` extra occurrences a step): its run is cut into segments.
CASES = {
    "fp32-D20-hot": harness.Case(tables=((400, 20),), B=64, max_L=8, hot=3000, steps=2, seed=971),
    "fp32-D4-8-32-128-weighted-hot": harness.Case(tables=((300, 4), (200, 8), (250, 32), (100, 128)), B=48,
                                                  max_L=6, weighted=True, hot=1200, steps=2, seed=972),
    "fp32-D32-mean-hot-short-threshold": harness.Case(tables=((500, 32), (300, 16)), B=64, max_L=10,
                                                      pooling="mean", hot=700, max_segment_length_per_warp=4,
                                                      steps=2, seed=973),
    "fp16-D20-64-hot": harness.Case(tables=((300, 20), (200, 64)), B=48, max_L=6, weights_dtype=torch.float16,
                                    hot=900, steps=2, seed=974),
    # pooling none: each occurrence's output-gradient row found from its position, not its bag
    "fp32-D20-none-weighted-hot": harness.Case(tables=((300, 20), (200, 20)), B=48, max_L=6, pooling="none",
                                               weighted=True, hot=1500, steps=2, seed=975),
}


@pytest.mark.parametrize("length", [None, "16"])
@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_lane_groups_give_the_default_bits(load_ops, monkeypatch, name, case_id, length):
    spec, ops = load_ops(name)
    case = CASES[case_id]
    if length is not None:
        monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", length)
    assert_switch_gives_default_bits(ops, spec, case, monkeypatch, SWITCH)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_lane_groups_match_reference(load_ops, monkeypatch, name):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "16")
    result = harness.run_case(spec, ops, CASES["fp32-D4-8-32-128-weighted-hot"], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_lane_groups_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D20-hot"], "cuda")
