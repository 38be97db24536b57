"""The long runs' segment length (TBEGEN_SEGMENT_LENGTH; issue 29, wide rows).

A run of at least max_segment_length_per_warp occurrences (a hot row) is cut into segments: one
warp sums each segment, and a run of several segments is finished by one more warp that adds the
segments' sums in segment order. The segment is 256 occurrences, 64 for float rows of 385-512
columns on the 4-wide kernels and for fp16 rows wider than 512 (measured faster there, landing10),
unless TBEGEN_SEGMENT_LENGTH says otherwise (16 to 65536): shorter segments keep the band of occurrences the resident warps read at
once within fewer tables, so that their output-gradient rows stay in L2 (benchmarks/tools/l2_model.py).
A length changes where a hot row's float sum is split, so its bits may differ from the default's by
rounding; what must hold at every length: the float64 reference is matched, two runs give the same
bits, unset is the length chosen for the batch, and a bad value is refused before anything is written.
CUDA only (`pytest -m cuda`; skipped without a GPU): the CPU backward has no segments.
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness
from tbegen.layout import make_layout

from test_any_width import _train, bits_equal

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_SEGMENT_LENGTH"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]

# Row 0 of the first table is hot (`hot` extra occurrences a step): split into many segments at
# every length tried (16 to 1000), one segment at 65536.
CASES = {
    # the 4-wide kernels (ticketed segment kernel), two widths in one batch, weighted
    "fp32-D128-64-weighted-hot": harness.Case(tables=((300, 128), (200, 64)), B=64, max_L=8, weighted=True,
                                              hot=3000, steps=2, seed=951),
    # the any-width kernels (rows wider than 512), mean pooling
    "fp32-D1024-mean-hot": harness.Case(tables=((150, 1024), (80, 600)), B=40, max_L=10, pooling="mean",
                                        hot=2000, steps=2, seed=952),
    # 16-bit weights through a float copy, 2048 wide
    "fp16-D2048-hot": harness.Case(tables=((100, 2048),), B=32, max_L=6, weights_dtype=torch.float16,
                                   hot=1500, steps=2, seed=953),
    # the widest 4-wide rows (512 columns) beside narrow ones: unset takes 64 for the whole batch
    "fp32-D512-32-hot": harness.Case(tables=((200, 512), (100, 32)), B=48, max_L=8, hot=2500, steps=2, seed=954),
}
# what unset takes (cuda_ops.cuh, segment_length): 64 where it was measured faster, else 256
UNSET_LENGTH = {"fp32-D128-64-weighted-hot": "256", "fp32-D1024-mean-hot": "256", "fp16-D2048-hot": "64",
                "fp32-D512-32-hot": "64"}


@pytest.mark.parametrize("length", ["16", "64", "1000"])
@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_segment_length_matches_reference(load_ops, monkeypatch, name, case_id, length):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, length)
    result = harness.run_case(spec, ops, CASES[case_id], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_segment_length_is_deterministic_and_unset_is_the_batch_choice(load_ops, monkeypatch, name, case_id):
    spec, ops = load_ops(name)
    case = CASES[case_id]
    monkeypatch.setenv(SWITCH, UNSET_LENGTH[case_id])
    out_d, w_d, st_d = _train(ops, spec, case, "cuda")
    gen = torch.Generator().manual_seed(case.seed)
    w0, _ = harness.initial_state(spec, make_layout(case.tables, case.feature_table_map), case, gen)
    assert not torch.equal(w_d, w0), "the two steps left the weights as they were"
    monkeypatch.delenv(SWITCH)
    out_u, w_u, st_u = _train(ops, spec, case, "cuda")
    assert bits_equal(w_u, w_d) and all(bits_equal(st_u[k], st_d[k]) for k in st_d), f"unset differs from {UNSET_LENGTH[case_id]}"
    monkeypatch.setenv(SWITCH, "16")
    out_a, w_a, st_a = _train(ops, spec, case, "cuda")
    out_b, w_b, st_b = _train(ops, spec, case, "cuda")
    assert bits_equal(w_a, w_b) and all(bits_equal(st_a[k], st_b[k]) for k in st_a), "length 16 not deterministic"
    for a, b in zip(out_a, out_b):
        assert bits_equal(a, b), "forward output not deterministic"


def test_segment_length_is_read(load_ops, monkeypatch):
    """The switch reaches the kernels: the hot row's fp32 sum of over 3000 occurrences, split into
    about 190 segments of 16 instead of 12 of 256, rounds differently in some of its 128 columns."""
    spec, ops = load_ops("sgd")
    case = CASES["fp32-D128-64-weighted-hot"]
    monkeypatch.setenv(SWITCH, "256")
    _, w_d, _ = _train(ops, spec, case, "cuda")
    monkeypatch.setenv(SWITCH, "16")
    _, w_s, _ = _train(ops, spec, case, "cuda")
    assert not torch.equal(w_s, w_d), "a length of 16 gave the bits of 256: the switch is not read"
    assert (w_s.double() - w_d.double()).abs().max() < 1e-3, "the two lengths disagree beyond rounding"


@pytest.mark.parametrize("value", ["abc", "8", "70000", "-64", "64x", "+64", " 64"])
def test_segment_length_refuses_bad_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D128-64-weighted-hot"], "cuda")


@pytest.mark.parametrize("case_id", [c for c, n in UNSET_LENGTH.items() if n != "256"])
def test_unset_takes_the_short_segments_where_they_were_measured_faster(load_ops, monkeypatch, case_id):
    """Unset is 64 for 512-wide float rows and wide fp16 rows (not 256): the hot row's sum, split
    into segments of 64 instead of 256, rounds differently in some column."""
    spec, ops = load_ops("sgd")
    case = CASES[case_id]
    monkeypatch.setenv(SWITCH, "256")
    _, w_256, _ = _train(ops, spec, case, "cuda")
    monkeypatch.delenv(SWITCH)
    _, w_u, _ = _train(ops, spec, case, "cuda")
    assert not torch.equal(w_u, w_256), "unset gave the bits of 256: the batch's choice of 64 is not made"
