"""The row cache's fill through `_exchange_rows` (the default on CUDA, TBEGEN_CACHE_EXCHANGE=0 the way back; the kernel in
templates/include/tbegen/row_copy_cuda.cuh, the cache's side in tbegen/cache.py, RowCache._exchange):
each victim slot's old row is written back and the missed row loaded into it by one kernel, so
that both directions of the host link are busy in every warp, with no staging copy and no side
stream.

On the CPU the operator does not exist (it is CUDA's), so the cache's use of it is checked with a
stand-in of the same contract (exchange_rows_reference): every fill then goes through it, and
training must stay bitwise that of device placement. The `cuda` tests check the operator itself
(every element width it picks, rows outside the tensor skipped, a grid of one block) and cached
training with the switch against training without it and on the device.
"""

from __future__ import annotations

import pytest
import torch

from tbegen.module import TableBatchedEmbeddingBags

from test_cache import MIXED, TABLES, assert_same_tables, batches, train_both
from test_row_copy import (CACHED_CASES, ROW_SHAPES, cached_pair, copy_rows_reference, train_switch_both_ways,
                           with_row_copy)

cuda = pytest.mark.cuda


def exchange_rows_reference(rows, slot_rows, out_rows, in_rows, max_blocks, calls=None):
    """_exchange_rows's contract in torch: for every entry i whose slot is a row of `rows`,
    rows[out_rows[i]] = the slot's old row (where out_rows is given and out_rows[i] is a row),
    then rows[slot_rows[i]] = rows[in_rows[i]] (where in_rows[i] is a row), bit for bit. The
    caller's rows never overlap, so reading every source first is the same as the kernel's order."""
    assert rows.dim() == 2 and rows.stride(1) == 1 and max_blocks >= 0
    for r in (slot_rows, out_rows, in_rows):
        assert r is None or (r.dtype == torch.int64 and r.dim() == 1 and r.numel() == slot_rows.numel())
    count = rows.shape[0]

    def inside(x):
        return (x >= 0) & (x < count)

    entry = inside(slot_rows)
    leaves = entry & inside(out_rows) if out_rows is not None else torch.zeros_like(entry)
    arrives = entry & inside(in_rows)
    old = rows[slot_rows[leaves]].clone()
    arriving = rows[in_rows[arrives]].clone()
    if calls is not None:
        calls.append((out_rows is not None, int(leaves.sum()), int(arrives.sum()), tuple(rows.shape[1:])))
    if out_rows is not None:
        rows[out_rows[leaves]] = old
    rows[slot_rows[arrives]] = arriving


def with_exchange(module, op, blocks=3):
    """The module's cache filling its slots through `op` (what it does on CUDA unless TBEGEN_CACHE_EXCHANGE=0);
    its other moves (flush, drop) through a stand-in of _copy_rows."""
    with_row_copy(module, copy_rows_reference, blocks)
    module._cache._exchange_op = op
    module._cache._exchange_blocks = blocks
    return module


@pytest.mark.parametrize("optimizer,algorithm,dtype", CACHED_CASES)
def test_cache_fills_through_the_exchange_and_trains_like_device(optimizer, algorithm, dtype):
    data, device, cached = cached_pair(optimizer, algorithm, dtype)
    buffers = {buf.data_ptr(): per for buf, per in cached._cache_buffers()}
    calls = []
    layouts = set()

    def op(rows, slot_rows, out_rows, in_rows, max_blocks):
        layouts.add((buffers.get(rows.data_ptr()), tuple(rows.shape[1:])))
        exchange_rows_reference(rows, slot_rows, out_rows, in_rows, max_blocks, calls=calls)

    with_exchange(cached, op)
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    assert stats["rows_written_back"] > 0 and stats["rows_loaded"] > 0
    # the loaded rows arrived through the exchange (each at least once: once per buffer and unit
    # of its row), and evicted rows left through it
    assert sum(c[2] for c in calls) >= stats["rows_loaded"]
    assert any(c[0] and c[1] > 0 for c in calls)
    # every buffer of the cache took part; a per-row state as rows of one entry
    assert {per for per, _ in layouts} == set(buffers.values())
    assert all(shape == (1,) for per, shape in layouts if per == "row")


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
def test_cached_int8_rows_fill_through_the_exchange_like_device(name):
    """int8 rows (codes and qparams: D + 8 bytes, the "int8 rows" layout) and their states filled
    through the exchange: bitwise the training of device placement."""
    from test_int8 import ALL, CACHE_PLACEMENTS, CACHE_TABLES, assert_same_int8_training, int8_data, make, train_int8

    if name not in ALL:
        pytest.skip(f"TBEGEN_TEST_OPTIMIZERS leaves out {name}")
    device = make(name, tables=CACHE_TABLES, ftm=None)
    cached = make(name, tables=CACHE_TABLES, ftm=None, placements=CACHE_PLACEMENTS, cache_rows=12)
    buffers = {buf.data_ptr(): per for buf, per in cached._cache_buffers()}
    seen = set()

    def op(rows, slot_rows, out_rows, in_rows, max_blocks):
        seen.add(buffers.get(rows.data_ptr()))
        exchange_rows_reference(rows, slot_rows, out_rows, in_rows, max_blocks)

    with_exchange(cached, op)
    train_int8(cached, int8_data(device, 8, B=4, seed=17), other=device)
    assert cached.cache_stats()["rows_written_back"] > 0
    assert "int8 rows" in seen and seen <= set(buffers.values())
    assert_same_int8_training(device, cached)


def test_the_exchange_adds_no_host_wait():
    """The fill through the exchange waits for nothing (its row lists come from sizes the host
    knows): still one wait per batch, the summary's (test_cache_syncs' rule)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from tbegen._sync_audit import SyncAudit
    from test_cache_syncs import MAX_WAITS_PER_PREPARE, _zipf_batches

    tables = [(3000, 8), (2000, 16), (1000, 4)]
    features = [0, 1, 2, 2]
    emb = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", feature_table_map=features,
                                    placements="managed_caching", cache_rows=160)
    used = []

    def op(rows, slot_rows, out_rows, in_rows, max_blocks):
        # (the operator is one opaque kernel launch on CUDA; the stand-in's own boolean indexing
        # is kept out of the audit, which sees the arguments the cache computed)
        used.append(out_rows is not None)
        with _disable_current_modes():
            exchange_rows_reference(rows, slot_rows, out_rows, in_rows, max_blocks)

    with_exchange(emb, op)
    data = _zipf_batches(tables, features, 30, seed=5, sizes=((8, 3),))
    for idx, offsets, grad in data[:10]:
        emb(idx, offsets).backward(grad)
    with SyncAudit() as audit:
        for idx, offsets, grad in data[10:]:
            emb(idx, offsets).backward(grad)
    mine = [e for e in audit.events if "tbegen/cache.py:" in e.site]
    assert len(mine) == 20 * MAX_WAITS_PER_PREPARE, audit.report(mine)
    assert any(used) and emb.cache_stats()["rows_written_back"] > 0


def test_a_wrong_exchange_is_caught():
    """The test above fails if the operator drops the write-back (the stand-in is what is tested)."""
    def drops_write_back(rows, slot_rows, out_rows, in_rows, max_blocks):
        exchange_rows_reference(rows, slot_rows, None, in_rows, max_blocks)

    data = batches(TABLES, 6, seed=12)
    kw = dict(optimizer="sgd", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = with_exchange(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw), drops_write_back)
    with pytest.raises(AssertionError):
        train_both(device, cached, data)
        assert_same_tables(device, cached)


def test_fills_without_the_exchange_do_not_call_it():
    """Without the exchange (the CPU, TBEGEN_CACHE_EXCHANGE=0): the fills move rows with _copy_rows,
    never the exchange."""
    data = batches(TABLES, 6, seed=14)
    kw = dict(optimizer="sgd", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = with_row_copy(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw), copy_rows_reference)
    called = []
    cached._cache._exchange_op = lambda *a: called.append(a)
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    assert not called and cached.cache_stats()["rows_written_back"] > 0


@pytest.mark.parametrize("value", [None, "1"])  # (the default, and asked for)
def test_off_on_the_cpu(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TBEGEN_CACHE_EXCHANGE", raising=False)
    else:
        monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE", value)
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)
    assert emb._cache._exchange_blocks == 0  # (no such operator in a CPU build, and a CPU device)


@pytest.mark.parametrize("value", ["yes", "2", "on", " 1"])
def test_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE", value)
    with pytest.raises(ValueError, match="TBEGEN_CACHE_EXCHANGE"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)


def test_reference_skips_rows_outside_the_tensor():
    """The contract the CUDA test below holds the kernel to, on a small case by hand."""
    rows = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    slot = torch.tensor([0, 1, 2, 9, 3])
    out = torch.tensor([4, -1, 5, 6, 8])   # entry 1: an empty slot; entry 4: out of range
    inn = torch.tensor([6, 7, -2, 5, 10])  # entries 2 and 4: nothing arrives; entry 3: no slot
    want = rows.clone()
    want[4] = rows[0]
    want[5] = rows[2]
    want[0] = rows[6]
    want[1] = rows[7]
    exchange_rows_reference(rows, slot, out, inn, 0)
    assert torch.equal(rows, want)


# ---- on a GPU ------------------------------------------------------------------------------------


def _ops():
    return TableBatchedEmbeddingBags([(4, 4)], optimizer="sgd", device="cuda")._ops


@cuda
@pytest.mark.parametrize("dtype,width", ROW_SHAPES)
@pytest.mark.parametrize("n", [1, 127, 333, 4099])  # (none a multiple of a warp's 32 x 4 entries)
@pytest.mark.parametrize("max_blocks", [0, 1])
def test_cuda_exchange_rows_matches_the_reference(dtype, width, n, max_blocks):
    ops = _ops()
    g = torch.Generator().manual_seed(width * 7919 + n)
    size = 3 * n + 40
    base = torch.randint(0, 256, (size, width * torch.empty(0, dtype=dtype).element_size()), generator=g,
                         dtype=torch.uint8).view(dtype).cuda()
    perm = torch.randperm(size, generator=g)
    slot, out, inn = perm[:n].clone(), perm[n:2 * n].clone(), perm[2 * n:3 * n].clone()
    # empty or clean slots (nothing written back), rows outside the tensor at every end
    some = torch.randperm(n, generator=g)
    out[some[: n // 4]] = -1
    inn[some[n // 4: n // 4 + max(1, n // 20)]] = size
    slot[some[n // 3: n // 3 + n // 30]] = torch.tensor([-1, size + 3, -(1 << 40)])[torch.arange(n // 30) % 3]
    slot, out, inn = slot.cuda(), out.cuda(), inn.cuda()
    for with_out in (True, False):
        got, want = base.clone(), base.clone()
        ops._exchange_rows(got, slot, out if with_out else None, inn, max_blocks)
        exchange_rows_reference(want, slot, out if with_out else None, inn, max_blocks)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), with_out
        assert not torch.equal(got.view(torch.uint8), base.view(torch.uint8)) or n == 1


@cuda
def test_cuda_exchange_rows_refuses_bad_arguments():
    ops = _ops()
    a = torch.zeros(10, 4, device="cuda")
    rows = torch.arange(3, device="cuda")
    for args, message in [
        ((a.cpu(), rows.cpu(), None, rows.cpu(), 0), "CUDA device"),
        ((a, rows.int(), None, rows, 0), "int64"),
        ((a, rows, None, rows[:2], 0), "in_rows"),
        ((a, rows, rows[:1], rows, 0), "out_rows"),
        ((a, rows, None, rows, -1), "max_blocks"),
        ((a.t(), rows, None, rows, 0), "contiguous rows"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ops._exchange_rows(*args)


@cuda
@pytest.mark.parametrize("optimizer,dtype,algorithm", [
    ("sgd", torch.float32, "lru"),
    ("adam", torch.float32, "lfu"),
    ("rowwise_adagrad", torch.float16, "lru"),
])
def test_cuda_cached_training_with_the_exchange_like_without(monkeypatch, optimizer, dtype, algorithm):
    _, off, on = train_switch_both_ways(monkeypatch, "TBEGEN_CACHE_EXCHANGE", optimizer, dtype, algorithm)
    assert on._cache._exchange_blocks > 0 and off._cache._exchange_blocks == 0
    assert on.cache_stats()["rows_written_back"] > 0
