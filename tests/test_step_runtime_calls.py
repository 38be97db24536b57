"""The CUDA runtime calls one steady fixed-batch training step issues (issue 29: the sub-millisecond
cells are host-bound, each call ~4-7 us of the host's time on the H100), counted with torch.profiler
as benchmarks/vbe_step_ops.py counts them, and the cuts: the sort without memsets
(TBEGEN_SORT_NO_MEMSETS, on by default at every size) and the long runs found by one scan
(TBEGEN_LONG_RUN_SCAN, on by default for a batch of at most 2^20 indices: kFewerCallsMaxIndices in
cuda_backward_prep_impl.cuh), "0" off, "1" on, bitwise against each other; the opt-in error record copied after the backward only
(TBEGEN_ERROR_COPY_AFTER_BACKWARD=1), its counts and when its errors surface. CUDA only
(`pytest -m cuda`; skipped without a GPU).

A step is the module's forward and `out.backward(grad)` with rowwise_adagrad on device-placed fp32
tables, sum pooling, no per-sample weights, the error record and the finite check on (the
defaults): the 4-wide kernels, one width class. What it issues, read from the source
(benchmarks/NOTES-gpu.md, "Runtime calls per fixed-batch step"):
- kernel launches: the forward's 1; the backward's finite check (side stream), linearize, the sort
  (CUB: one single-tile kernel when the batch fits a tile, else histogram + exclusive sum + one per
  pass), the two selections and the scan (CUB: an init kernel and the kernel each), the segment and
  finish kernels (side stream) and the short runs' kernel: 11 + the sort's (9 + the sort's with
  TBEGEN_LONG_RUN_SCAN=1: the long-run selection and the segments' scan are one scan);
- memsets: the sort's, 2 + one per pass, none for a single tile (CUB's onesweep dispatch), none at
  all with TBEGEN_SORT_NO_MEMSETS=1; the ticket counters' memset is gone (the linearize kernel
  zeroes them);
- 4 stream waits (the finite check's fork and join, the long runs' fork and join), 2 async copies
  (the error record's, after the forward and after the backward), no host wait (the profiler's own
  sync may add one to the whole profile);
- 4 aten::empty: the forward's output, and the backward's three allocations (the unsorted pairs
  with the sort's scratch, the sorted pairs with the tickets, the runs' arrays with the selections'
  scratch and the partial sums; 6 before issue 29's cuts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

STEPS = 3
SINGLE_TILE = 256 * 19  # CUB's sm_90 single-tile sort of 32-bit pairs (above it: onesweep)
FEWER_CALLS_MAX = 1 << 20  # kFewerCallsMaxIndices: the long-run scan on by default up to this many indices


def _passes(total_rows: int) -> int:
    """The sort's passes over keys of bits_for(total_rows + 1) bits at sort_digit_bits' digit width."""
    bits = max(1, total_rows.bit_length())  # (bits_for(total_rows + 1): keys in [0, total_rows])
    digit = 9 if (bits + 8) // 9 < (bits + 7) // 8 else 8
    return (bits + digit - 1) // digit


# (rows per table, batch, bag length): 2 tables of 32 columns
CASES = [
    (200_000, 4096, 4),  # 19-bit keys: 3 passes of 8 bits, 32768 pairs
    (100_000, 4096, 4),  # 18-bit keys: 2 passes of 9 bits
    (1_000, 4096, 4),    # 11-bit keys: 2 passes of 8 bits
    (200_000, 128, 4),   # 1024 pairs: CUB's single tile
]


def _module(rows, seed=0):
    from tbegen import TableBatchedEmbeddingBags

    torch.manual_seed(seed)
    return TableBatchedEmbeddingBags([(rows, 32), (rows, 32)], optimizer="rowwise_adagrad", device="cuda",
                                     learning_rate=0.01, eps=1e-8)


def _batch(rows, B, L, seed):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(0, 2 * B * L + 1, L, dtype=torch.int64)
    indices = torch.randint(0, rows, (2 * B * L,), generator=g)
    grad = torch.randn(B, 64, generator=g)
    return indices.cuda(), offsets.cuda(), grad.cuda()


def _step(emb, batch):
    indices, offsets, grad = batch
    emb(indices, offsets).backward(grad)


def _runtime_calls(emb, batch) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from vbe_step_ops import count

    for _ in range(3):
        _step(emb, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            _step(emb, batch)
    torch.cuda.synchronize()
    emb.check_errors()
    counted = count(prof, STEPS)
    return dict(counted["runtime calls"], allocations=counted["allocation ops"].get("aten::empty", 0))


# (TBEGEN_SORT_NO_MEMSETS, TBEGEN_LONG_RUN_SCAN); "" leaves the default (the sort: on; the scan: the size rule)
SWITCHES = {"default": ("", ""), "neither": ("0", "0"), "sort_no_memsets": ("1", "0"), "long_run_scan": ("0", "1"),
            "both": ("1", "1")}
# CASES and a batch past FEWER_CALLS_MAX (2 x 65536 x 9 = 1179648 indices), where the default is the
# sort without memsets and the two CUB algorithms for the long runs
COUNT_CASES = CASES + [(200_000, 65536, 9)]


def _sort_no_memsets(value: str) -> bool:
    return value != "0"  # (unset: on at every size)


def _long_run_scan(value: str, n: int) -> bool:
    return value == "1" or (value == "" and n <= FEWER_CALLS_MAX)


@pytest.mark.parametrize("switches", sorted(SWITCHES))
@pytest.mark.parametrize("rows,B,L", COUNT_CASES, ids=lambda v: str(v))
def test_runtime_calls_per_steady_step(monkeypatch, rows, B, L, switches):
    n = 2 * B * L
    no_memsets = _sort_no_memsets(SWITCHES[switches][0])
    one_scan = _long_run_scan(SWITCHES[switches][1], n)
    monkeypatch.setenv("TBEGEN_SORT_NO_MEMSETS", SWITCHES[switches][0])
    monkeypatch.setenv("TBEGEN_LONG_RUN_SCAN", SWITCHES[switches][1])
    emb = _module(rows)
    calls = _runtime_calls(emb, _batch(rows, B, L, seed=1))
    single_tile = n <= SINGLE_TILE
    passes = _passes(2 * rows)
    sort_launches = 1 if single_tile else 2 + passes
    sort_memsets = 0 if single_tile or no_memsets else 2 + passes
    assert calls.get("kernel launches", 0) == 1 + (9 if one_scan else 11) + sort_launches, calls
    assert calls.get("memsets", 0) == sort_memsets, calls
    assert calls.get("stream waits", 0) == 4, calls
    assert calls.get("async copies", 0) == 2, calls
    assert calls.get("event records", 0) <= 4, calls  # (tbegen's 4; landing14 counted 4 in all)
    assert calls.get("host waits", 0) < 1, calls  # (at most the profiler's own, once per profile)
    assert calls["allocations"] == 4, calls


@pytest.mark.parametrize("switch", ["TBEGEN_SORT_NO_MEMSETS", "TBEGEN_LONG_RUN_SCAN"])
@pytest.mark.parametrize("weighted,pooling", [(False, "sum"), (True, "sum"), (False, "mean")])
@pytest.mark.parametrize("rows,B,L", CASES, ids=lambda v: str(v))
def test_switch_trains_bitwise_as_the_default(monkeypatch, rows, B, L, weighted, pooling, switch):
    from tbegen import TableBatchedEmbeddingBags

    results = []
    for value in ("0", "1", ""):  # off, on, the default (on at these sizes)
        monkeypatch.setenv(switch, value)
        torch.manual_seed(0)
        emb = TableBatchedEmbeddingBags([(rows, 32), (rows, 48)], optimizer="rowwise_adagrad", device="cuda",
                                        pooling=pooling, learning_rate=0.01, eps=1e-8)
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)
            # (skewed: a few hot rows make long runs, cut into segments)
            hot = torch.randint(0, 8, (2 * B * L,), generator=g)
            cold = torch.randint(0, rows, (2 * B * L,), generator=g)
            indices = torch.where(torch.rand(2 * B * L, generator=g) < 0.3, hot, cold).cuda()
            offsets = torch.arange(0, 2 * B * L + 1, L, dtype=torch.int64).cuda()
            psw = torch.rand(2 * B * L, generator=g).cuda() if weighted else None
            out = emb(indices, offsets, psw)
            out.backward(torch.randn(out.shape, generator=g).cuda())
        emb.check_errors()
        results.append([emb.weights.detach().clone(), emb.states.momentum.clone()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("switch", ["TBEGEN_SORT_NO_MEMSETS", "TBEGEN_LONG_RUN_SCAN"])
@pytest.mark.parametrize("value", ["2", "yes", " 1"])
def test_switches_refuse_other_values(monkeypatch, value, switch):
    rows, B, L = CASES[0]
    emb = _module(rows)
    monkeypatch.setenv(switch, value)
    with pytest.raises(RuntimeError, match=f"{switch} must be 0 or 1"):
        _step(emb, _batch(rows, B, L, seed=1))


def test_error_copy_after_backward_counts(monkeypatch):
    """TBEGEN_ERROR_COPY_AFTER_BACKWARD=1 (read when the module is made): one copy of the error
    record a step, the backward's; the rest as the default."""
    monkeypatch.setenv("TBEGEN_ERROR_COPY_AFTER_BACKWARD", "1")
    rows, B, L = CASES[0]
    emb = _module(rows)
    calls = _runtime_calls(emb, _batch(rows, B, L, seed=1))
    assert calls.get("async copies", 0) == 1, calls
    # (the forward polls the backward's copy; if it is not done yet, the backward polls it again)
    assert calls.get("event queries", 0) <= 2, calls
    assert calls.get("stream waits", 0) == 4, calls


def test_error_copy_after_backward_reports_at_the_next_call_and_updates_nothing(monkeypatch):
    from tbegen import TableBatchedEmbeddingBags

    monkeypatch.setenv("TBEGEN_ERROR_COPY_AFTER_BACKWARD", "1")
    emb = TableBatchedEmbeddingBags([(20, 8), (30, 4)], optimizer="rowwise_adagrad", device="cuda",
                                    learning_rate=0.1)
    before = [emb.weights.detach().clone(), emb.states.momentum.clone()]
    ind = torch.tensor([1, 2, 3, 4, 1, 0, 5, 6, 7, 8], device="cuda")
    off = torch.tensor([0, 2, 5, 6, 8, 9, 10], device="cuda")
    bad = ind.clone()
    bad[0] = 1000
    out = emb(bad, off)
    torch.cuda.synchronize()
    # the forward left its copy to the backward: the backward runs (and its kernels update nothing)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    assert torch.equal(emb.weights, before[0]) and torch.equal(emb.states.momentum, before[1])
    # the backward's copy carried the forward's error: the next call raises it
    with pytest.raises(RuntimeError, match=r"indices\[0\] = 1000 is out of range.*earlier call"):
        emb(ind, off)
    # grad-enabled forwards without a backward: every second one copies, so the error surfaces
    out = emb(bad, off)
    out = emb(ind, off)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="out of range"):
        emb(ind, off)
    assert torch.equal(emb.weights, before[0])
    # and the module trains again afterwards
    out = emb(ind, off)
    out.backward(torch.ones_like(out))
    emb.check_errors()
    assert not torch.equal(emb.weights, before[0])
