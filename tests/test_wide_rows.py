"""The any-width backward's prefetching variant for wide rows (TBEGEN_ANY_WIDTH_PREFETCH; issue 29),
and its single work list (TBEGEN_ANY_WIDTH_ITEMS).

Rows wider than the 4-wide backward takes (512 columns by default: 600- and 1024-wide fp32 rows,
2048-wide fp16 rows, and odd widths) are updated by the any-width kernels
(templates/include/tbegen/cuda_any_width.cuh). With the switch at 1 (and, by default, for float
rows wider than 512 columns) the launch takes their kPrefetch instantiation; at 0 never: the occurrence sum issues a row slice's loads together and starts from
zero, and the warp prefetches the row into L1 before the optimizer's update. The arithmetic and its
order are unchanged, so every weight, state and output must be bitwise those of the default
kernels, for short runs (warp kernel), hot rows (segment and finish kernels), per-sample weights,
mean and none pooling; and the variant must match the float64 reference like the default.
CUDA only (`pytest -m cuda`; skipped without a GPU): the variant has no CPU counterpart.
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness
from tbegen.layout import make_layout

from test_any_width import _train, assert_switch_gives_default_bits, bits_equal as _bits_equal

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_ANY_WIDTH_PREFETCH"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]

# Row 0 of the first table is hot (`hot` extra occurrences a step): with the default
# max_segment_length_per_warp (32) its run is split into segments (segment + finish kernels);
# with 100000 it is one warp's run.
CASES = {
    # 600 and 1024 columns (multiples of 4: the 4-wide occurrence sum; 600 a partial slice pass,
    # and the hot row 600 wide: segment sums of a partial pass)
    "fp32-D600-1024-weighted-hot": harness.Case(tables=((200, 600), (300, 1024)), B=48, max_L=8, weighted=True,
                                                hot=2500, steps=2, seed=901),
    "fp32-D1024-mean-hot-one-warp": harness.Case(tables=((150, 1024),), B=40, max_L=10, pooling="mean", hot=400,
                                                 max_segment_length_per_warp=100000, steps=2, seed=902),
    "fp32-D1024-none": harness.Case(tables=((120, 1024), (90, 1024)), B=24, max_L=5, pooling="none",
                                    weighted=True, hot=200, steps=2, seed=903),
    # 2048 fp16 columns: two slice passes, 16-bit weights through a float copy
    "fp16-D2048-weighted-hot": harness.Case(tables=((100, 2048), (60, 2048)), B=32, max_L=6, weighted=True,
                                            weights_dtype=torch.float16, hot=1500, steps=2, seed=904),
    # an odd width: no 4-wide sum (the column loop), the prefetch before the update only
    "fp32-D1030-odd-hot": harness.Case(tables=((80, 1030), (40, 520)), B=32, max_L=6, weighted=True, hot=900,
                                       steps=2, seed=905),
}


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_prefetch_variant_gives_the_default_bits(load_ops, monkeypatch, name, case_id):
    spec, ops = load_ops(name)
    case = CASES[case_id]
    # One segment length for both kernels: unset, wide fp16 rows on the variant take 64-occurrence
    # segments (cuda_ops.cuh, short_segments_measured_faster), the default kernels 256, and lengths
    # differ in a hot row's rounding (tests/test_segment_length.py), not in what the kernels compute.
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "256")
    monkeypatch.setenv(SWITCH, "0")  # (the default kernels: unset takes the variant for wide float rows)
    out_d, w_d, st_d = _train(ops, spec, case, "cuda")
    monkeypatch.setenv(SWITCH, "1")
    out_v, w_v, st_v = _train(ops, spec, case, "cuda")
    out_v2, w_v2, st_v2 = _train(ops, spec, case, "cuda")
    # the steps changed the weights (else equality would prove nothing)
    gen = torch.Generator().manual_seed(case.seed)
    w0, _ = harness.initial_state(spec, make_layout(case.tables, case.feature_table_map), case, gen)
    assert not torch.equal(w_d, w0), "the two steps left the weights as they were"
    assert _bits_equal(w_v, w_d), f"weights differ from the default path: max |diff| {(w_v.double() - w_d.double()).abs().max():.3g}"
    for k in st_d:
        assert _bits_equal(st_v[k], st_d[k]), f"state {k} differs from the default path"
    for a, b in zip(out_v, out_d):
        assert _bits_equal(a, b), "forward output differs (the second step's uses the updated weights)"
    assert _bits_equal(w_v2, w_v) and all(_bits_equal(st_v2[k], st_v[k]) for k in st_v), "variant not deterministic"
    # the default choice (every case here takes the variant: float rows and fp16 rows wider than 512
    # columns), with the segment length it takes: 64 for the wide fp16 rows, 256 for the float ones
    monkeypatch.delenv(SWITCH)
    monkeypatch.delenv("TBEGEN_SEGMENT_LENGTH")
    out_a, w_a, st_a = _train(ops, spec, case, "cuda")
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "64" if case.weights_dtype == torch.float16 else "256")
    out_e, w_e, st_e = _train(ops, spec, case, "cuda")
    assert _bits_equal(w_a, w_e) and all(_bits_equal(st_a[k], st_e[k]) for k in st_e), "default choice differs"


@pytest.mark.parametrize("case_id", ["fp32-D600-1024-weighted-hot", "fp16-D2048-weighted-hot"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_prefetch_variant_matches_reference(load_ops, monkeypatch, name, case_id):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, "1")
    result = harness.run_case(spec, ops, CASES[case_id], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_prefetch_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D1024-mean-hot-one-warp"], "cuda")


# ---- the single work list (TBEGEN_ANY_WIDTH_ITEMS): short runs and segments in key order ----------
ITEMS = "TBEGEN_ANY_WIDTH_ITEMS"


@pytest.mark.parametrize("length", [None, "64"])
@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_work_list_gives_the_variant_bits(load_ops, monkeypatch, name, case_id, length):
    """The items kernel (one list: every short run and every long run's segments in key order, then
    the finish kernel, on one stream) sums and updates exactly as the segment and warp kernels do
    (the prefetching variant, which alone has it), at the default segment length and at 64."""
    spec, ops = load_ops(name)
    case = CASES[case_id]
    monkeypatch.setenv(SWITCH, "1")
    if length is not None:
        monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", length)
    # (unset: the two kernels)
    assert_switch_gives_default_bits(ops, spec, case, monkeypatch, ITEMS, default="the two kernels'", variant="work list")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_work_list_matches_reference(load_ops, monkeypatch, name):
    spec, ops = load_ops(name)
    monkeypatch.setenv(ITEMS, "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "64")
    result = harness.run_case(spec, ops, CASES["fp32-D600-1024-weighted-hot"], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_work_list_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(ITEMS, value)
    with pytest.raises(Exception, match=ITEMS):
        _train(ops, spec, CASES["fp32-D1024-mean-hot-one-warp"], "cuda")
    # (also where the batch takes the 4-wide kernels, which never use the list: a typo is a typo)
    narrow = harness.Case(tables=((50, 64),), B=8, max_L=4, steps=1, seed=961)
    with pytest.raises(Exception, match=ITEMS):
        _train(ops, spec, narrow, "cuda")


@pytest.mark.parametrize("items", ["0", "1"])
def test_work_list_switch_picks_the_kernels(load_ops, monkeypatch, items):
    """The bitwise test above would pass as well if the list were made and never launched (the two
    kernels give the bits it compares with): the profiler names the any-width kernels that ran."""
    from torch.profiler import ProfilerActivity, profile

    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv(ITEMS, items)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _train(ops, spec, CASES["fp32-D600-1024-weighted-hot"], "cuda")
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    ran = {k: any(k in n for n in names) for k in ("backward_items_kernel", "backward_segment_kernel",
                                                   "backward_warp_kernel", "backward_finish_kernel")}
    expected = {"backward_items_kernel": items == "1", "backward_segment_kernel": items == "0",
                "backward_warp_kernel": items == "0", "backward_finish_kernel": True}
    assert ran == expected, f"kernels that ran {ran}, expected {expected}; profiler names: {names}"
