"""The 4-wide segment kernel's occupancy variant (TBEGEN_SEGMENT_OCCUPANCY; issue 29).

A hot row's run (at least max_segment_length_per_warp occurrences) is summed by the 4-wide segment
kernel, a segment per warp (templates/include/tbegen/cuda_kernels.cuh, backward_segment_kernel).
With the switch at 1, a launch whose rows are at most 128 columns wide (kVecs = 1) takes the same
kernel compiled for 4 blocks of 256 threads per multiprocessor (kSegmentOccupancyMinBlocks: at
most 64 registers) instead of 3, on a one-wave grid recomputed for that residency
(cuda_backward_kernels.cuh, launch_segments). The same code, so the same sums in the same order:
every weight, state and output must be bitwise the default's, for sgd, rowwise_adagrad, adagrad
and adam, fp32, fp16 and bf16 weights, narrow rows of 4, 8, 20 and 32 columns beside a 128-wide
table, hot rows cut into several segments (and into many with TBEGEN_SEGMENT_LENGTH=64), mean and
weighted pooling, and with TBEGEN_SEGMENT_LANE_GROUPS=1 (the narrow rows' other sum, in the same
body). Wider launches (kVecs > 1) keep the default kernel. Why, and the A/B to run:
benchmarks/NOTES-gpu.md, "The 4-wide segment kernel's occupancy". CUDA only (`pytest -m cuda`;
skipped without a GPU).
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import SPECS
from tbegen import harness

from test_any_width import _train, assert_switch_gives_default_bits

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_SEGMENT_OCCUPANCY"
# (those TBEGEN_TEST_OPTIMIZERS leaves in)
OPTIMIZERS = [n for n in ("sgd", "rowwise_adagrad", "adagrad", "adam") if n in SPECS]
# (the single-optimizer tests below take the first; none left in: they skip)
FIRST = OPTIMIZERS[:1] or [pytest.param("sgd", marks=pytest.mark.skip(reason="TBEGEN_TEST_OPTIMIZERS leaves none"))]

# Row 0 of the first table is hot (`hot` extra occurrences a step): its run is cut into segments.
CASES = {
    "fp32-D4-8-20-32-128-mean-hot": harness.Case(tables=((300, 4), (200, 8), (250, 20), (220, 32), (100, 128)),
                                                 B=64, max_L=8, pooling="mean", hot=1600, steps=2, seed=2901),
    "fp32-D32-128-weighted-hot": harness.Case(tables=((400, 32), (150, 128)), B=64, max_L=10, weighted=True,
                                              hot=2500, steps=2, seed=2902),
    "fp32-D20-weighted-hot": harness.Case(tables=((500, 20), (300, 20)), B=64, max_L=8, weighted=True, hot=1500,
                                          steps=2, seed=2903),
    "fp16-D8-20-128-mean-hot": harness.Case(tables=((300, 8), (250, 20), (100, 128)), B=48, max_L=8,
                                            pooling="mean", weights_dtype=torch.float16, stochastic_rounding=True,
                                            hot=1800, steps=2, seed=2904),
    "fp16-D32-weighted-hot": harness.Case(tables=((400, 32), (200, 4)), B=48, max_L=8, weighted=True,
                                          weights_dtype=torch.float16, hot=1500, steps=2, seed=2905),
    "bf16-D20-128-hot": harness.Case(tables=((300, 20), (100, 128)), B=48, max_L=8, weights_dtype=torch.bfloat16,
                                     hot=1500, steps=2, seed=2906),
}
# rows of 256 columns: the launch's kVecs is 2, which has no variant (the default kernel, whatever the switch)
WIDE_CASE = harness.Case(tables=((300, 20), (100, 256)), B=48, max_L=8, hot=1500, steps=2, seed=2907)


@pytest.mark.parametrize("length", [None, "64"])
@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_occupancy_variant_gives_the_default_bits(load_ops, monkeypatch, name, case_id, length):
    spec, ops = load_ops(name)
    if length is not None:
        monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", length)
    assert_switch_gives_default_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH)


@pytest.mark.parametrize("case_id", ["fp32-D4-8-20-32-128-mean-hot", "fp16-D32-weighted-hot"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_occupancy_variant_with_lane_groups_gives_their_bits(load_ops, monkeypatch, name, case_id):
    """The narrow rows' four-lane-group sum (TBEGEN_SEGMENT_LANE_GROUPS=1) runs in the variant too."""
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_SEGMENT_LANE_GROUPS", "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "64")
    assert_switch_gives_default_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_occupancy_variant_matches_reference(load_ops, monkeypatch, name):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "64")
    result = harness.run_case(spec, ops, CASES["fp32-D4-8-20-32-128-mean-hot"], device="cuda")
    assert not result.failures, "\n".join(result.failures)


def _segment_kernels(ops, spec, case):
    """The segment kernels two training steps of `case` launched, as (kVecs, kMinBlocks) pairs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _train(ops, spec, case, "cuda")
        torch.cuda.synchronize()
    ran = set()
    for e in prof.key_averages():
        m = re.search(r"backward_segment_kernel<[^<>]*?, (\d+), (\d+)>", e.key)
        if m and "any_width" not in e.key:
            ran.add((int(m.group(1)), int(m.group(2))))
    return ran


@pytest.mark.parametrize("name", FIRST)
@pytest.mark.parametrize("value", ["unset", "0", "1"])
def test_switch_picks_the_kernel(load_ops, monkeypatch, name, value):
    """The bitwise tests above would pass as well if the switch launched the default kernel: the
    profiler names the instantiation that ran (`backward_segment_kernel<Opt, W, 1, 4>` is the
    variant, `<Opt, W, 1, 3>` the default), and a launch of 256-column rows keeps the default."""
    spec, ops = load_ops(name)
    if value != "unset":
        monkeypatch.setenv(SWITCH, value)
    narrow = _segment_kernels(ops, spec, CASES["fp32-D32-128-weighted-hot"])
    assert narrow == ({(1, 4)} if value == "1" else {(1, 3)}), f"segment kernels that ran: {narrow}"
    wide = _segment_kernels(ops, spec, WIDE_CASE)
    assert wide == {(2, 3)}, f"segment kernels that ran at 256 columns: {wide}"


@pytest.mark.parametrize("name", FIRST)
def test_variant_grid_is_one_wave_of_its_residency(load_ops, monkeypatch, tmp_path, name):
    """The one-wave grid comes from each instantiation's own residency (launch_segment_kernel,
    resident_blocks_per_sm): 3 blocks per multiprocessor for the default (80 registers), 4 for the
    variant (64), read from the kernels' launches in the profiler's trace. The batch (~130k
    occurrences, 16-occurrence segments) bounds the grid above 4 blocks per multiprocessor."""
    import json

    from torch.profiler import ProfilerActivity, profile

    spec, ops = load_ops(name)
    case = harness.Case(tables=((3000, 32),), B=4096, max_L=64, hot=3000, steps=2, seed=2909)
    monkeypatch.setenv("TBEGEN_SEGMENT_LENGTH", "16")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for value, blocks in (("0", 3), ("1", 4)):
        monkeypatch.setenv(SWITCH, value)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _train(ops, spec, case, "cuda")
            torch.cuda.synchronize()
        trace = tmp_path / f"trace{value}.json"
        prof.export_chrome_trace(str(trace))
        grids = {tuple(e["args"]["grid"]) for e in json.loads(trace.read_text())["traceEvents"]
                 if e.get("cat") == "kernel" and "backward_segment_kernel<" in e.get("name", "")
                 and "any_width" not in e["name"]}
        assert grids == {(blocks * sms, 1, 1)}, f"{SWITCH}={value}: segment grids {grids}, expected {blocks} x {sms} SMs"


@pytest.mark.parametrize("name", FIRST)
@pytest.mark.parametrize("value", ["2", "yes", " 1", "1 "])
def test_occupancy_switch_refuses_other_values(load_ops, monkeypatch, name, value):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=f"{SWITCH} must be 0 or 1"):
        _train(ops, spec, CASES["fp32-D20-weighted-hot"], "cuda")
    # also where no 4-wide kernel runs (1024-column rows: the any-width kernels): read at every call
    with pytest.raises(Exception, match=f"{SWITCH} must be 0 or 1"):
        _train(ops, spec, harness.Case(tables=((60, 1024),), B=16, max_L=6, hot=100, steps=2, seed=2908), "cuda")
