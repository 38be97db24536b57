"""The prefetching any-width kernels' occupancy variant (TBEGEN_ANY_WIDTH_OCCUPANCY; issue 29), float
rows' default since landing12 with its shared row (TBEGEN_ANY_WIDTH_SHARED_ROW).

Float rows that take the prefetching any-width kernels (by default, rows wider than 512 columns)
take by default the same kernels under __launch_bounds__(256, 3) (24 warps per multiprocessor
instead of 16), their occurrence sum in 512-column passes taking two occurrences at a time, a hot
row's segment sums added two at a time, and each warp's summed gradient row in dynamic shared memory
instead of its global scratch row where it fits (rows of at most 1536 columns;
templates/include/tbegen/cuda_any_width.cuh, occupancy_from_env and shared_row_from_env).
TBEGEN_ANY_WIDTH_OCCUPANCY=0 is the way back to the 2-block prefetching kernels,
TBEGEN_ANY_WIDTH_SHARED_ROW=0 keeps the occupancy kernels with the scratch row, and SHARED_ROW=1
with OCCUPANCY=0 is refused. Every column's sum has the same terms in the same order, so weights,
states and outputs must be bitwise the same on every path: for short runs (warp kernel), hot rows
(segment and finish kernels, an odd and an even number of segments), the work list
(TBEGEN_ANY_WIDTH_ITEMS=1), runs of odd and even lengths (the pairs' tail), a 1024-wide row (two
full passes), 600- and 1000-wide rows (a partial second pass), an odd width (no 4-wide sum: the
column loop), per-sample weights, mean and none pooling, a 1536-wide row (the widest shared row,
48 KB a block) and a 2000-wide one (the scratch row whatever the switch). The profiler's kernel
names and launch records check that each setting reaches its kernels. CUDA only (`pytest -m cuda`;
skipped without a GPU): the kernels have no CPU counterpart.
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness
from tbegen.layout import make_layout

from test_any_width import _train, bits_equal

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_ANY_WIDTH_OCCUPANCY"
SHARED = "TBEGEN_ANY_WIDTH_SHARED_ROW"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]

# Row 0 of the first table is hot (`hot` extra occurrences a step): with the default
# max_segment_length_per_warp (32) its run is split into segments of TBEGEN_SEGMENT_LENGTH.
CASES = {
    # 1024 columns: two full 512-column passes; the hot row's 2500 + occurrences in segments
    "fp32-D1024-weighted-hot": harness.Case(tables=((300, 1024), (200, 1024)), B=48, max_L=8, weighted=True,
                                            hot=2500, steps=2, seed=1901),
    # 600 and 1000 columns: a partial second pass (88 and 488 columns); mean pooling
    "fp32-D600-1000-mean-hot": harness.Case(tables=((200, 600), (150, 1000)), B=40, max_L=9, pooling="mean",
                                            hot=700, steps=2, seed=1902),
    # the hot row as one warp's run (max_segment_length_per_warp 100000: the warp kernel only)
    "fp32-D1024-mean-hot-one-warp": harness.Case(tables=((150, 1024),), B=40, max_L=10, pooling="mean", hot=400,
                                                 max_segment_length_per_warp=100000, steps=2, seed=1903),
    "fp32-D1024-none": harness.Case(tables=((120, 1024), (90, 1024)), B=24, max_L=5, pooling="none",
                                    weighted=True, hot=200, steps=2, seed=1904),
    # an odd width: the column loop's sum (no 4-wide rows), under the variant's launch bounds
    "fp32-D1030-odd-hot": harness.Case(tables=((80, 1030), (40, 520)), B=32, max_L=6, weighted=True, hot=900,
                                       steps=2, seed=1905),
}

# (for the shared row's tests: the widest row that has one, and one wider)
SHARED_CASES = dict(CASES)
# the widest row with a shared row (kSharedRowMaxD: 8 warps x 1536 floats = 48 KB a block)
SHARED_CASES["fp32-D1536-hot"] = harness.Case(tables=((60, 1536), (40, 700)), B=16, max_L=5, hot=600, steps=2,
                                              seed=1907)
# wider than kSharedRowMaxD (1536): the scratch row, whatever the switch
SHARED_CASES["fp32-D2000-weighted-hot"] = harness.Case(tables=((60, 2000), (40, 1024)), B=16, max_L=5, weighted=True,
                                                       hot=600, steps=2, seed=1906)


@pytest.fixture(autouse=True)
def _switches_unset(monkeypatch):
    """Each test starts from the default (neither switch set, whatever the caller's environment)."""
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.delenv(SHARED, raising=False)


def assert_default_gives_the_way_back_bits(ops, spec, case, monkeypatch, switch, way_back):
    """Two steps with `switch` unset (the default) give bitwise the weights, states and outputs of
    two steps with it at 0 (`way_back`; the steps changed the weights), twice the same, and 1 gives
    the bits of unset."""
    monkeypatch.setenv(switch, "0")
    out_b, w_b, st_b = _train(ops, spec, case, "cuda")
    monkeypatch.delenv(switch)
    out_d, w_d, st_d = _train(ops, spec, case, "cuda")
    _, w_d2, st_d2 = _train(ops, spec, case, "cuda")
    gen = torch.Generator().manual_seed(case.seed)
    w0, _ = harness.initial_state(spec, make_layout(case.tables, case.feature_table_map), case, gen)
    assert not torch.equal(w_b, w0), "the two steps left the weights as they were"
    assert bits_equal(w_d, w_b), f"weights differ from {way_back}: max |diff| {(w_d.double() - w_b.double()).abs().max():.3g}"
    for k in st_b:
        assert bits_equal(st_d[k], st_b[k]), f"state {k} differs from {way_back}"
    for a, b in zip(out_d, out_b):
        assert bits_equal(a, b), "forward output differs (the second step's uses the updated weights)"
    assert bits_equal(w_d2, w_d) and all(bits_equal(st_d2[k], st_d[k]) for k in st_d), "the default not deterministic"
    monkeypatch.setenv(switch, "1")
    _, w_1, st_1 = _train(ops, spec, case, "cuda")
    assert bits_equal(w_1, w_d) and all(bits_equal(st_1[k], st_d[k]) for k in st_d), f"{switch}=1 differs from unset"


@pytest.mark.parametrize("length", ["256", "48"])
@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_default_gives_the_two_block_kernels_bits(load_ops, monkeypatch, name, case_id, length):
    """The default (the occupancy kernels, the shared row where it fits) bitwise against the 2-block
    prefetching kernels (=0), at two segment lengths (the hot rows' runs of about 2500 and 700
    occurrences: about 10 and 3 segments at 256, 53 and 15 at 48, so the finish kernel's pairs of
    segment sums run with and without a single one left), twice the same."""
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", length)
    assert_default_gives_the_way_back_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH,
                                           way_back="the 2-block prefetching kernels")


@pytest.mark.parametrize("case_id", ["fp32-D1024-weighted-hot", "fp32-D600-1000-mean-hot"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_default_with_the_work_list(load_ops, monkeypatch, name, case_id):
    """The items kernel and the finish kernel after it on one stream (TBEGEN_ANY_WIDTH_ITEMS=1), at
    64-occurrence segments: the default's bits are the 2-block list's."""
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "64")
    assert_default_gives_the_way_back_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH,
                                           way_back="the work list's 2-block prefetching kernels")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_default_at_the_default_choice(load_ops, monkeypatch, name):
    """Nothing else set (the cell the variant is for: float rows wider than 512 columns take the
    prefetching kernels and 256-occurrence segments by default): unset gives =0's bits."""
    spec, ops = load_ops(name)
    for k in ("TBEGEN_ANY_WIDTH_PREFETCH", "TBEGEN_SEGMENT_LENGTH", "TBEGEN_ANY_WIDTH_ITEMS"):
        monkeypatch.delenv(k, raising=False)
    assert_default_gives_the_way_back_bits(ops, spec, CASES["fp32-D1024-weighted-hot"], monkeypatch, SWITCH,
                                           way_back="the 2-block prefetching kernels")


@pytest.mark.parametrize("case_id", ["fp32-D1024-weighted-hot", "fp32-D600-1000-mean-hot"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_default_matches_reference(load_ops, name, case_id):
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, CASES[case_id], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1"])
def test_occupancy_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D1024-mean-hot-one-warp"], "cuda")


@pytest.mark.parametrize("items", ["0", "1"])
@pytest.mark.parametrize("occupancy", ["unset", "0", "1"])
def test_occupancy_switch_picks_the_kernels(load_ops, monkeypatch, occupancy, items):
    """The bitwise tests above would pass as well if every setting launched the same kernels: the
    profiler names the kernels that ran (the occupancy kernels are `..._occupancy<Opt, W>`, the
    2-block prefetching kernels `...<Opt, W, true>`)."""
    from torch.profiler import ProfilerActivity, profile

    spec, ops = load_ops("sgd")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", items)
    if occupancy != "unset":
        monkeypatch.setenv(SWITCH, occupancy)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _train(ops, spec, CASES["fp32-D1024-weighted-hot"], "cuda")
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    kernels = ("backward_finish_kernel",) + (("backward_items_kernel",) if items == "1" else
                                             ("backward_segment_kernel", "backward_warp_kernel"))
    for k in kernels:
        variant = [n for n in names if f"any_width::{k}_occupancy<" in n]
        plain = [n for n in names if f"any_width::{k}<" in n]
        if occupancy != "0":
            assert variant and not plain, f"{k}: occupancy {variant}, 2-block {plain}; expected the occupancy kernels only"
        else:
            assert plain and not variant, f"{k}: occupancy {variant}, 2-block {plain}; expected the 2-block kernels only"
            assert all("float, true>" in n for n in plain), f"{k} ran as {plain}, not the prefetching instantiation"


# ---- TBEGEN_ANY_WIDTH_SHARED_ROW: the summed row in shared memory (the occupancy kernels' default) ---


@pytest.mark.parametrize("case_id", sorted(SHARED_CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_shared_row_gives_the_scratch_row_bits(load_ops, monkeypatch, name, case_id):
    """The default (the shared row where it fits) bitwise against the occupancy kernels' scratch row
    (TBEGEN_ANY_WIDTH_SHARED_ROW=0), =1 against unset."""
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "48")
    assert_default_gives_the_way_back_bits(ops, spec, SHARED_CASES[case_id], monkeypatch, SHARED,
                                           way_back="the occupancy kernels' scratch row")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_path_gives_the_two_block_kernels_bits(load_ops, monkeypatch, name):
    """At the default choice (nothing else set), with the work list and without it: the default and
    the occupancy kernels with the scratch row give the 2-block kernels' bits (=0, no work list: the
    default before landing12)."""
    spec, ops = load_ops(name)
    case = CASES["fp32-D1024-weighted-hot"]
    for k in ("TBEGEN_ANY_WIDTH_PREFETCH", "TBEGEN_SEGMENT_LENGTH", "TBEGEN_ANY_WIDTH_ITEMS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(SWITCH, "0")
    _, w_b, st_b = _train(ops, spec, case, "cuda")
    monkeypatch.delenv(SWITCH)
    for items in ("0", "1"):
        monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", items)
        for shared in ("unset", "0"):
            if shared == "unset":
                monkeypatch.delenv(SHARED, raising=False)
            else:
                monkeypatch.setenv(SHARED, shared)
            _, w_v, st_v = _train(ops, spec, case, "cuda")
            where = f"work list {items}, {SHARED} {shared}"
            assert torch.equal(w_v, w_b), f"weights differ from the 2-block kernels ({where})"
            assert all(torch.equal(st_v[k], st_b[k]) for k in st_b), f"states differ ({where})"


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1"])
def test_shared_row_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SHARED, value)
    with pytest.raises(Exception, match=SHARED):
        _train(ops, spec, CASES["fp32-D1024-mean-hot-one-warp"], "cuda")


def test_shared_row_refused_with_the_two_block_kernels(load_ops, monkeypatch):
    """SHARED_ROW=1 with OCCUPANCY=0 asks for a path that does not exist: refused, naming the switch
    that turned the occupancy kernels off; SHARED_ROW=0 with it is consistent, and trains."""
    spec, ops = load_ops("sgd")
    case = CASES["fp32-D1024-mean-hot-one-warp"]
    monkeypatch.setenv(SWITCH, "0")
    monkeypatch.setenv(SHARED, "1")
    with pytest.raises(Exception, match="TBEGEN_ANY_WIDTH_OCCUPANCY=0"):
        _train(ops, spec, case, "cuda")
    monkeypatch.setenv(SHARED, "0")
    _, w, _ = _train(ops, spec, case, "cuda")
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("case_id, shared, expect_shared", [("fp32-D1024-weighted-hot", "unset", True),
                                                            ("fp32-D1024-weighted-hot", "0", False),
                                                            ("fp32-D1024-weighted-hot", "1", True),
                                                            ("fp32-D1536-hot", "unset", True),
                                                            ("fp32-D2000-weighted-hot", "unset", False),
                                                            ("fp32-D2000-weighted-hot", "1", False)])
def test_the_occupancy_kernels_launch_config(load_ops, monkeypatch, tmp_path, case_id, shared, expect_shared):
    """The bitwise tests would pass as well if the rows stayed in scratch or the kernels kept the
    2-block kernels' registers: the trace's kernel records say the `_occupancy` kernels ran (with
    neither switch set) with at most 80 registers a thread (3 blocks of 256 per multiprocessor), and
    with shared memory (8 warps x max_D floats) exactly where the rows fit and the switch does not
    turn it off."""
    import json

    from torch.profiler import ProfilerActivity, profile

    spec, ops = load_ops("sgd")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    if shared != "unset":
        monkeypatch.setenv(SHARED, shared)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _train(ops, spec, SHARED_CASES[case_id], "cuda")
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("cat") == "kernel" and "_occupancy<" in e.get("name", "")]
    assert events, "no _occupancy kernel in the trace"
    for e in events:
        args = e.get("args", {})
        assert 0 < args["registers per thread"] <= 80, f"{e['name']}: {args}"
        assert (args["shared memory"] > 0) == expect_shared, f"{e['name']}: {args}"
