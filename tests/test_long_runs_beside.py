"""The long runs' kernels in series (TBEGEN_LONG_RUNS_BESIDE=0; issue 29).

With the switch at 0 the hot rows' segment and finish kernels run on the caller's stream before the
short runs' kernel (templates/include/tbegen/cuda_ops.cuh, long_runs_beside), instead of beside it
on a side stream. They update disjoint rows, so every weight and state must be bitwise the
default's: hot rows (long runs, split into segments) on the 4-wide kernels with several width
classes (a third stream for the narrow class), and on the any-width kernels (1024 columns, fp32
and fp16, mean pooling). Why, and the A/B to run: benchmarks/NOTES-gpu.md, "The long runs in
series". CUDA only (`pytest -m cuda`; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness

from test_cuda import NAMES, _assert_switch_keeps_the_bits, _one_step, _problem

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LONG_RUN_CASES = [
    harness.Case(tables=((300, 8), (100, 256), (50, 128)), B=64, max_L=20, pooling="sum", weighted=True,
                 hot=1500, seed=81),
    harness.Case(tables=((120, 1024), (80, 1024)), B=48, max_L=20, pooling="mean", hot=900, seed=82),
    harness.Case(tables=((90, 1024), (60, 520)), B=48, max_L=16, pooling="sum", weights_dtype=torch.float16,
                 stochastic_rounding=True, hot=700, seed=83),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", LONG_RUN_CASES, ids=lambda c: c.id)
def test_long_runs_in_series_give_the_beside_bits(load_ops, monkeypatch, name, case):
    spec, ops = load_ops(name)
    _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, "TBEGEN_LONG_RUNS_BESIDE", "0")


@pytest.mark.parametrize("value", ["2", "yes", " 0"])
def test_long_runs_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops(NAMES[0])
    case = LONG_RUN_CASES[0]
    weights, states, batch, go = _problem(spec, case)
    monkeypatch.setenv("TBEGEN_LONG_RUNS_BESIDE", value)
    with pytest.raises(RuntimeError, match="TBEGEN_LONG_RUNS_BESIDE must be 0 or 1"):
        _one_step(spec, ops, case, "cuda", weights, states, batch, go)


def _backward_streams(spec, ops, case, tmp_path, tag):
    """The profiler's stream ids of one CUDA step's backward kernels of `case`: (long: the
    segment and finish kernels', short: the warp and group kernels'), 4-wide and any-width alike."""
    import json

    from torch.profiler import ProfilerActivity, profile

    weights, states, batch, go = _problem(spec, case)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _one_step(spec, ops, case, "cuda", weights, states, batch, go)
        torch.cuda.synchronize()
    trace = tmp_path / f"trace-{tag}.json"
    prof.export_chrome_trace(str(trace))
    long, short = set(), set()
    for e in json.loads(trace.read_text())["traceEvents"]:
        name = e.get("name", "")
        if e.get("cat") != "kernel":
            continue
        if "backward_segment_kernel" in name or "backward_finish_kernel" in name:
            long.add(e.get("args", {}).get("stream", e.get("tid")))
        elif "backward_warp_kernel" in name or "backward_group_kernel" in name:
            short.add(e.get("args", {}).get("stream", e.get("tid")))
    return long, short


# (the first fused optimizer TBEGEN_TEST_OPTIMIZERS leaves in: "none" has no update kernels)
FUSED = [n for n in NAMES if n != "none"][:1] or [
    pytest.param("sgd", marks=pytest.mark.skip(reason="TBEGEN_TEST_OPTIMIZERS leaves no fused optimizer"))]


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("case", LONG_RUN_CASES[:2], ids=lambda c: c.id)
def test_long_runs_go_to_the_callers_stream_with_the_switch(load_ops, monkeypatch, tmp_path, name, case):
    """The bitwise test above cannot tell whether the switch was read (disjoint rows: the same bits
    on any stream): the profiler's trace names each kernel's stream. By default the long runs'
    kernels run on a side stream of their own, none of the short runs' kernels' streams; with
    TBEGEN_LONG_RUNS_BESIDE=0 on the caller's, the widest class's short runs' stream (4-wide with
    width classes: the narrower classes' launch on a third stream), and the any-width kernels'."""
    spec, ops = load_ops(name)
    monkeypatch.delenv("TBEGEN_LONG_RUNS_BESIDE", raising=False)
    # (the any-width list in key order puts every kernel on the caller's stream: off for fp32 rows)
    monkeypatch.delenv("TBEGEN_ANY_WIDTH_ITEMS", raising=False)
    long, short = _backward_streams(spec, ops, case, tmp_path, "beside")
    assert long and short, (long, short)
    assert not long & short, f"beside (the default): long runs' streams {long}, short runs' {short}"
    monkeypatch.setenv("TBEGEN_LONG_RUNS_BESIDE", "0")
    long, short = _backward_streams(spec, ops, case, tmp_path, "series")
    assert len(long) == 1 and long <= short, f"in series (=0): long runs' streams {long}, short runs' {short}"
