"""The prefetching any-width kernels' occupancy variant (TBEGEN_ANY_WIDTH_OCCUPANCY; issue 29).

With the switch at 1, float rows that take the prefetching any-width kernels (by default, rows wider
than 512 columns) take the same kernels under __launch_bounds__(256, 3) (24 warps per
multiprocessor instead of 16), their occurrence sum in 512-column passes taking two occurrences at a
time, and a hot row's segment sums added two at a time (templates/include/tbegen/cuda_any_width.cuh,
occupancy_from_env). Every column's sum has the same terms in the same order, so weights, states
and outputs must be bitwise those of the prefetching kernels: for short runs (warp kernel), hot rows
(segment and finish kernels, an odd and an even number of segments), the work list
(TBEGEN_ANY_WIDTH_ITEMS=1), runs of odd and even lengths (the pairs' tail), a 1024-wide row (two
full passes), 600- and 1000-wide rows (a partial second pass), an odd width (no 4-wide sum: the
launch bounds only), per-sample weights, mean and none pooling. CUDA only (`pytest -m cuda`;
skipped without a GPU): the variant has no CPU counterpart.

TBEGEN_ANY_WIDTH_SHARED_ROW=1 (an option of the occupancy variant) puts each warp's summed gradient
row in dynamic shared memory instead of its global scratch row, for rows of at most 1536 columns:
the same arithmetic, so the same bits again, for the 4-wide sums and the column loop (D=1030), and
a row wider than 1536 keeps the scratch row.
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness

from test_any_width import _train, assert_switch_gives_default_bits

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_ANY_WIDTH_OCCUPANCY"
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


@pytest.mark.parametrize("length", ["256", "48"])
@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_occupancy_variant_gives_the_prefetching_kernels_bits(load_ops, monkeypatch, name, case_id, length):
    """Bitwise against the prefetching kernels (unset and 0), at two segment lengths (the hot rows'
    runs of about 2500 and 700 occurrences: about 10 and 3 segments at 256, 53 and 15 at 48, so
    the finish kernel's pairs of segment sums run with and without a single one left), twice the
    same."""
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", length)
    assert_switch_gives_default_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH,
                                     default="the prefetching kernels", variant="occupancy variant")


@pytest.mark.parametrize("case_id", ["fp32-D1024-weighted-hot", "fp32-D600-1000-mean-hot"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_occupancy_variant_with_the_work_list(load_ops, monkeypatch, name, case_id):
    """The items kernel and the finish kernel after it on one stream (TBEGEN_ANY_WIDTH_ITEMS=1), at
    64-occurrence segments: the variant's bits are the list's without it."""
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "64")
    assert_switch_gives_default_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH,
                                     default="the work list's prefetching kernels", variant="occupancy variant")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_occupancy_variant_at_the_default_choice(load_ops, monkeypatch, name):
    """Nothing else set (the cell the variant is for: float rows wider than 512 columns take the
    prefetching kernels and 256-occurrence segments by default): 1 gives unset's bits."""
    spec, ops = load_ops(name)
    for k in ("TBEGEN_ANY_WIDTH_PREFETCH", "TBEGEN_SEGMENT_LENGTH", "TBEGEN_ANY_WIDTH_ITEMS"):
        monkeypatch.delenv(k, raising=False)
    assert_switch_gives_default_bits(ops, spec, CASES["fp32-D1024-weighted-hot"], monkeypatch, SWITCH)


@pytest.mark.parametrize("case_id", ["fp32-D1024-weighted-hot", "fp32-D600-1000-mean-hot"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_occupancy_variant_matches_reference(load_ops, monkeypatch, name, case_id):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, "1")
    result = harness.run_case(spec, ops, CASES[case_id], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1"])
def test_occupancy_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D1024-mean-hot-one-warp"], "cuda")


@pytest.mark.parametrize("items", ["0", "1"])
@pytest.mark.parametrize("occupancy", ["0", "1"])
def test_occupancy_switch_picks_the_kernels(load_ops, monkeypatch, occupancy, items):
    """The bitwise tests above would pass as well if the switch launched the prefetching kernels
    unchanged: the profiler names the kernels that ran (the variant's are `..._occupancy<Opt, W>`,
    the prefetching kernels `...<Opt, W, true>`)."""
    from torch.profiler import ProfilerActivity, profile

    spec, ops = load_ops("sgd")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", items)
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
        if occupancy == "1":
            assert variant and not plain, f"{k}: variant {variant}, prefetching {plain}; expected the variant only"
        else:
            assert plain and not variant, f"{k}: variant {variant}, prefetching {plain}; expected the prefetching only"
            assert all("float, true>" in n for n in plain), f"{k} ran as {plain}, not the prefetching instantiation"


# ---- TBEGEN_ANY_WIDTH_SHARED_ROW: the summed row in shared memory (with the occupancy variant) -----
SHARED = "TBEGEN_ANY_WIDTH_SHARED_ROW"
SHARED_CASES = dict(CASES)
# wider than kSharedRowMaxD (1536): the scratch row, whatever the switch
SHARED_CASES["fp32-D2000-weighted-hot"] = harness.Case(tables=((60, 2000), (40, 1024)), B=16, max_L=5, weighted=True,
                                                       hot=600, steps=2, seed=1906)


@pytest.mark.parametrize("case_id", sorted(SHARED_CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_shared_row_gives_the_occupancy_variant_bits(load_ops, monkeypatch, name, case_id):
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "48")
    monkeypatch.setenv(SWITCH, "1")
    assert_switch_gives_default_bits(ops, spec, SHARED_CASES[case_id], monkeypatch, SHARED,
                                     default="the occupancy variant's scratch row", variant="shared row")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_shared_row_gives_the_prefetching_kernels_bits(load_ops, monkeypatch, name):
    """Directly against the default choice (nothing else set), with the work list as well."""
    spec, ops = load_ops(name)
    case = CASES["fp32-D1024-weighted-hot"]
    for k in ("TBEGEN_ANY_WIDTH_PREFETCH", "TBEGEN_SEGMENT_LENGTH", "TBEGEN_ANY_WIDTH_ITEMS", SWITCH, SHARED):
        monkeypatch.delenv(k, raising=False)
    _, w_d, st_d = _train(ops, spec, case, "cuda")
    for items in ("0", "1"):
        monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", items)
        monkeypatch.setenv(SWITCH, "1")
        monkeypatch.setenv(SHARED, "1")
        _, w_v, st_v = _train(ops, spec, case, "cuda")
        assert torch.equal(w_v, w_d), f"weights differ from the default choice (work list {items})"
        assert all(torch.equal(st_v[k], st_d[k]) for k in st_d), f"states differ (work list {items})"


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1"])
def test_shared_row_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv(SHARED, value)
    with pytest.raises(Exception, match=SHARED):
        _train(ops, spec, CASES["fp32-D1024-mean-hot-one-warp"], "cuda")


def test_shared_row_refused_without_the_occupancy_variant(load_ops, monkeypatch):
    spec, ops = load_ops("sgd")
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv(SHARED, "1")
    with pytest.raises(Exception, match="TBEGEN_ANY_WIDTH_OCCUPANCY"):
        _train(ops, spec, CASES["fp32-D1024-mean-hot-one-warp"], "cuda")


@pytest.mark.parametrize("case_id, shared, expect_shared", [("fp32-D1024-weighted-hot", "0", False),
                                                            ("fp32-D1024-weighted-hot", "1", True),
                                                            ("fp32-D2000-weighted-hot", "1", False)])
def test_the_variant_kernels_launch_config(load_ops, monkeypatch, tmp_path, case_id, shared, expect_shared):
    """The bitwise tests would pass as well if the rows stayed in scratch or the kernels kept the
    prefetching kernels' registers: the trace's kernel records say the `_occupancy` kernels ran with
    at most 80 registers a thread (3 blocks of 256 per multiprocessor), and with shared memory
    (8 warps x max_D floats) exactly where the switch asks and the rows fit."""
    import json

    from torch.profiler import ProfilerActivity, profile

    spec, ops = load_ops("sgd")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_PREFETCH", "1")
    monkeypatch.setenv(SWITCH, "1")
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
