"""The occupancy kernels for fp16 rows (TBEGEN_ANY_WIDTH_OCCUPANCY_HALF; issue 29), opt-in.

fp16 rows that take the prefetching any-width kernels (by default, rows wider than 512 columns:
cuda_ops.cuh, wide_half_rows) take, with TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1, the `..._occupancy`
kernels that float rows take by default (__launch_bounds__(256, 3), 512-column passes two
occurrences at a time, a hot row's segment sums two at a time), instantiated for c10::Half, with
each warp's summed gradient row in dynamic shared memory where it fits: up to 1536 columns in the
48 KB a block takes without an opt-in, and wider rows (2048 columns: 64 KB a block) by opting in to
more, where the device allows it and 3 blocks per multiprocessor still fit (else the scratch row:
4096 columns, 128 KB a block, never). The 16-bit weights' update and rounding (stochastic rounding
included) are the 2-block kernels' code, and every column's sum has the same terms in the same
order, so weights, states and outputs must be bitwise the 2-block prefetching kernels' (the switch
unset or 0): for short runs (warp kernel), hot rows (segment and finish kernels), the work list
(TBEGEN_ANY_WIDTH_ITEMS=1) and without it, 2048-wide rows (four full passes, the opted-in shared
row), 520-wide ones (a partial second pass, the 48 KB shared row), 600 + 2000 mixed, an odd width
(no 4-wide sum: the column loop), 4096-wide rows (the scratch row), per-sample weights, mean
pooling, stochastic rounding. Anything but unset, 0 or 1 is refused; the profiler's kernel names
and launch records check that the switch reaches the `_occupancy` kernels exactly when on, with
shared memory at D = 2048. CUDA only (`pytest -m cuda`; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness
from tbegen.layout import make_layout

from test_any_width import _train as _train_any_width, bits_equal

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_ANY_WIDTH_OCCUPANCY_HALF"
SHARED = "TBEGEN_ANY_WIDTH_SHARED_ROW"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]
HALF = torch.float16

# Row 0 of the first table is hot (`hot` extra occurrences a step): with the default
# max_segment_length_per_warp (32) its run is split into segments of TBEGEN_SEGMENT_LENGTH.
CASES = {
    # 2048 columns: four full 512-column passes; the shared row past 48 KB (64 KB a block)
    "fp16-D2048-weighted-hot": harness.Case(tables=((100, 2048), (60, 2048)), B=32, max_L=6, weighted=True,
                                            weights_dtype=HALF, hot=1500, steps=2, seed=2901),
    "fp16-D2048-sr-hot": harness.Case(tables=((100, 2048),), B=24, max_L=6, weights_dtype=HALF,
                                      stochastic_rounding=True, hot=900, steps=2, seed=2902),
    # the hot row as one warp's run (the warp kernel only, no segments)
    "fp16-D2048-mean-hot-one-warp": harness.Case(tables=((80, 2048),), B=24, max_L=8, pooling="mean",
                                                 weights_dtype=HALF, hot=400, max_segment_length_per_warp=100000,
                                                 steps=2, seed=2903),
    # 520 columns: a partial second pass (8 columns); mean pooling; the 48 KB shared row
    "fp16-D520-mean-hot": harness.Case(tables=((200, 520), (150, 520)), B=40, max_L=9, pooling="mean",
                                       weights_dtype=HALF, hot=700, steps=2, seed=2904),
    # 600 and 2000 columns: partial passes of both, the shared row sized by max_D = 2000 (62.5 KB)
    "fp16-D600-2000-weighted-hot": harness.Case(tables=((200, 600), (60, 2000)), B=32, max_L=6, weighted=True,
                                                weights_dtype=HALF, hot=1200, steps=2, seed=2905),
    # an odd width: the column loop's sum (no 4-wide rows), under the variant's launch bounds
    "fp16-D1031-odd-sr-hot": harness.Case(tables=((80, 1031), (40, 520)), B=32, max_L=6, weighted=True,
                                          weights_dtype=HALF, stochastic_rounding=True, hot=900, steps=2,
                                          seed=2906),
    # 4096 columns (the module's widest): 128 KB a block would cost the variant its blocks, so the
    # scratch row
    "fp16-D4096-hot": harness.Case(tables=((40, 4096),), B=12, max_L=5, weights_dtype=HALF, hot=300, steps=2,
                                   seed=2907),
}


@pytest.fixture(autouse=True)
def _switches_unset(monkeypatch):
    """Each test starts from the default (the switches unset, whatever the caller's environment)."""
    for k in (SWITCH, SHARED, "TBEGEN_ANY_WIDTH_OCCUPANCY", "TBEGEN_ANY_WIDTH_PREFETCH", "TBEGEN_ANY_WIDTH_ITEMS",
              "TBEGEN_SEGMENT_LENGTH"):
        monkeypatch.delenv(k, raising=False)


def _train(ops, spec, case, device="cuda"):
    """Two fused steps from the same start (test_any_width._train with the case's stochastic
    rounding); returns the forward outputs, the weights and the states."""
    return _train_any_width(ops, spec, case, device, stochastic_rounding=case.stochastic_rounding)


def assert_same(a, b, what):
    out_a, w_a, st_a = a
    out_b, w_b, st_b = b
    assert bits_equal(w_a, w_b), f"weights differ ({what}): max |diff| {(w_a.double() - w_b.double()).abs().max():.3g}"
    for k in st_b:
        assert bits_equal(st_a[k], st_b[k]), f"state {k} differs ({what})"
    for x, y in zip(out_a, out_b):
        assert bits_equal(x, y), f"forward output differs ({what}; the second step's uses the updated weights)"


@pytest.mark.parametrize("items", ["0", "1"])
@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_switch_gives_the_two_block_kernels_bits(load_ops, monkeypatch, name, case_id, items):
    """=1 (the occupancy kernels, the shared row where it fits) bitwise against =0 and unset (the
    2-block prefetching kernels, the default), with and without the work list, twice the same;
    =1 with TBEGEN_ANY_WIDTH_SHARED_ROW=0 (the scratch row) the same bits too."""
    spec, ops = load_ops(name)
    case = CASES[case_id]
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", items)
    monkeypatch.setenv(SWITCH, "0")
    off = _train(ops, spec, case)
    monkeypatch.delenv(SWITCH)
    unset = _train(ops, spec, case)
    assert_same(unset, off, "unset against =0")
    gen = torch.Generator().manual_seed(case.seed)
    w0, _ = harness.initial_state(spec, make_layout(case.tables, case.feature_table_map), case, gen)
    assert not torch.equal(off[1], w0), "the two steps left the weights as they were"
    monkeypatch.setenv(SWITCH, "1")
    on = _train(ops, spec, case)
    assert_same(on, off, "=1 against the 2-block kernels")
    on2 = _train(ops, spec, case)
    assert_same(on2, on, "=1 twice")
    monkeypatch.setenv(SHARED, "0")
    scratch = _train(ops, spec, case)
    assert_same(scratch, off, f"=1 with {SHARED}=0 against the 2-block kernels")


@pytest.mark.parametrize("length", ["256", "48"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_switch_at_other_segment_lengths(load_ops, monkeypatch, name, length):
    """The hot rows' runs in more and fewer segments (the finish kernel's pairs with and without a
    single one left): =1 gives =0's bits."""
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", length)
    for case_id in ("fp16-D2048-weighted-hot", "fp16-D600-2000-weighted-hot"):
        monkeypatch.setenv(SWITCH, "0")
        off = _train(ops, spec, CASES[case_id])
        monkeypatch.setenv(SWITCH, "1")
        on = _train(ops, spec, CASES[case_id])
        assert_same(on, off, f"{case_id}, segments of {length}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_switch_leaves_float_rows_alone(load_ops, monkeypatch, name):
    """Float rows take their own (default) occupancy kernels whatever this switch says."""
    spec, ops = load_ops(name)
    case = harness.Case(tables=((120, 1024), (80, 2000)), B=24, max_L=6, weighted=True, hot=600, steps=2, seed=2908)
    monkeypatch.setenv(SWITCH, "0")
    off = _train(ops, spec, case)
    monkeypatch.setenv(SWITCH, "1")
    on = _train(ops, spec, case)
    assert_same(on, off, "float rows, =1 against =0")


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1", "on"])
def test_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp16-D2048-mean-hot-one-warp"])


def _kernel_events(ops, spec, case, tmp_path):
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _train(ops, spec, case)
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]


@pytest.mark.parametrize("items", ["0", "1"])
@pytest.mark.parametrize("switch", ["unset", "0", "1"])
def test_switch_picks_the_kernels(load_ops, monkeypatch, tmp_path, switch, items):
    """The bitwise tests would pass as well if every setting launched the same kernels: the
    profiler names the kernels that ran (the occupancy kernels `..._occupancy<Opt, c10::Half>`, the
    2-block prefetching kernels `...<Opt, c10::Half, true>`)."""
    spec, ops = load_ops("sgd")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", items)
    if switch != "unset":
        monkeypatch.setenv(SWITCH, switch)
    names = [e["name"] for e in _kernel_events(ops, spec, CASES["fp16-D2048-weighted-hot"], tmp_path)]
    kernels = ("backward_finish_kernel",) + (("backward_items_kernel",) if items == "1" else
                                             ("backward_segment_kernel", "backward_warp_kernel"))
    for k in kernels:
        variant = [n for n in names if f"any_width::{k}_occupancy<" in n]
        plain = [n for n in names if f"any_width::{k}<" in n]
        if switch == "1":
            assert variant and not plain, f"{k}: occupancy {variant}, 2-block {plain}; expected the occupancy kernels only"
            assert all("Half" in n for n in variant), f"{k} ran as {variant}, not the c10::Half instantiation"
        else:
            assert plain and not variant, f"{k}: occupancy {variant}, 2-block {plain}; expected the 2-block kernels only"
            assert all("Half, true>" in n for n in plain), f"{k} ran as {plain}, not the prefetching instantiation"


@pytest.mark.parametrize("case_id, shared, expect_bytes", [("fp16-D2048-weighted-hot", "unset", 8 * 2048 * 4),
                                                           ("fp16-D2048-weighted-hot", "0", 0),
                                                           ("fp16-D2048-weighted-hot", "1", 8 * 2048 * 4),
                                                           ("fp16-D600-2000-weighted-hot", "unset", 8 * 2000 * 4),
                                                           ("fp16-D520-mean-hot", "unset", 8 * 520 * 4),
                                                           ("fp16-D4096-hot", "unset", 0)])
@pytest.mark.parametrize("items", ["0", "1"])
def test_the_launch_config(load_ops, monkeypatch, tmp_path, case_id, shared, expect_bytes, items):
    """The trace's kernel records: with the switch on, the `_occupancy` kernels ran with at most 80
    registers a thread (3 blocks of 256 per multiprocessor) and with the shared row (8 warps x max_D
    floats, past 48 KB at 2000 and 2048 columns) exactly where it fits and TBEGEN_ANY_WIDTH_SHARED_ROW
    does not turn it off (4096 columns: none, the scratch row)."""
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("TBEGEN_ANY_WIDTH_ITEMS", items)
    if shared != "unset":
        monkeypatch.setenv(SHARED, shared)
    events = [e for e in _kernel_events(ops, spec, CASES[case_id], tmp_path) if "_occupancy<" in e.get("name", "")]
    assert events, "no _occupancy kernel in the trace"
    per_sm = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_multiprocessor", None)
    if expect_bytes > 48 * 1024 and per_sm is not None and 3 * (expect_bytes + 1024) > per_sm:
        expect_bytes = 0  # (a device whose multiprocessor does not hold 3 such blocks: the scratch row)
    for e in events:
        args = e.get("args", {})
        assert 0 < args["registers per thread"] <= 80, f"{e['name']}: {args}"
        assert (args["shared memory"] > 0) == (expect_bytes > 0), f"{e['name']}: {args}, expected {expect_bytes} bytes"
        assert args["shared memory"] >= expect_bytes, f"{e['name']}: {args}, expected {expect_bytes} bytes"
