"""The row cache's row copies with `_copy_rows` (templates/include/tbegen/row_copy_cuda.cuh;
tbegen/cache.py, TBEGEN_CACHE_ROW_COPY=1): the loads of missed rows go from backing row to slot
without a temporary copy, and the write-back of evicted rows runs beside them on a grid of half
the SMs.

On the CPU the operator does not exist (it is CUDA's), so the cache's use of it is checked with a
stand-in of the same contract: the cache then passes every row move through it, and training must
stay bitwise that of device placement. The `cuda` tests check the operator itself (every element
width it picks, both index tensors given or not, one tensor as source and destination, a grid of
one block) and cached training with it on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tbegen.module import TableBatchedEmbeddingBags

from test_cache import BIG, GPU_MIXED, MIXED, TABLES, assert_same_tables, batches, train_both

cuda = pytest.mark.cuda


def copy_rows_reference(dst, dst_rows, src, src_rows, max_blocks, calls=None):
    """_copy_rows's contract in torch: dst[dst_rows[i]] = src[src_rows[i]] (a missing index
    tensor: i), bit for bit; rows of equal byte width, 2-D with contiguous rows."""
    assert dst.dim() == 2 and src.dim() == 2 and dst.stride(1) == 1 and src.stride(1) == 1
    assert dst.shape[1] * dst.element_size() == src.shape[1] * src.element_size()
    assert max_blocks >= 0
    for rows in (dst_rows, src_rows):
        assert rows is None or (rows.dtype == torch.int64 and rows.dim() == 1)
    n = dst_rows.numel() if dst_rows is not None else src_rows.numel() if src_rows is not None else src.shape[0]
    moved = (src[:n] if src_rows is None else src[src_rows]).view(torch.uint8).view(dst.dtype)
    if calls is not None:
        calls.append((dst_rows is None, src_rows is None, n))
    if dst_rows is None:
        dst[:n] = moved
    else:
        dst[dst_rows] = moved


def train_switch_both_ways(monkeypatch, switch, optimizer, dtype, algorithm):
    """(device-placed module, cached module made with `switch`=0, cached module made with =1), all
    three trained on the same CUDA batches, the cached ones beside a device-placed twin each: for a
    cache switch's test that it changes nothing but speed (equal tables, equal statistics)."""
    data = batches(BIG, 6, B=64, L=8, seed=13, device="cuda", weighted=True)
    kw = dict(optimizer=optimizer, weights_dtype=dtype, device="cuda", learning_rate=0.05, stochastic_rounding=False)
    device = TableBatchedEmbeddingBags(BIG, **kw)
    modules = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(switch, flag)
        modules[flag] = TableBatchedEmbeddingBags(BIG, placements=GPU_MIXED, cache_rows=1000, cache_algorithm=algorithm, **kw)
    train_both(device, modules["1"], data)
    train_both(TableBatchedEmbeddingBags(BIG, **kw), modules["0"], data)
    torch.cuda.synchronize()
    assert_same_tables(device, modules["1"])
    assert_same_tables(modules["0"], modules["1"])
    assert modules["1"].cache_stats() == modules["0"].cache_stats()
    return device, modules["0"], modules["1"]


def with_row_copy(module, op, blocks=3):
    """The module's cache moving its rows through `op` (what it does on CUDA unless TBEGEN_CACHE_ROW_COPY=0)."""
    module._cache._row_copy_op = op
    module._cache._row_copy_blocks = blocks
    return module


# The cached trainings the row-move tests run (here and in test_row_exchange.py): (optimizer,
# cache algorithm, weights dtype)
CACHED_CASES = [
    ("sgd", "lru", torch.float32),
    ("adam", "lfu", torch.float32),            # per-element states move with their rows
    ("rowwise_adagrad", "lru", torch.float16),  # a per-row state (rows of one entry) and 2-byte rows
]


def cached_pair(optimizer, algorithm, dtype):
    """(batches, a module of device-placed tables, the same tables cached in 12 slots each), for a
    row-move test to train side by side."""
    data = batches(TABLES, 8, weighted=True, seed=11)
    kw = dict(optimizer=optimizer, learning_rate=0.05, weights_dtype=dtype, stochastic_rounding=False)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, cache_algorithm=algorithm, **kw)
    return data, device, cached


@pytest.mark.parametrize("optimizer,algorithm,dtype", CACHED_CASES)
def test_cache_moves_rows_through_the_operator_and_trains_like_device(optimizer, algorithm, dtype):
    data, device, cached = cached_pair(optimizer, algorithm, dtype)
    calls = []
    buffers = {buf.data_ptr(): per for buf, per in cached._cache_buffers()}
    moved = []  # (layout of the buffer written or read in place, dst_rows given, src_rows given, row shape)

    def op(dst, dst_rows, src, src_rows, max_blocks):
        for t in (dst, src):
            if t.data_ptr() in buffers:
                moved.append((buffers[t.data_ptr()], dst_rows is not None, src_rows is not None, tuple(t.shape[1:])))
        copy_rows_reference(dst, dst_rows, src, src_rows, max_blocks, calls=calls)

    with_row_copy(cached, op)
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    assert cached.cache_stats()["rows_written_back"] > 0
    loads = [c for c in calls if not c[0] and not c[1]]  # (backing row -> slot, both indexed)
    writes = [c for c in calls if not c[0] and c[1]]  # (gathered evicted rows -> backing rows)
    assert loads and writes
    # every buffer's loads (both indexed) and write-back writes (dst indexed) go through the
    # operator; a per-row state's also the write-back's gathers out of the slots (src indexed),
    # as rows of one entry (its flat buffer viewed as (N, 1))
    for per in set(buffers.values()):
        kinds = {(d, s) for p, d, s, _ in moved if p == per}
        assert {(True, True), (True, False)} <= kinds, (per, kinds)
        if per == "row":
            assert (False, True) in kinds
            assert {shape for p, _, _, shape in moved if p == per} == {(1,)}
    assert ("row" in buffers.values()) == (optimizer == "rowwise_adagrad")


def test_a_wrong_operator_is_caught():
    """The test above fails if the operator drops the write-back (the stand-in is what is tested)."""
    def drops_writes(dst, dst_rows, src, src_rows, max_blocks):
        if src_rows is not None:
            copy_rows_reference(dst, dst_rows, src, src_rows, max_blocks)

    data = batches(TABLES, 6, seed=12)
    kw = dict(optimizer="sgd", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = with_row_copy(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw), drops_writes)
    with pytest.raises(AssertionError):
        train_both(device, cached, data)
        assert_same_tables(device, cached)


def test_off_on_the_cpu(monkeypatch):
    monkeypatch.setenv("TBEGEN_CACHE_ROW_COPY", "1")
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)
    assert emb._cache._row_copy_blocks == 0  # (no such operator in a CPU build, and a CPU device)


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("TBEGEN_CACHE_ROW_COPY", value)
    with pytest.raises(ValueError, match="TBEGEN_CACHE_ROW_COPY"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)


# ---- on a GPU ------------------------------------------------------------------------------------


def _ops():
    return TableBatchedEmbeddingBags([(4, 4)], optimizer="sgd", device="cuda")._ops


# Row shapes (element dtype, elements a row) covering every unit the row kernels pick (here and in
# test_row_exchange.py)
ROW_SHAPES = [
    (torch.complex128, 8),   # 16-byte elements (the cache's wide rows)
    (torch.float32, 32),     # 128-byte rows: 16-byte units
    (torch.float32, 6),      # 24-byte rows: 8-byte units
    (torch.float32, 5),      # 20-byte rows: 4-byte units
    (torch.float16, 3),      # 6-byte rows: 2-byte units
    (torch.uint8, 13),       # 13-byte rows: 1-byte units
    (torch.float32, 300),    # rows longer than a warp's 32 units
    # rows of one unit (a lane per row: the narrow kernels)
    (torch.float32, 1),      # 4-byte rows (a per-row state's)
    (torch.float32, 2),      # 8-byte rows
    (torch.float32, 4),      # 16-byte rows
    (torch.float16, 1),      # 2-byte rows
    (torch.uint8, 1),        # 1-byte rows
]


@cuda
@pytest.mark.parametrize("dtype,width", ROW_SHAPES)
@pytest.mark.parametrize("max_blocks", [0, 1])
def test_cuda_copy_rows_matches_indexing(dtype, width, max_blocks):
    ops = _ops()
    g = torch.Generator().manual_seed(width)
    base = torch.randint(0, 256, (1000, width * torch.empty(0, dtype=dtype).element_size()), generator=g,
                         dtype=torch.uint8).view(dtype).cuda()
    n = 333
    perm = torch.randperm(1000, generator=g)
    src_rows, dst_rows = perm[:n].cuda(), perm[n:2 * n].cuda()  # (disjoint: one tensor is both ends)
    other = torch.randint(0, 256, (n + 7, base.shape[1] * base.element_size()), generator=g,
                          dtype=torch.uint8).view(dtype).cuda()
    # (one tensor as both ends, with disjoint rows; dst without an index; src without an index)
    for dr, sr, dst_is_base in ((dst_rows, src_rows, True), (None, src_rows, False), (dst_rows, None, True)):
        got = [base.clone(), other.clone()]
        want = [base.clone(), other.clone()]
        for t in (got, want):
            dst, src = (t[0], t[0] if sr is not None else t[1]) if dst_is_base else (t[1], t[0])
            if t is got:
                ops._copy_rows(dst, dr, src, sr, max_blocks)
            else:
                copy_rows_reference(dst, dr, src, sr, max_blocks)
        torch.cuda.synchronize()
        for x, y in zip(got, want):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (dr is None, sr is None)


@cuda
def test_cuda_copy_rows_skips_rows_outside_the_tensors():
    """A row number outside its tensor is skipped on the device (nothing read or written out of
    bounds, the other rows copied)."""
    ops = _ops()
    src = torch.arange(40, dtype=torch.float32, device="cuda").reshape(10, 4)
    dst = torch.full((6, 4), -1.0, device="cuda")
    ops._copy_rows(dst, torch.tensor([0, 6, 2, -1, 5], device="cuda"), src,
                   torch.tensor([9, 1, 10, 3, -2], device="cuda"), 1)
    want = torch.full((6, 4), -1.0)
    want[0] = torch.arange(36, 40, dtype=torch.float32)  # (row 9; the others' dst or src is outside)
    assert torch.equal(dst.cpu(), want)


def copy_rows_skipping_reference(dst, dst_rows, src, src_rows):
    """_copy_rows on the device with row numbers outside their tensors: those rows skipped."""
    n = dst_rows.numel()
    s = src_rows if src_rows is not None else torch.arange(n, device=dst.device)
    keep = (s >= 0) & (s < src.shape[0]) & (dst_rows >= 0) & (dst_rows < dst.shape[0])
    dst[dst_rows[keep]] = src[s[keep]]


@cuda
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32, torch.float64, torch.complex128])
@pytest.mark.parametrize("n", [1, 31, 127, 129, 333, 4099])  # (none a multiple of a warp's 32 x 4 rows)
@pytest.mark.parametrize("max_blocks", [0, 1])
def test_cuda_copy_rows_of_one_entry_like_the_cache(dtype, n, max_blocks):
    """Rows of one element (a lane per row): a flat buffer viewed as (N, 1), as the cache moves
    a per-row state, into itself (backing rows <-> slots, disjoint) and out of it into a gathered
    copy and back (the staged write-back), with row numbers outside the tensors among them."""
    ops = _ops()
    g = torch.Generator().manual_seed(n)
    size = 2 * n + 50
    flat = torch.randint(0, 256, (size * torch.empty(0, dtype=dtype).element_size(),), generator=g,
                         dtype=torch.uint8).view(dtype).cuda()
    perm = torch.randperm(size, generator=g)
    src_rows, dst_rows = perm[:n].clone(), perm[n:2 * n].clone()
    bad = torch.randperm(n, generator=g)[: max(1, n // 10)]  # (some rows outside, either end)
    src_rows[bad[::2]] = torch.tensor([-1, size, size + 7, -(1 << 40)])[torch.arange(bad[::2].numel()) % 4]
    dst_rows[bad[1::2]] = torch.tensor([size, -3])[torch.arange(bad[1::2].numel()) % 2]
    src_rows, dst_rows = src_rows.cuda(), dst_rows.cuda()
    got, want = flat.clone(), flat.clone()
    ops._copy_rows(got.view(-1, 1), dst_rows, got.view(-1, 1), src_rows, max_blocks)
    copy_rows_skipping_reference(want.view(-1, 1), dst_rows, want.view(-1, 1), src_rows)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got.view(torch.uint8), flat.view(torch.uint8)) or n == 1
    # the staged write-back: gathered out of the buffer (src indexed), then written (dst indexed)
    gathered = torch.zeros(n, 1, dtype=dtype, device="cuda")
    ops._copy_rows(gathered, None, got.view(-1, 1), src_rows, max_blocks)
    expect = torch.zeros(n, 1, dtype=dtype, device="cuda")
    copy_rows_skipping_reference(expect, torch.arange(n, device="cuda"), got.view(-1, 1), src_rows)
    torch.cuda.synchronize()
    assert torch.equal(gathered.view(torch.uint8), expect.view(torch.uint8))
    ops._copy_rows(got.view(-1, 1), dst_rows, gathered, None, max_blocks)
    copy_rows_skipping_reference(want.view(-1, 1), dst_rows, expect, None)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@cuda
def test_cuda_copy_rows_refuses_bad_arguments():
    ops = _ops()
    a = torch.zeros(10, 4, device="cuda")
    rows = torch.arange(3, device="cuda")
    for args, message in [
        ((a, rows, a.cpu(), rows, 0), "one CUDA device"),
        ((a, rows, torch.zeros(10, 5, device="cuda"), rows, 0), "bytes"),
        ((a, rows.int(), a, rows, 0), "int64"),
        ((a, rows, a, rows[:2], 0), "src_rows"),
        ((a, None, torch.zeros(20, 4, device="cuda"), None, 0), "rows into dst"),
        ((a, rows, a, rows, -1), "max_blocks"),
        ((a.t(), rows, a, rows, 0), "contiguous rows"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ops._copy_rows(*args)


@cuda
@pytest.mark.parametrize("optimizer,dtype,algorithm", [
    ("sgd", torch.float32, "lru"),
    ("adam", torch.float32, "lfu"),
    ("rowwise_adagrad", torch.float16, "lru"),
])
def test_cuda_cached_training_with_row_copy_like_device(monkeypatch, optimizer, dtype, algorithm):
    monkeypatch.delenv("TBEGEN_CACHE_ROW_COPY", raising=False)  # (on by default on CUDA)
    data = batches(BIG, 6, B=64, L=8, seed=13, device="cuda", weighted=True)
    kw = dict(optimizer=optimizer, weights_dtype=dtype, device="cuda", learning_rate=0.05, stochastic_rounding=False)
    device = TableBatchedEmbeddingBags(BIG, **kw)
    cached = TableBatchedEmbeddingBags(BIG, placements=GPU_MIXED, cache_rows=1000, cache_algorithm=algorithm, **kw)
    assert cached._cache._row_copy_blocks > 0
    train_both(device, cached, data)
    torch.cuda.synchronize()
    assert_same_tables(device, cached)
    assert cached.cache_stats()["rows_written_back"] > 0


@cuda
def test_cuda_row_copy_off_with_the_switch_at_zero(monkeypatch):
    monkeypatch.setenv("TBEGEN_CACHE_ROW_COPY", "0")
    cached = TableBatchedEmbeddingBags(BIG, optimizer="sgd", device="cuda", placements=GPU_MIXED, cache_rows=1000)
    assert cached._cache._row_copy_blocks == 0
