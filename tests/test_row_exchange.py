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


@pytest.mark.parametrize("value", ["0", "-3", "65536", "8 ", "many"])
def test_grid_bound_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_BLOCKS", value)
    with pytest.raises(ValueError, match="TBEGEN_CACHE_EXCHANGE_BLOCKS"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)


@pytest.mark.parametrize("value", ["", "33"])
def test_grid_bound_reaches_the_exchange(monkeypatch, value):
    """TBEGEN_CACHE_EXCHANGE_BLOCKS=n: every exchange launch gets n as its grid bound (unset: one
    block per 8 SMs, a quarter of the row copy's bound); the cache trains as device placement does."""
    monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_BLOCKS", value)
    data, device, cached = cached_pair("sgd", "lru", torch.float32)
    bounds = []

    def op(rows, slot_rows, out_rows, in_rows, max_blocks):
        bounds.append(max_blocks)
        exchange_rows_reference(rows, slot_rows, out_rows, in_rows, max_blocks)

    with_row_copy(cached, copy_rows_reference, 66)  # (an H100's or H200's bound: half its 132 SMs)
    cached._cache._exchange_op = op
    cached._cache._exchange_blocks = cached._cache._exchange_grid(torch.device("cpu"))  # (as on CUDA)
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    assert bounds and set(bounds) == {int(value) if value else 16}


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


# ---- the per-row states in the rows' warps (TBEGEN_CACHE_EXCHANGE_STATES=1) -----------------------
#
# With the switch at 1 (and the exchange on), the fill moves each width's rows and their per-row
# states in one _exchange_rows_with_states launch per element buffer (RowCache._exchange_with_states):
# the warp that exchanges victim i's row exchanges victim i's states too. Its contract: the row
# exchange above on `rows` (which may be a view whose rows overlap: a row of D entries starting at
# every unit), and the same exchange of each state buffer, seen as rows of one entry, at the
# states' own positions.

MAX_STATES = 4  # (the operator's kMaxStates)


def check_exchange_with_states_arguments(rows, slot_rows, out_rows, in_rows, states, state_slot_rows, state_out_rows,
                                         state_in_rows, max_blocks):
    """The arguments _exchange_rows_with_states refuses (RuntimeError, the operator's words), but
    for the device: the stand-in runs on the CPU."""
    name = "tbegen: _exchange_rows_with_states: "
    if rows.dim() != 2 or rows.stride(1) != 1 or rows.stride(0) <= 0:
        raise RuntimeError(name + "rows must be 2-D with contiguous rows")
    if max_blocks < 0:
        raise RuntimeError(name + "max_blocks must be >= 0")
    n = slot_rows.numel()
    for label, r in [("slot_rows", slot_rows), ("out_rows", out_rows), ("in_rows", in_rows),
                     ("state_slot_rows", state_slot_rows), ("state_out_rows", state_out_rows),
                     ("state_in_rows", state_in_rows)]:
        if r is None:
            continue
        if r.dtype != torch.int64 or r.dim() != 1 or not r.is_contiguous():
            raise RuntimeError(name + f"{label} must be a contiguous 1-D int64 tensor")
        if r.device != rows.device:
            raise RuntimeError(name + f"{label} is on {r.device}")
        if r.numel() != n:
            raise RuntimeError(name + f"{n} slot_rows but {r.numel()} {label}")
    if len(states) > MAX_STATES:
        raise RuntimeError(name + f"at most {MAX_STATES} state buffers")
    for k, s in enumerate(states):
        if s.device != rows.device:
            raise RuntimeError(name + f"states[{k}] is on {s.device}")
        if s.dim() != 1 or not s.is_contiguous() or s.element_size() not in (1, 2, 4, 8):
            raise RuntimeError(name + f"states[{k}] must be a contiguous 1-D tensor of 1, 2, 4 or 8-byte elements")


def exchange_overlapping_rows_reference(rows, slot_rows, out_rows, in_rows):
    """exchange_rows_reference for a `rows` whose rows may overlap (stride(0) < shape[1]): the same
    moves, made on the flat elements under the view (torch refuses to write through an
    overlapping view)."""
    count, width = rows.shape
    flat = torch.as_strided(rows, (rows.untyped_storage().nbytes() // rows.element_size(),), (1,), 0)
    cols = torch.arange(width, device=rows.device)

    def at(x):
        return rows.storage_offset() + x[:, None] * rows.stride(0) + cols

    def inside(x):
        return (x >= 0) & (x < count)

    entry = inside(slot_rows)
    leaves = entry & inside(out_rows) if out_rows is not None else torch.zeros_like(entry)
    arrives = entry & inside(in_rows)
    old = flat[at(slot_rows[leaves])].clone()
    arriving = flat[at(in_rows[arrives])].clone()
    if out_rows is not None:
        flat[at(out_rows[leaves])] = old
    flat[at(slot_rows[arrives])] = arriving
    return int(leaves.sum()), int(arrives.sum())


def exchange_rows_with_states_reference(rows, slot_rows, out_rows, in_rows, states, state_slot_rows, state_out_rows,
                                        state_in_rows, max_blocks, calls=None, skip_states=False):
    """_exchange_rows_with_states's contract in torch (`skip_states`: a broken one, which leaves the
    states where they are, for the test that such an operator is caught)."""
    check_exchange_with_states_arguments(rows, slot_rows, out_rows, in_rows, states, state_slot_rows, state_out_rows,
                                         state_in_rows, max_blocks)
    leaves, arrives = exchange_overlapping_rows_reference(rows, slot_rows, out_rows, in_rows)
    state_calls = []
    for s in states:
        if not skip_states:
            exchange_rows_reference(s.view(-1, 1), state_slot_rows, state_out_rows, state_in_rows, max_blocks,
                                    calls=state_calls)
    if calls is not None:
        calls.append(dict(out=out_rows is not None, leaves=leaves, arrives=arrives, width=rows.shape[1],
                          overlapping=rows.stride(0) < rows.shape[1], states=len(states),
                          state_arrives=sum(c[2] for c in state_calls)))


def with_exchange_states(module, op, exchange_op=None, blocks=3):
    """The module's cache filling through the exchange (with_exchange), its per-row states with
    `op` where TBEGEN_CACHE_EXCHANGE_STATES says so (read again now that the exchange is on: on
    the CPU the cache found it off)."""
    with_exchange(module, exchange_op if exchange_op is not None else exchange_rows_reference, blocks)
    cache = module._cache
    cache._exchange_states_op = op
    cache._exchange_states = cache._exchange_states_on()
    return module


def _only(*names):
    import os

    narrowed = os.environ.get("TBEGEN_TEST_OPTIMIZERS", "").split()
    missing = [n for n in names if narrowed and n not in narrowed]
    if missing:
        pytest.skip(f"TBEGEN_TEST_OPTIMIZERS leaves out {missing}")


# (optimizer, weights dtype, cache algorithm, state_dtypes, tables): one per-row state (float32 or
# float16), three (float32, int64, float32: rowwise_adagrad_with_counter), a per-element state
# beside the per-row one (two element buffers), and widths whose rows span several units (the
# element buffers viewed as overlapping rows: D = 6 and 12 in units of 2 and 4). A float16 state
# is rounded stochastically with bits drawn from the row's key (common.h, store_state), which for
# a cached row is its slot's: cached training then differs from device placement at either switch
# value (the exchange or not), so that case is held to =0 only.
WIDE_MIX = [(40, 8), (25, 12), (16, 6)]
STATE_CASES = [
    ("rowwise_adagrad", torch.float32, "lru", None, TABLES),
    ("rowwise_adagrad", torch.float16, "lfu", {"momentum": torch.float16}, TABLES),
    ("rowwise_adagrad", torch.float32, "lru", None, WIDE_MIX),
    ("rowwise_adagrad_with_counter", torch.float32, "lru", None, WIDE_MIX),
    ("partial_rowwise_adam", torch.float32, "lfu", None, TABLES),
]


def _states_trio(monkeypatch, optimizer, dtype, algorithm, state_dtypes, tables, op, seed=11):
    """(device-placed module, cached with the switch at 0, cached with it at 1 through `op`), the
    cached ones filling through the exchange, all three trained on the same batches (the cached
    ones beside their own device-placed twin: bitwise equal outputs and tables; with a narrow
    state, the two cached ones batch by batch instead)."""
    _only(optimizer)
    data = batches(tables, 8, weighted=True, seed=seed)
    kw = dict(optimizer=optimizer, learning_rate=0.05, weights_dtype=dtype, stochastic_rounding=False)
    if state_dtypes:
        kw["state_dtypes"] = state_dtypes
    placements = MIXED if tables is TABLES else ["managed_caching"] * len(tables)
    cached = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_STATES", flag)
        cached[flag] = with_exchange_states(
            TableBatchedEmbeddingBags(tables, placements=placements, cache_rows=12, cache_algorithm=algorithm, **kw), op)
    device = TableBatchedEmbeddingBags(tables, **kw)
    if state_dtypes:
        train_both(cached["0"], cached["1"], data)
    else:
        train_both(device, cached["1"], data)
        train_both(TableBatchedEmbeddingBags(tables, **kw), cached["0"], data)
        assert_same_tables(device, cached["1"])
    assert_same_tables(cached["0"], cached["1"])
    assert cached["0"].cache_stats() == cached["1"].cache_stats()
    return device, cached["0"], cached["1"]


@pytest.mark.parametrize("optimizer,dtype,algorithm,state_dtypes,tables", STATE_CASES)
def test_states_move_in_the_rows_warps_and_train_like_without(monkeypatch, optimizer, dtype, algorithm,
                                                            state_dtypes, tables):
    calls, seen = [], []

    def op(rows, slot_rows, out_rows, in_rows, states, *rest):
        seen.append((rows.data_ptr(), tuple(s.data_ptr() for s in states), tuple(s.dtype for s in states)))
        exchange_rows_with_states_reference(rows, slot_rows, out_rows, in_rows, states, *rest, calls=calls)

    _, off, on = _states_trio(monkeypatch, optimizer, dtype, algorithm, state_dtypes, tables, op)
    assert on._cache._exchange_states and not off._cache._exchange_states
    buffers = on._cache_buffers()
    element = {b.data_ptr() for b, per in buffers if per == "element"}
    row = [b for b, per in buffers if per == "row"]
    assert row and len({(b, per) for b, per in buffers}) == len(buffers)
    # every fill's rows went through the operator (the module with the switch at 0 never called it),
    # every per-row state with an element buffer's rows, and the states' entries moved with them
    mine = [s for s in seen if s[0] in element]
    assert len(mine) == len(seen) > 0 and {p for p, _, _ in seen} == element
    assert {p for _, ptrs, _ in seen for p in ptrs} == {b.data_ptr() for b in row}
    assert all(sum(len(ptrs) for p, ptrs, _ in seen[k:k + len(element)]) == len(row)
               for k in range(0, len(seen), len(element)))
    assert {d for _, _, dts in seen for d in dts} == {b.dtype for b in row}
    stats = on.cache_stats()
    assert stats["rows_written_back"] > 0 and stats["rows_loaded"] > 0
    with_states = [c for c in calls if c["states"]]
    assert sum(c["arrives"] for c in with_states) == stats["rows_loaded"]
    assert sum(c["state_arrives"] for c in with_states) == stats["rows_loaded"] * len(row)
    # evicted rows and states left through it (rowwise_adagrad_with_counter's fills find every slot
    # clean: its whole-table reduce stage flushes the caches before every forward, module.py)
    assert any(c["out"] and c["leaves"] > 0 for c in with_states) == (optimizer != "rowwise_adagrad_with_counter")
    assert len({c["width"] for c in calls}) == len(set(on._cache.dims)) > 1  # (a launch per width)
    assert any(c["overlapping"] for c in calls) == (tables is WIDE_MIX)


def test_states_in_the_rows_warps_add_no_host_wait(monkeypatch):
    """With the switch at 1 the fill still waits for nothing: one wait per batch, the summary's."""
    from torch.utils._python_dispatch import _disable_current_modes

    from tbegen._sync_audit import SyncAudit
    from test_cache_syncs import MAX_WAITS_PER_PREPARE, _zipf_batches

    _only("rowwise_adagrad")
    monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_STATES", "1")
    tables = [(3000, 8), (2000, 16), (1000, 4)]
    features = [0, 1, 2, 2]
    emb = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", feature_table_map=features,
                                    placements="managed_caching", cache_rows=160)
    used = []

    def op(*args):
        used.append(args[2] is not None)
        with _disable_current_modes():
            exchange_rows_with_states_reference(*args)

    with_exchange_states(emb, op)
    data = _zipf_batches(tables, features, 30, seed=5, sizes=((8, 3),))
    for idx, offsets, grad in data[:10]:
        emb(idx, offsets).backward(grad)
    with SyncAudit() as audit:
        for idx, offsets, grad in data[10:]:
            emb(idx, offsets).backward(grad)
    mine = [e for e in audit.events if "tbegen/cache.py:" in e.site]
    assert len(mine) == 20 * MAX_WAITS_PER_PREPARE, audit.report(mine)
    assert any(used) and emb.cache_stats()["rows_written_back"] > 0


def test_states_left_behind_are_caught(monkeypatch):
    """The test above fails if the operator moves the rows but not their states."""
    def skips_states(*args):
        exchange_rows_with_states_reference(*args, skip_states=True)

    with pytest.raises(AssertionError):
        _states_trio(monkeypatch, "rowwise_adagrad", torch.float32, "lru", None, TABLES, skips_states)


def test_rows_left_behind_are_caught(monkeypatch):
    """... and if it moves the states but drops the rows' write-back."""
    def drops_write_back(rows, slot_rows, out_rows, in_rows, *rest):
        exchange_rows_with_states_reference(rows, slot_rows, None, in_rows, *rest)

    with pytest.raises(AssertionError):
        _states_trio(monkeypatch, "rowwise_adagrad", torch.float32, "lru", None, TABLES, drops_write_back)


@pytest.mark.parametrize("value", [None, "", "0"])
def test_states_switch_off_moves_states_as_before(monkeypatch, value):
    """Unset, empty or 0: a kernel per buffer, the per-row states as rows of one entry (the way it
    was); the operator is never called."""
    _only("rowwise_adagrad")
    if value is None:
        monkeypatch.delenv("TBEGEN_CACHE_EXCHANGE_STATES", raising=False)
    else:
        monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_STATES", value)
    data = batches(TABLES, 6, seed=14)
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    called, shapes = [], set()

    def exchange(rows, *args):
        shapes.add(tuple(rows.shape[1:]))
        exchange_rows_reference(rows, *args)

    cached = with_exchange_states(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw),
                                  lambda *a: called.append(a), exchange_op=exchange)
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    assert not called and (1,) in shapes and cached.cache_stats()["rows_written_back"] > 0


def test_states_switch_leaves_int8_rows_alone(monkeypatch):
    """int8 rows (codes and qparams, the "int8 rows" layout) keep a kernel per buffer with the switch at 1."""
    from test_int8 import ALL, CACHE_PLACEMENTS, CACHE_TABLES, assert_same_int8_training, int8_data, make, train_int8

    if "rowwise_adagrad" not in ALL:
        pytest.skip("TBEGEN_TEST_OPTIMIZERS leaves out rowwise_adagrad")
    monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_STATES", "1")
    device = make("rowwise_adagrad", tables=CACHE_TABLES, ftm=None)
    cached = make("rowwise_adagrad", tables=CACHE_TABLES, ftm=None, placements=CACHE_PLACEMENTS, cache_rows=12)
    called = []
    with_exchange_states(cached, lambda *a: called.append(a))
    assert cached._cache._exchange_states  # (on: but not for these buffers)
    train_int8(cached, int8_data(device, 8, B=4, seed=17), other=device)
    assert not called and cached.cache_stats()["rows_written_back"] > 0
    assert_same_int8_training(device, cached)


@pytest.mark.parametrize("value", [None, "1"])
def test_states_switch_off_on_the_cpu(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TBEGEN_CACHE_EXCHANGE_STATES", raising=False)
    else:
        monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_STATES", value)
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)
    assert not emb._cache._exchange_states  # (no exchange on the CPU, no such operator in a CPU build)


@pytest.mark.parametrize("value", ["yes", "2", "on", " 1", "true"])
def test_states_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_STATES", value)
    with pytest.raises(ValueError, match="TBEGEN_CACHE_EXCHANGE_STATES must be 0 or 1"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)


def test_states_reference_by_hand():
    """The contract the CUDA test below holds the kernel to, on a small case by hand: a view of
    overlapping rows (3 entries from every second one; the rows the entries name never overlap),
    rows outside either tensor skipped, the states at their own positions, in three widths."""
    flat = torch.arange(28, dtype=torch.float32)
    rows = flat.as_strided((13, 3), (2, 1))  # (row r: entries 2r, 2r + 1, 2r + 2; the even rows are disjoint)
    momentum = torch.arange(100, 110, dtype=torch.float32)
    counter = torch.arange(200, 210, dtype=torch.int64)
    half = torch.arange(10, dtype=torch.float16)
    slot, out, inn = torch.tensor([0, 6, 13, 10]), torch.tensor([4, -1, 2, 12]), torch.tensor([2, 8, 4, 99])
    s_slot, s_out, s_in = torch.tensor([1, 0, 2, 11]), torch.tensor([5, 6, -1, 7]), torch.tensor([8, -3, 9, 4])
    want_flat = flat.clone()
    want_flat[8:11] = flat[0:3]     # entry 0: slot 0's old row to row 4, and row 2 arrives in it
    want_flat[0:3] = flat[4:7]
    want_flat[12:15] = flat[16:19]  # entry 1: nothing written back, row 8 arrives in slot 6
    want_flat[24:27] = flat[20:23]  # entry 3: slot 10's old row to row 12, row 99 is outside
    # (entry 2: slot 13 is outside, the entry is skipped)
    wants = []
    for s in (momentum, counter, half):
        w = s.clone()
        w[5], w[6] = s[1], s[0]  # (entries 0, 1 write back; entry 2 has none; entry 3 has no slot)
        w[1], w[2] = s[8], s[9]  # (entries 0, 2 load; entry 1's row -3 is outside)
        wants.append(w)
    # the states read first: entry 1's slot 0 is written back from its old value, not from row 8's
    calls = []
    exchange_rows_with_states_reference(rows, slot, out, inn, [momentum, counter, half], s_slot, s_out, s_in, 0,
                                        calls=calls)
    assert torch.equal(flat, want_flat)
    for got, want in zip((momentum, counter, half), wants):
        assert torch.equal(got, want)
    assert calls == [dict(out=True, leaves=2, arrives=2, width=3, overlapping=True, states=3, state_arrives=6)]


def _bad_states_arguments(rows, r, s):
    """(arguments, the refusal's words) that the operator and its stand-in both refuse, for rows of
    10 x 4, the entries `r` (3 of them) and a state `s` of 10 entries, all on one device."""
    return [
        ((rows, r.int(), None, r, [s], r, None, r, 0), "slot_rows must be a contiguous 1-D int64"),
        ((rows, r, None, r, [s], r, None, r.int(), 0), "state_in_rows must be a contiguous 1-D int64"),
        ((rows, r, None, r[:2], [s], r, None, r, 0), "3 slot_rows but 2 in_rows"),
        ((rows, r, None, r, [s], r, r[:1], r, 0), "3 slot_rows but 1 state_out_rows"),
        ((rows, r, None, r, [s.to(torch.complex128)], r, None, r, 0), r"states\[0\] must be"),
        ((rows, r, None, r, [s.view(5, 2)], r, None, r, 0), r"states\[0\] must be"),
        ((rows, r, None, r, [s[::2]], r, None, r, 0), r"states\[0\] must be"),
        ((rows, r, None, r, [s] * 5, r, None, r, 0), "at most 4"),
        ((rows, r, None, r, [s], r, None, r, -1), "max_blocks"),
        ((rows.t(), r, None, r, [s], r, None, r, 0), "contiguous rows"),
    ]


def test_states_reference_refuses_bad_arguments():
    """The stand-in refuses what the operator refuses (the cuda test below holds the operator to
    the same words), so that the cache's use of it is held to the contract on the CPU too."""
    rows = torch.zeros(10, 4)
    r = torch.arange(3)
    s = torch.zeros(10)
    ok = (rows, r, None, r, [s], r, None, r, 0)
    exchange_rows_with_states_reference(*ok)
    for bad, message in _bad_states_arguments(rows, r, s):
        with pytest.raises(RuntimeError, match=message):
            exchange_rows_with_states_reference(*bad)


# ---- the operator on a GPU ----


def _random_entries(n, size, g):
    """slot / out / in row numbers over `size` rows: distinct, some without a row to write back,
    some loading nothing, some without a slot."""
    perm = torch.randperm(size, generator=g)
    slot, out, inn = perm[:n].clone(), perm[n:2 * n].clone(), perm[2 * n:3 * n].clone()
    some = torch.randperm(n, generator=g)
    out[some[: n // 4]] = -1
    inn[some[n // 4: n // 4 + max(1, n // 20)]] = size
    slot[some[n // 3: n // 3 + n // 30]] = torch.tensor([-1, size + 3, -(1 << 40)])[torch.arange(n // 30) % 3]
    return slot, out, inn


@cuda
@pytest.mark.parametrize("dtype,width,unit", [(torch.float32, 128, 128), (torch.float32, 4, 4), (torch.float16, 8, 8),
                                              (torch.float32, 12, 4), (torch.float16, 6, 2), (torch.float32, 33, 33)])
@pytest.mark.parametrize("n", [1, 127, 333, 4099])
@pytest.mark.parametrize("max_blocks", [0, 1])
@pytest.mark.parametrize("nstates", [0, 1, 3, 4])
def test_cuda_exchange_rows_with_states_matches_the_reference(dtype, width, unit, n, max_blocks, nstates):
    ops = _ops()
    g = torch.Generator().manual_seed(width * 7919 + n * 13 + nstates)
    # entries' rows a whole row apart (per_run units; from unit 1 where a row spans several: the
    # view's overlapping rows, as the cache places them), never overlapping each other
    per_run, shift = width // unit, (1 if width > unit else 0)
    groups = 3 * n + 40
    count = groups * per_run + shift
    numel = (count - 1) * unit + width
    base = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), generator=g,
                         dtype=torch.uint8).view(dtype).cuda()
    state_dtypes = [torch.float32, torch.int64, torch.float16, torch.bfloat16][:nstates]
    ssize = 3 * n + 17
    state_base = [torch.randint(-1000, 1000, (ssize,), generator=g).to(d).cuda() for d in state_dtypes]

    def place(x):  # (a group's first row; the numbers outside the groups stay outside the view)
        return torch.where((x >= 0) & (x < groups), x * per_run + shift, torch.where(x >= groups, x - groups + count, x))

    slot, out, inn = (place(x).cuda() for x in _random_entries(n, groups, g))
    s_slot, s_out, s_in = (x.cuda() for x in _random_entries(n, ssize, g))
    for with_out in (True, False):
        got, want = base.clone(), base.clone()
        got_s, want_s = [s.clone() for s in state_base], [s.clone() for s in state_base]
        view = lambda t: t.as_strided((count, width), (unit, 1))  # noqa: E731
        ops._exchange_rows_with_states(view(got), slot, out if with_out else None, inn, got_s, s_slot,
                                       s_out if with_out else None, s_in, max_blocks)
        exchange_rows_with_states_reference(view(want), slot, out if with_out else None, inn, want_s, s_slot,
                                            s_out if with_out else None, s_in, max_blocks)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), with_out
        for k, (a, b) in enumerate(zip(got_s, want_s)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (with_out, k)
        assert not torch.equal(got.view(torch.uint8), base.view(torch.uint8)) or n == 1


@cuda
def test_cuda_exchange_rows_with_states_refuses_bad_arguments():
    ops = _ops()
    a = torch.zeros(10, 4, device="cuda")
    r = torch.arange(3, device="cuda")
    s = torch.zeros(10, device="cuda")
    for args, message in [
        ((a.cpu(), r.cpu(), None, r.cpu(), [s.cpu()], r.cpu(), None, r.cpu(), 0), "CUDA device"),
        ((a, r, None, r, [s.cpu()], r, None, r, 0), r"states\[0\] is on cpu"),
        ((a, r, None, r, [s], r.cpu(), None, r, 0), "state_slot_rows is on cpu"),
    ] + _bad_states_arguments(a, r, s):
        with pytest.raises(RuntimeError, match=message):
            ops._exchange_rows_with_states(*args)


@cuda
@pytest.mark.parametrize("optimizer,dtype,algorithm", [
    ("rowwise_adagrad", torch.float32, "lru"),
    ("rowwise_adagrad", torch.float16, "lfu"),
    ("rowwise_adagrad_with_counter", torch.float32, "lru"),
])
def test_cuda_cached_training_with_states_in_the_rows_warps_like_without(monkeypatch, optimizer, dtype, algorithm):
    """=1 against =0 (both through the exchange) and against device placement, bitwise; BIG's four
    widths (one launch each)."""
    _only(optimizer)
    monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE", "1")
    _, off, on = train_switch_both_ways(monkeypatch, "TBEGEN_CACHE_EXCHANGE_STATES", optimizer, dtype, algorithm)
    assert on._cache._exchange_states and not off._cache._exchange_states
    assert on._cache._exchange_blocks > 0 and off._cache._exchange_blocks > 0
    assert on.cache_stats()["rows_written_back"] > 0
