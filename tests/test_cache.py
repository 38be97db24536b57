"""Placement "managed_caching" (tbegen/cache.py, docs/placements.md): host-resident tables behind
a cache of hot rows that the unchanged kernels read and update.

The cache logic is torch operations on the module's device, so the CPU tests run all of it
(loads, LRU/LFU evictions, write-backs, prefetching ahead, flushes, state_dicts) with tiny caches
that force evictions on every batch, and check that training is bitwise that of all-device
placement. The `cuda` tests check the same on a GPU, with the tables in managed memory.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from tbegen import placement
from tbegen.fbgemm_compat import (CacheAlgorithm, ComputeDevice, EmbeddingLocation,
                                  SplitTableBatchedEmbeddingBagsCodegen, _devices)
from tbegen.module import TableBatchedEmbeddingBags

from test_placements import train  # (one training loop for the placement tests)

cuda = pytest.mark.cuda
TABLES = [(40, 8), (25, 12), (16, 4)]
MIXED = ["managed_caching", "device", "managed_caching"]


@pytest.fixture(scope="module", autouse=True)
def built(prebuilt):
    for name in ("sgd", "adam", "rowwise_adagrad"):
        TableBatchedEmbeddingBags([(4, 4)], optimizer=name)


def batches(tables, steps, B=4, L=2, seed=1, device="cpu", weighted=False, features=None):
    """`steps` batches of ragged bags (some empty, up to 2L-1 long, repeats likely), one block of
    bags per feature (feature f reads table features[f]): [indices, offsets, psw or None, grad]."""
    features = list(range(len(tables))) if features is None else features
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = [int(n) for n in torch.randint(0, 2 * L, (len(features) * B,), generator=g)]
        idx = torch.cat([torch.randint(0, tables[features[k // B]][0], (n,), generator=g) for k, n in enumerate(lengths)])
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        psw = torch.rand(idx.numel(), generator=g) if weighted else None
        grad = torch.randn(B, sum(tables[t][1] for t in features), generator=g)
        out.append([t.to(device) if t is not None else None for t in (idx, offsets, psw, grad)])
    return out


def train_both(device, cached, data):
    """Trains both modules batch by batch; each batch's forward outputs must be equal bitwise."""
    for idx, offsets, psw, grad in data:
        a, b = device(idx, offsets, psw), cached(idx, offsets, psw)
        assert torch.equal(a, b)
        a.backward(grad)
        b.backward(grad)


def assert_same_tables(a, b):
    """Every table's rows and optimizer states equal bitwise (caches written back first)."""
    for x, y in zip(a.split_embedding_weights(), b.split_embedding_weights()):
        assert torch.equal(x, y)
    for x, y in zip(a.split_optimizer_states(), b.split_optimizer_states()):
        for name in x:
            assert torch.equal(x[name], y[name]), name
    assert a.step == b.step


# ---- training is bitwise that of device placement ------------------------------------------------


@pytest.mark.parametrize("optimizer,algorithm,weighted,pooling", [
    ("sgd", "lru", False, "sum"),
    ("rowwise_adagrad", "lfu", True, "sum"),   # a per-row state moves with its row
    ("adam", "lru", True, "mean"),             # per-element states move with their row
    ("adam", "lfu", False, "sum"),
])
def test_cached_tables_train_bitwise_like_device(optimizer, algorithm, weighted, pooling):
    data = batches(TABLES, 8, weighted=weighted)
    kw = dict(optimizer=optimizer, learning_rate=0.05, pooling=pooling)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    # 12 slots for 40 and 16 rows, a batch reading up to 12 rows of each: evictions every batch
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, cache_algorithm=algorithm, **kw)
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    assert stats["evictions"] > 0 and stats["rows_written_back"] > 0
    assert 0 < stats["hits"] < stats["lookups"]


def test_shared_cached_table_narrow_and_int_states():
    """Two features read one cached table; a bf16-free counter optimizer with an int64 per-row
    state and float per-row states (all move with the row); fp16 weights without stochastic
    rounding (rounded to nearest: no slot-keyed random bits) are bitwise too."""
    ftm = [0, 1, 0, 2]
    data = batches(TABLES, 6, features=ftm, weighted=True, seed=3)
    for kw in (dict(optimizer="rowwise_adagrad_with_counter", learning_rate=0.05),
               dict(optimizer="adam", weights_dtype=torch.float16, stochastic_rounding=False, learning_rate=0.05)):
        device = train(TableBatchedEmbeddingBags(TABLES, feature_table_map=ftm, **kw), data)
        cached = TableBatchedEmbeddingBags(TABLES, feature_table_map=ftm, placements="managed_caching",
                                           cache_rows=[24, 24, 16], **kw)
        assert_same_tables(device, train(cached, data))
        assert cached.cache_stats()["evictions"] > 0


def test_int32_indices():
    data = [[i.to(torch.int32), o.to(torch.int32), p, g] for i, o, p, g in batches(TABLES, 5, seed=6)]
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw)
    train_both(device, cached, data)
    assert_same_tables(device, cached)


def test_fp16_stochastic_rounding_is_deterministic():
    """With stochastic rounding a cached row's random bits are keyed by its slot: two runs agree
    bitwise, and the result stays within rounding of device placement's."""
    data = batches(TABLES, 6, seed=5)
    kw = dict(optimizer="sgd", weights_dtype=torch.float16, learning_rate=0.05)
    a = train(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw), data)
    b = train(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw), data)
    d = train(TableBatchedEmbeddingBags(TABLES, **kw), data)
    assert_same_tables(a, b)
    for x, y in zip(a.split_embedding_weights(), d.split_embedding_weights()):
        torch.testing.assert_close(x.float(), y.float(), atol=2e-3, rtol=0)


@pytest.mark.parametrize("defer", [True, False])
def test_prefetch_ahead_with_evictions_in_between(defer):
    """prefetch(batch k+1) between forward and backward of batch k, with a cache too small for
    both batches: the prefetch is deferred (nothing moves; batch k+1's forward looks it up), so
    every batch is looked up once. Without the deferral (the behaviour before landing8: every
    hold let go, batch k's rows evicted, its backward putting them back, batch k+1's forward
    looking up again) the batches are looked up more often; the numbers are the same either way."""
    data = batches(TABLES, 6, seed=7, weighted=True)
    kw = dict(optimizer="adam", learning_rate=0.05)
    device = train(TableBatchedEmbeddingBags(TABLES, **kw), data)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw)
    if not defer:
        prepare = cached._cache.prepare
        cached._cache.prepare = lambda *a, defer=False, **k: prepare(*a, **k)
    _train_prefetching_ahead(cached, data)
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    if defer:
        assert stats["deferred"] > 0
        assert stats["prepares"] == len(data)  # each batch looked up once
    else:
        assert stats["deferred"] == 0 and stats["prepares"] > len(data)


@pytest.mark.parametrize("rule", [True, False])
def test_prefetch_beside_a_batch_read_in_place(monkeypatch, rule):
    """A batch with more distinct rows of a table than its cache holds reads the rest in their
    backing rows, and any row moved into the cache afterwards makes its backward look it up again.
    So a prefetch between its forward and backward that would move rows is deferred: each batch is
    looked up once (without the rule: more often); the numbers are those of device placement."""
    data = batches(TABLES, 6, B=6, L=3, seed=17, weighted=True)
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05)
    device = train(TableBatchedEmbeddingBags(TABLES, **kw), data)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=4, **kw)
    if not rule:
        monkeypatch.setattr(cached._cache, "_backing_in_flight", lambda: False)
    _train_prefetching_ahead(cached, data)
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    assert stats["backing_lookups"] > 0  # (the batches do overflow the caches)
    if rule:
        assert stats["deferred"] > 0 and stats["prepares"] == len(data)
    else:
        assert stats["prepares"] > len(data)


def test_prefetch_beside_a_batch_read_in_place_skips_its_lookup():
    """Every table direct (one width), caches smaller than a batch's distinct rows: each batch in
    flight reads rows in place, so each prefetch beside it is deferred before its lookup (no sort,
    no host wait: RowCache.prepare's early deferral), each batch is looked up once, by its forward,
    and the numbers are those of device placement."""
    tables = [(40, 8), (25, 8), (30, 8)]
    data = batches(tables, 6, B=6, L=3, seed=17, weighted=True)
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05)
    device = train(TableBatchedEmbeddingBags(tables, **kw), data)
    cached = TableBatchedEmbeddingBags(tables, placements="managed_caching", cache_rows=4, **kw)
    assert all(cached.cache_stats()["direct"].values())
    sort = cached._cache._sort_keys
    sorts = []
    cached._cache._sort_keys = lambda keys: sorts.append(keys.numel()) or sort(keys)
    _train_prefetching_ahead(cached, data)
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    assert stats["backing_lookups"] > 0 and stats["deferred"] == len(data) - 1  # (every prefetch but the first)
    assert stats["prepares"] == len(data)  # each batch looked up once
    assert len(sorts) == stats["prepares"]  # (a lookup deferred after its sort would add one)


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_prefetch_ahead_keeps_the_batch_in_flight(algorithm):
    """prefetch(batch k+1) between forward and backward of batch k, with room for both batches
    but not for every row: the prefetch evicts other rows, never batch k's (held until its
    backward), so every batch is looked up once; the numbers are those of device placement."""
    data = batches(TABLES, 8, seed=11, weighted=True)
    kw = dict(optimizer="adam", learning_rate=0.05)
    device = train(TableBatchedEmbeddingBags(TABLES, **kw), data)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=24, cache_algorithm=algorithm, **kw)
    _train_prefetching_ahead(cached, data)
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    assert stats["evictions"] > 0 and stats["deferred"] == 0
    assert stats["prepares"] == len(data)  # no batch looked up a second time by its backward


def test_prefetch_is_used_by_the_forward():
    data = batches(TABLES, 1, seed=8)
    idx, offsets, psw, grad = data[0]
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_load_factor=1.0)
    emb.prefetch(idx, offsets)
    assert emb.cache_stats()["prepares"] == 1
    emb(idx, offsets).backward(grad)
    assert emb.cache_stats()["prepares"] == 1  # the forward took the prefetched lookup
    emb(idx.clone(), offsets).backward(grad)  # other tensors: a lookup of its own
    assert emb.cache_stats()["prepares"] == 2
    emb.prefetch(idx, offsets)
    idx.add_(0)  # changed in place after the prefetch (its version moved on): looked up again
    emb(idx, offsets)
    assert emb.cache_stats()["prepares"] == 4


def test_no_grad_forward_leaves_nothing_dirty():
    data = batches(TABLES, 1, seed=9)
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)
    with torch.no_grad():
        emb(data[0][0], data[0][1])
    stats = emb.cache_stats()
    assert stats["resident_rows"] > 0 and stats["dirty_rows"] == 0
    emb(data[0][0], data[0][1]).backward(data[0][3])
    assert emb.cache_stats()["dirty_rows"] == emb.cache_stats()["resident_rows"]
    emb.flush()
    stats = emb.cache_stats()
    assert stats["dirty_rows"] == 0 and stats["resident_rows"] > 0  # flushed rows stay cached
    assert stats["rows_written_back"] == stats["rows_loaded"]


# ---- replacement: which rows stay --------------------------------------------------------------


def _one_table_batches(rows_per_batch):
    out = []
    for rows in rows_per_batch:
        idx = torch.tensor(rows, dtype=torch.int64)
        out.append((idx, torch.tensor([0, len(rows)], dtype=torch.int64)))
    return out


def _resident(emb):
    cache = emb._cache
    return sorted(int(r) for r in cache._slot_row if r >= 0)


@pytest.mark.parametrize("algorithm,kept", [("lru", [1, 2]), ("lfu", [0, 2])])
def test_lru_and_lfu_evict_what_they_should(algorithm, kept):
    """Two slots. Row 0 is read three times in batch 1, row 1 once in batch 1 and once in batch 2;
    batch 3 reads row 2: LRU evicts row 0 (least recently used), LFU row 1 (read less often)."""
    emb = TableBatchedEmbeddingBags([(10, 4)], optimizer="sgd", placements="managed_caching", cache_rows=2,
                                    cache_algorithm=algorithm)
    for idx, offsets in _one_table_batches([[0, 0, 0, 1], [1], [2]]):
        emb(idx, offsets).backward(torch.ones(1, 4))
    assert _resident(emb) == kept
    stats = emb.cache_stats()
    assert (stats["lookups"], stats["hits"], stats["rows_loaded"], stats["evictions"]) == (6, 1, 3, 1)
    assert stats["rows_written_back"] == 1 and stats["bytes_written_back"] == 4 * 4  # the evicted (dirty) row


class _ReferenceCache:
    """The replacement policy in plain Python, one table: slot s holds row or None; victims are
    the coldest slots not read by the batch (empty first; LRU by last use, LFU by access count
    then last use; ties by slot), assigned to the batch's missing rows in row order."""

    def __init__(self, slots, algorithm):
        self.row = [None] * slots
        self.used = [0] * slots
        self.count = {}
        self.algorithm = algorithm
        self.tick = 0

    def batch(self, rows):
        self.tick += 1
        for r in rows:
            self.count[r] = self.count.get(r, 0) + 1
        need = sorted(set(rows))
        where = {r: s for s, r in enumerate(self.row) if r is not None}
        for r in need:
            if r in where:
                self.used[where[r]] = self.tick
        missing = [r for r in need if r not in where]
        keep = {where[r] for r in need if r in where}

        def coldness(s):
            if self.row[s] is None:
                return (-1, -1, s)
            if self.algorithm == "lru":
                return (self.used[s], 0, s)
            return (self.count[self.row[s]], self.used[s], s)

        victims = sorted((s for s in range(len(self.row)) if s not in keep), key=coldness)
        for r, s in zip(missing, victims):
            self.row[s] = r
            self.used[s] = self.tick


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_replacement_matches_a_reference_over_skewed_batches(algorithm):
    g = torch.Generator().manual_seed(11)
    probs = 1.0 / torch.arange(1, 61, dtype=torch.float64) ** 1.1  # Zipf-like over 60 rows
    emb = TableBatchedEmbeddingBags([(60, 4), (5, 4)], optimizer="sgd", placements=["managed_caching", "device"],
                                    cache_rows=16, cache_algorithm=algorithm)
    ref = _ReferenceCache(16, algorithm)
    for _ in range(25):
        rows = torch.multinomial(probs, 12, replacement=True, generator=g).tolist()
        idx = torch.tensor(rows + [1, 2], dtype=torch.int64)
        offsets = torch.tensor([0, 6, 12, 13, 14], dtype=torch.int64)  # B = 2, feature 1 (device) after
        emb(idx, offsets).backward(torch.ones(2, 8))
        ref.batch(rows)
        assert emb._cache._slot_row.tolist() == [-1 if r is None else r for r in ref.row]


# ---- limits and errors ----------------------------------------------------------------------------


# A wide cached table before a large narrow one: its slots cannot continue its rows without
# padding larger than its cache ("compact": an overflowing batch bypasses the cache); the last
# table is "direct" with adam (no per-row state to pad), compact with rowwise_adagrad.
COMPACT_TABLES = [(40, 64), (2000, 4), (16, 4)]


@pytest.mark.parametrize("optimizer,tables,direct", [
    ("adam", TABLES, {0: True, 2: True}),
    ("rowwise_adagrad", TABLES, {0: True, 2: True}),
    ("adam", COMPACT_TABLES, {0: False, 2: True}),
    ("rowwise_adagrad", COMPACT_TABLES, {0: False, 2: False}),
])
def test_batches_larger_than_the_cache(optimizer, tables, direct):
    """A batch with more distinct rows of a table than its cache holds: a "direct" table caches
    the batch's most read rows and reads the others in the backing store in place; a "compact"
    table is written back and emptied, and the batch reads all of it in the backing store
    (warned). Same numbers either way, also with such batches alternating with fitting ones and
    with prefetching ahead."""
    small = batches(tables, 6, seed=15, weighted=True)  # up to 12 distinct rows per table
    large = batches(tables, 3, B=8, L=4, seed=16, weighted=True)  # up to 56: more than 12 slots
    data = [small[0], small[1], large[0], small[2], large[1], large[2], small[3], small[4], small[5]]
    kw = dict(optimizer=optimizer, learning_rate=0.05)
    device = TableBatchedEmbeddingBags(tables, **kw)
    cached = TableBatchedEmbeddingBags(tables, placements=MIXED, cache_rows=12, **kw)
    assert cached.cache_stats()["direct"] == direct
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_both(device, cached, data)
    bypass_warnings = [w for w in caught if "bypassing its cache" in str(w.message)]
    assert len(bypass_warnings) == sum(not d for d in direct.values())  # once per compact table
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    assert stats["backing_lookups"] > 0 and stats["hits"] > 0
    assert (stats["bypasses"] > 0) == (not all(direct.values()))
    # pipelined: prefetches of overflowing and fitting batches between forward and backward
    device = train(TableBatchedEmbeddingBags(tables, **kw), data)
    cached = TableBatchedEmbeddingBags(tables, placements=MIXED, cache_rows=12, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, (idx, offsets, psw, grad) in enumerate(data):
            out = cached(idx, offsets, psw)
            if k + 1 < len(data):
                cached.prefetch(data[k + 1][0], data[k + 1][1])
            out.backward(grad)
    assert_same_tables(device, cached)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(cache_load_factor=0.0), ValueError, r"cache_load_factor must be a number in \(0, 1\]"),
    (dict(cache_load_factor=1.5), ValueError, r"cache_load_factor must be a number in \(0, 1\]"),
    (dict(cache_load_factor="0.2"), ValueError, r"cache_load_factor must be a number"),
    (dict(cache_rows=[4, 4]), ValueError, r"cache_rows has 2 entries but the module has 3 table\(s\)"),
    (dict(cache_rows=[4, None, 0]), ValueError, r"cache_rows for table 2 must be a positive int, got 0"),
    (dict(cache_rows=2.5), TypeError, r"cache_rows must be an int or a list"),
    (dict(cache_algorithm="fifo"), ValueError, r"cache_algorithm must be one of \['lru', 'lfu'\], got 'fifo'"),
])
def test_bad_cache_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, **kwargs)


def test_cache_sizes_and_refusals():
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_load_factor=0.1)
    assert emb.cache_stats()["cache_rows"] == {0: 4, 2: 2}  # 10% of 40 and of 16, rounded up
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=1000)
    assert emb.cache_stats()["cache_rows"] == {0: 40, 2: 16}  # capped at the table's rows
    assert "cache_rows=[40, 16], cache_algorithm='lru'" in repr(emb)
    assert TableBatchedEmbeddingBags(TABLES, optimizer="sgd").cache_stats() == {}
    with pytest.raises(ValueError, match=r"placement 'managed_caching' with optimizer 'none' \(dense gradients\)"):
        TableBatchedEmbeddingBags(TABLES, optimizer="none", placements=MIXED)


def bad_index_batches(tables):
    """Three batches of one bag per feature (B = 1) with out-of-range indices of the first and the
    last table (the last batch has no index of table 0 in range), for bounds_check_mode "warn"."""
    offsets = torch.tensor([0, 2, 2, 3], dtype=torch.int64)
    width = sum(D for _, D in tables)
    return [[torch.tensor(i), offsets, None, torch.ones(1, width)] for i in ([3, 40, 7], [-1, 3, 7], [40, -1, 16])]


def test_bad_index_of_a_cached_table():
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)
    offsets = torch.tensor([0, 2, 2, 3], dtype=torch.int64)  # B = 1
    with pytest.raises(RuntimeError, match=r"indices\[1\] = 40 is out of range for feature 0, whose table \(table 0, "
                                           r"placement 'managed_caching'\) has 40 rows"):
        emb(torch.tensor([3, 40, 7]), offsets)
    # bounds_check_mode "warn": skipped, as with device placement; the last batch has no index
    # of table 0 in range, and one of table 2 out of range (direct and compact tables)
    kw = dict(optimizer="sgd", bounds_check_mode="warn", learning_rate=0.5)
    for tables in (TABLES, COMPACT_TABLES):
        data = bad_index_batches(tables)
        with pytest.warns(RuntimeWarning, match="skipped"):
            device = train(TableBatchedEmbeddingBags(tables, **kw), data)
        with pytest.warns(RuntimeWarning, match="skipped"):
            cached = train(TableBatchedEmbeddingBags(tables, placements=MIXED, cache_rows=12, **kw), data)
        assert_same_tables(device, cached)
        assert list(cached.cache_stats()["direct"].values()) == ([True, True] if tables is TABLES else [False, True])


# ---- state_dict, views, moves ----------------------------------------------------------------------


def test_state_dict_round_trip_loses_no_cached_row():
    data = batches(TABLES, 6, seed=12, weighted=True)
    kw = dict(optimizer="adam", learning_rate=0.05)
    cached = train(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw), data[:3])
    assert cached.cache_stats()["dirty_rows"] > 0  # (no flush before saving: state_dict does it)
    buf = io.BytesIO()
    torch.save(cached.state_dict(), buf)
    reference = train(TableBatchedEmbeddingBags(TABLES, **kw), data)
    for target in (TableBatchedEmbeddingBags(TABLES, seed=9, **kw),
                   TableBatchedEmbeddingBags(TABLES, seed=9, placements=MIXED, cache_rows=12, **kw)):
        buf.seek(0)
        target.load_state_dict(torch.load(buf))
        assert_same_tables(reference, train(target, data[3:]))
    # and loading into a cached module with dirty rows: the loaded rows win
    stale = train(TableBatchedEmbeddingBags(TABLES, seed=4, placements=MIXED, cache_rows=12, **kw), data[3:])
    buf.seek(0)
    stale.load_state_dict(torch.load(buf))
    assert_same_tables(reference, train(stale, data[3:]))
    assert_same_tables(reference, train(cached, data[3:]))


def test_writes_through_the_views_are_read():
    kw = dict(optimizer="sgd", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw)
    data = batches(TABLES, 4, seed=13)
    train(device, data[:2])
    train(cached, data[:2])
    for emb in (device, cached):
        with torch.no_grad():
            emb.split_embedding_weights()[0][::2].fill_(0.25)  # (rows the cache may hold)
    train_both(device, cached, data[2:])
    assert_same_tables(device, cached)


def test_drop_cache_then_writes_to_the_tables_are_read():
    """drop_cache (TorchRec's purge, before it loads a state_dict into the tables' memory) empties
    the caches without writing back, so rows then written to the tables' memory (not through
    split_embedding_weights, which flushes) are what the next batch reads; without it the stale
    cached copies would be read."""
    kw = dict(optimizer="sgd", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw)
    data = batches(TABLES, 4, seed=15)
    train(device, data[:2])
    train(cached, data[:2])
    assert cached.cache_stats()["resident_rows"] > 0
    cached.drop_cache()  # (the changed cached rows are lost: every table is written below)
    assert cached.cache_stats()["resident_rows"] == 0
    for t, (E, D) in enumerate(TABLES):
        rows = slice(cached.layout.table_offsets[t], cached.layout.table_offsets[t] + E * D)
        for emb in (device, cached):
            with torch.no_grad():
                emb.weights[rows] = torch.linspace(-1, 1, E * D) + t  # (the buffer itself: no flush on the way)
    train_both(device, cached, data[2:])
    assert_same_tables(device, cached)


def test_moving_a_cached_module():
    data = batches(TABLES, 6, seed=14)
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05)
    device = train(TableBatchedEmbeddingBags(TABLES, **kw), data)
    cached = train(TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, **kw), data[:3])
    cached.to("cpu")  # (written back and emptied; the buffers are the same)
    cached.float()
    assert_same_tables(device, train(cached, data[3:]))


# ---- FBGEMM's EmbeddingLocation.MANAGED_CACHING --------------------------------------------------


def test_fbgemm_managed_caching_maps_onto_the_placement():
    specs = [(10, 4, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA), (7, 8, "DEVICE", "CUDA"),
             (5, 4, "MANAGED", "CUDA")]
    tables, placements, _ = _devices(specs, "cuda:0")
    assert placements == ["managed_caching", "device", "managed"]


# ---- where the per-row states of cached tables live (TBEGEN_CACHE_ROW_STATES) -----------------------


def test_row_states_rule():
    """auto: on the device while all the per-row states take at most a quarter of the cache's rows'
    bytes (C2's rowwise momentum, 128 MB, beside its 20% and 5% caches' 3.3 GB and 0.8 GB)."""
    MB = 1 << 20
    assert placement.row_states_on_device(128 * MB, 3277 * MB)
    assert placement.row_states_on_device(128 * MB, 819 * MB)
    assert placement.row_states_on_device(100, 400) and not placement.row_states_on_device(101, 400)


@pytest.mark.parametrize("value", ["Device", "host", "0"])
def test_row_states_bad_value_is_named(monkeypatch, value):
    monkeypatch.setenv("TBEGEN_CACHE_ROW_STATES", value)
    with pytest.raises(ValueError, match="TBEGEN_CACHE_ROW_STATES must be one of"):
        TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", placements=MIXED, cache_rows=12)


def _allocations(monkeypatch, **kw):
    """(numel, placements) of every buffer the module allocates."""
    seen = []
    real = placement.allocate

    def spy(ops, numel, dtype, device, placements, ranges):
        seen.append((numel, list(placements)))
        return real(ops, numel, dtype, device, placements, ranges)

    monkeypatch.setattr(placement, "allocate", spy)
    emb = TableBatchedEmbeddingBags(TABLES, placements=MIXED, **kw)
    return emb, seen


@pytest.mark.parametrize("value,cache_rows,on_device", [
    ("device", 12, True), ("cached", 12, False),
    ("", 12, False),   # 56 rows' momentum (224 bytes) beside 12 + 12 slots of 8 and 4 floats (576 bytes)
    ("", 40, True),    # ... beside 40 + 16 slots (1536 bytes)
])
def test_row_states_placement(monkeypatch, value, cache_rows, on_device):
    """The per-row state's buffer (rowwise_adagrad's momentum) takes "device" for the cached
    tables' ranges where the rule says so; the weights keep their placements either way."""
    monkeypatch.setenv("TBEGEN_CACHE_ROW_STATES", value)
    emb, seen = _allocations(monkeypatch, optimizer="rowwise_adagrad", cache_rows=cache_rows)
    assert emb._row_states_on_device() == on_device
    row_numel = emb.layout.total_hash_size + emb._cache.keys_tail
    by_numel = dict(seen)
    assert by_numel[row_numel][:3] == (["device"] * 3 if on_device else MIXED)
    assert by_numel[emb.layout.weights_numel + emb._cache.weights_tail][:3] == MIXED


def test_no_row_states_no_change(monkeypatch):
    """sgd (no state) and adam (per-element states only): nothing is moved to the device."""
    monkeypatch.setenv("TBEGEN_CACHE_ROW_STATES", "device")
    for optimizer in ("sgd", "adam"):
        emb, seen = _allocations(monkeypatch, optimizer=optimizer, cache_rows=12)
        assert not emb._row_states_on_device()
        assert all(p[:3] == MIXED for _, p in seen)


@pytest.mark.parametrize("value", ["device", "cached"])
def test_row_states_either_way_train_bitwise_like_device(monkeypatch, value):
    monkeypatch.setenv("TBEGEN_CACHE_ROW_STATES", value)
    data = batches(TABLES, 8, weighted=True)
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    cached = TableBatchedEmbeddingBags(TABLES, placements=MIXED, cache_rows=12, cache_algorithm="lru", **kw)
    assert cached._row_states_on_device() == (value == "device")
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    assert cached.cache_stats()["evictions"] > 0


# ---- on the GPU --------------------------------------------------------------------------------------

BIG = [(4096, 128), (3000, 64), (2048, 256), (1000, 32)]
GPU_MIXED = ["managed_caching", "device", "managed", "managed_caching"]


@cuda
@pytest.mark.parametrize("optimizer,dtype,algorithm,weighted", [
    ("sgd", torch.float32, "lru", False),
    ("rowwise_adagrad", torch.float32, "lfu", True),
    ("adam", torch.float32, "lru", True),
    ("adam", torch.float16, "lfu", False),
])
def test_cuda_cached_tables_train_bitwise_like_device(optimizer, dtype, algorithm, weighted):
    # B = 64 bags of up to 15 rows per feature: at most 960 distinct rows of a table per batch
    data = batches(BIG, 6, B=64, L=8, seed=3, device="cuda", weighted=weighted)
    kw = dict(optimizer=optimizer, weights_dtype=dtype, device="cuda", learning_rate=0.05,
              stochastic_rounding=dtype == torch.float32)  # (fp16: round to nearest, no slot-keyed bits)
    device = TableBatchedEmbeddingBags(BIG, **kw)
    cached = TableBatchedEmbeddingBags(BIG, placements=GPU_MIXED, cache_rows=1000, cache_algorithm=algorithm, **kw)
    train_both(device, cached, data)
    torch.cuda.synchronize()
    assert_same_tables(device, cached)
    stats = cached.cache_stats()
    assert stats["evictions"] > 0 and stats["rows_written_back"] > 0 and 0 < stats["hit_rate"] < 1


@cuda
def test_cuda_buffers_managed_with_a_device_cache_region():
    tables = [(20000, 128), (24000, 64), (30000, 128)]
    emb = TableBatchedEmbeddingBags(tables, optimizer="adam", device="cuda",
                                    placements=["managed_caching", "device", "managed_caching"], cache_rows=8192)
    ops = emb._ops
    full = emb._buffer("weights")
    assert placement.memory_kind(ops, full) == "managed"
    tail = emb.weights.numel()
    assert full.numel() == tail + emb._cache.weights_tail and full.data_ptr() == emb.weights.data_ptr()
    assert emb._cache.weights_tail >= 2 * 8192 * 128
    margin = (2 << 20) // 4
    n0 = 20000 * 128
    got = placement.preferred_locations(ops, full, [(margin, n0 - 2 * margin),
                                                    (n0 + margin, 24000 * 64 - 2 * margin),
                                                    (tail + margin, emb._cache.weights_tail - 2 * margin)])
    assert got == ["host", "device", "device"]
    assert placement.memory_kind(ops, emb._buffer("exp_avg")) == "managed"


def _train_prefetching_ahead(emb, data):
    """Trains with each next batch prefetched between a batch's forward and its backward."""
    emb.prefetch(data[0][0], data[0][1])
    for k, (idx, offsets, psw, grad) in enumerate(data):
        out = emb(idx, offsets, psw)
        if k + 1 < len(data):
            emb.prefetch(data[k + 1][0], data[k + 1][1])
        out.backward(grad)
    return emb


@cuda
@pytest.mark.parametrize("value,kind", [("device", "device"), ("cached", "managed"), ("", "device")])
@pytest.mark.parametrize("backing", ["", "host-huge"])
def test_cuda_row_states_on_the_device_train_bitwise(monkeypatch, value, kind, backing):
    """rowwise_adagrad's momentum of cached tables in GPU memory (TBEGEN_CACHE_ROW_STATES device,
    or auto here: 5096 rows' momentum beside 2 x 1000 slots) or behind the cache: the same bits as
    device placement, with prefetching ahead too; the weights stay host-backed either way."""
    monkeypatch.setenv("TBEGEN_CACHE_ROW_STATES", value)
    monkeypatch.setenv("TBEGEN_CACHE_BACKING", backing)
    tables = [BIG[0], BIG[3]]
    data = batches(tables, 6, B=64, L=8, seed=5, device="cuda", weighted=True)
    kw = dict(optimizer="rowwise_adagrad", device="cuda", learning_rate=0.05)
    device = TableBatchedEmbeddingBags(tables, **kw)
    cached = TableBatchedEmbeddingBags(tables, placements="managed_caching", cache_rows=1000, **kw)
    ahead = TableBatchedEmbeddingBags(tables, placements="managed_caching", cache_rows=1000, **kw)
    ops = cached._ops
    expect = kind if (kind == "device" or backing == "") else "split"
    assert placement.memory_kind(ops, cached._buffer("momentum")) == expect
    assert placement.memory_kind(ops, cached._buffer("weights")) == ("split" if backing else "managed")
    train_both(device, cached, data)
    _train_prefetching_ahead(ahead, data)
    torch.cuda.synchronize()
    assert_same_tables(device, cached)
    assert_same_tables(device, ahead)
    assert cached.cache_stats()["evictions"] > 0


@cuda
def test_cuda_fp16_stochastic_rounding_deterministic_and_prefetch_ahead():
    """fp16 with stochastic rounding: two runs agree bitwise (without prefetching, and with it:
    prefetching changes which slots rows get, hence the bits, so each is compared with its own
    kind); fp32 prefetching ahead trains bitwise like device placement."""
    data = batches(BIG, 6, B=64, L=8, seed=4, device="cuda", weighted=True)
    kw = dict(optimizer="rowwise_adagrad", weights_dtype=torch.float16, device="cuda", learning_rate=0.05)
    def make(**extra):
        return TableBatchedEmbeddingBags(BIG, placements=GPU_MIXED, cache_rows=1000, **dict(kw, **extra))

    assert_same_tables(train(make(), data), train(make(), data))
    assert_same_tables(_train_prefetching_ahead(make(), data), _train_prefetching_ahead(make(), data))
    torch.cuda.synchronize()
    device = train(TableBatchedEmbeddingBags(BIG, **dict(kw, weights_dtype=torch.float32)), data)
    assert_same_tables(device, _train_prefetching_ahead(make(weights_dtype=torch.float32), data))


@cuda
def test_cuda_state_dict_and_moves():
    data = batches(BIG, 5, B=32, L=4, seed=5, device="cuda")
    kw = dict(optimizer="adam", device="cuda", learning_rate=0.05)
    cached = train(TableBatchedEmbeddingBags(BIG, placements=GPU_MIXED, cache_rows=600, **kw), data[:2])
    buf = io.BytesIO()
    torch.save(cached.state_dict(), buf)
    reference = train(TableBatchedEmbeddingBags(BIG, **kw), data)
    buf.seek(0)
    target = TableBatchedEmbeddingBags(BIG, seed=3, **kw)
    target.load_state_dict(torch.load(buf))
    assert_same_tables(reference, train(target, data[2:]))
    cached.cpu()
    cached.cuda()
    assert placement.memory_kind(cached._ops, cached._buffer("weights")) == "managed"
    assert cached._cache.device.type == "cuda"
    assert_same_tables(reference, train(cached, data[2:]))


@cuda
def test_cuda_fbgemm_managed_caching_location():
    specs = [(4096, 128, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA),
             (3000, 64, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)]
    kw = dict(optimizer="EXACT_ROWWISE_ADAGRAD", learning_rate=0.1, device="cuda")
    cached = SplitTableBatchedEmbeddingBagsCodegen(specs, cache_load_factor=0.25, cache_algorithm=CacheAlgorithm.LFU, **kw)
    device = SplitTableBatchedEmbeddingBagsCodegen([(E, D, EmbeddingLocation.DEVICE, c) for E, D, _, c in specs], **kw)
    assert cached.tbe.placements == ("managed_caching", "device")
    assert cached.cache_stats()["cache_rows"] == {0: 1024} and cached.cache_stats()["algorithm"] == "lfu"
    tables = [(E, D) for E, D, _, _ in specs]
    for idx, offsets, _, grad in batches(tables, 4, B=16, L=4, seed=4, device="cuda"):
        cached.prefetch(idx, offsets)
        cached(idx, offsets).backward(grad)
        device(idx, offsets).backward(grad)
    sd = cached.state_dict()
    assert "weights_uvm" in sd
    assert sd["weights_placements"].tolist() == [EmbeddingLocation.MANAGED_CACHING.value, EmbeddingLocation.MANAGED.value]
    assert_same_tables(cached.tbe, device.tbe)
    device.load_state_dict(sd)
    assert_same_tables(cached.tbe, device.tbe)
