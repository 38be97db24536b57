"""The row cache's host waits (issue 27, tbegen/cache.py): the per-batch lookup makes the host
wait for the device at most once (one read of the batch's summary), counted on the CPU by
tbegen._sync_audit, and taking the other waits out changed nothing: beside the cache as it was
(tests/_cache_reference.py, frozen), a few hundred batches of Zipf-skewed rows leave the same
cache state, statistics, outputs and trained weights, bit for bit, with LRU and LFU, mixed widths,
direct and compact tables, batches larger than the cache, prefetches ahead (held batches),
forwards without a backward and flushes in between."""

from __future__ import annotations

import inspect

import warnings

import pytest
import torch

import _cache_reference
from tbegen import cache as cache_
from tbegen._sync_audit import SyncAudit
from tbegen.module import TableBatchedEmbeddingBags


@pytest.fixture(scope="module", autouse=True)
def built(prebuilt):
    for name in ("adam", "rowwise_adagrad", "sgd"):
        TableBatchedEmbeddingBags([(4, 4)], optimizer=name)


def _zipf_batches(tables, features, steps, seed, sizes=((4, 2), (8, 3), (32, 4))):
    """`steps` batches [indices, offsets, grad]: per batch a (B, L) from `sizes` (bags of 0..2L-1
    rows), each feature's rows Zipf(1.1)-distributed over its table (row 0 the hottest)."""
    g = torch.Generator().manual_seed(seed)
    probs = [1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.1 for E, _ in tables]
    out = []
    for _ in range(steps):
        B, L = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
        lengths = torch.randint(0, 2 * L, (len(features) * B,), generator=g)
        idx = torch.cat([torch.multinomial(probs[features[k // B]], int(n), replacement=True, generator=g)
                         if int(n) else torch.empty(0, dtype=torch.int64) for k, n in enumerate(lengths)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        grad = torch.randn(B, sum(tables[t][1] for t in features), generator=g)
        out.append((idx, offsets, grad))
    return out


def _with_reference_cache(monkeypatch, *args, **kwargs):
    """A module whose cache is the frozen one from before issue 27."""
    # (the frozen cache moves its rows with torch's kernels only: of the present cache's
    # arguments, it is given those its constructor takes)
    takes = inspect.signature(_cache_reference.RowCache.__init__).parameters

    def frozen(*a, **kw):
        return _cache_reference.RowCache(*a, **{n: v for n, v in kw.items() if n in takes})

    with monkeypatch.context() as m:
        m.setattr(cache_, "RowCache", frozen)
        emb = TableBatchedEmbeddingBags(*args, **kwargs)
    assert isinstance(emb._cache, _cache_reference.RowCache)
    _without_deferral(emb)
    return emb


def _without_deferral(emb):
    """The module's prefetches never deferred (the frozen cache predates the deferral, and takes no
    `defer`, nor the prefetch's `readers_wait` and `rows_wait`, stream waits, nothing on the CPU): so
    that the old and the new algorithm face the same decisions."""
    prepare = emb._cache.prepare
    emb._cache.prepare = lambda *a, defer=False, readers_wait=None, rows_wait=None, aside=None, **kw: prepare(*a, **kw)
    return emb


def _assert_same_cache(new, old):
    a, b = new._cache, old._cache
    for name in ("_row_slot", "_slot_row", "_last_used", "_dirty") + (("_counts",) if a.algorithm == "lfu" else ()):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.tick, a.epoch, a.hard_epoch) == (b.tick, b.epoch, b.hard_epoch)
    assert [t.slots.tolist() for t in a._held] == [t.slots.tolist() for t in b._held]
    stats = new.cache_stats()
    # (the frozen cache predates the deferral and the warm, TBEGEN_CACHE_PREFETCH_WARM)
    assert stats.pop("deferred") == stats.pop("deferred_early") == stats.pop("warmed") == stats.pop("rows_warmed") == 0
    assert stats == old.cache_stats()
    # the host's own count of each table's resident rows (what lets _fill skip a wait)
    occupied = [int(((a._slot_row >= 0) & (a._slot_table == k)).sum()) for k in range(len(a.tables))]
    assert a._occupied == occupied


# (tables, features (table of each feature), placements, cache_rows): a wide table before a large
# narrow one makes table 0 "compact" (its overflowing batches bypass it); table 3 is read by two
# features; the batches of 32 bags overflow the caches of 16 and 24 rows
TABLES = [(60, 64), (3000, 4), (400, 8), (500, 16)]
FEATURES = [0, 1, 2, 3, 3]
PLACEMENTS = ["managed_caching", "device", "managed_caching", "managed_caching"]


@pytest.mark.parametrize("optimizer,algorithm,cache_rows,seed,device_type", [
    ("adam", "lru", [16, None, 24, 48], 1, "cpu"),
    ("rowwise_adagrad", "lfu", [16, None, 24, 48], 2, "cpu"),
    ("sgd", "lru", [60, None, 400, 500], 3, "cpu"),  # (caches as large as their tables: nothing evicted)
    ("rowwise_adagrad", "lru", [40, None, 90, 120], 4, "cpu"),
    pytest.param("rowwise_adagrad", "lfu", [16, None, 24, 48], 2, "cuda", marks=pytest.mark.cuda),
    pytest.param("adam", "lru", [40, None, 90, 120], 4, "cuda", marks=pytest.mark.cuda),
])
def test_same_cache_state_and_training_as_before(monkeypatch, optimizer, algorithm, cache_rows, seed, device_type):
    data = [[t.to(device_type) for t in batch] for batch in _zipf_batches(TABLES, FEATURES, 240, seed)]
    kw = dict(optimizer=optimizer, learning_rate=0.05, feature_table_map=FEATURES, device=device_type)
    cached = dict(kw, placements=PLACEMENTS, cache_rows=cache_rows, cache_algorithm=algorithm)
    device = TableBatchedEmbeddingBags(TABLES, **kw)
    new = _without_deferral(TableBatchedEmbeddingBags(TABLES, **cached))
    old = _with_reference_cache(monkeypatch, TABLES, **cached)
    assert not all(new._cache.direct) and any(new._cache.direct)
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the overflow warnings)
        for k, (idx, offsets, grad) in enumerate(data):
            mode = int(torch.randint(6, (1,), generator=g))
            if mode == 0:  # a forward without a backward
                with torch.no_grad():
                    outs = [m(idx, offsets) for m in (new, old)]
                assert torch.equal(outs[0], outs[1])
            else:
                outs = [m(idx, offsets) for m in (device, new, old)]
                assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
                if mode <= 3 and k + 1 < len(data):  # the next batch prefetched while this one trains
                    for m in (new, old):
                        m.prefetch(data[k + 1][0], data[k + 1][1])
                for out in outs:
                    out.backward(grad)
            if k % 60 == 59:
                new.flush()
                old.flush()
            _assert_same_cache(new, old)
    stats = new.cache_stats()
    assert stats["prepares"] > len(data) / 2 and stats["rows_loaded"] > 0
    if cache_rows[0] < 60:
        assert stats["evictions"] > 0 and stats["rows_written_back"] > 0
        assert stats["bypasses"] > 0 and stats["backing_rows"] > stats["bypasses"]
    else:
        assert stats["evictions"] == 0 and stats["backing_rows"] == 0
    for m in (new, old):
        m.flush()
    for x, y, z in zip(device.split_embedding_weights(), new.split_embedding_weights(), old.split_embedding_weights()):
        assert torch.equal(x, y) and torch.equal(y, z)
    for x, y in zip(device.split_optimizer_states(), new.split_optimizer_states()):
        for name in x:
            assert torch.equal(x[name], y[name]), name


# ---- at most one host wait per batch --------------------------------------------------------------

MAX_WAITS_PER_PREPARE = 1  # (the read of the batch's summary; was 16-22, 39 pipelined: NOTES-gpu.md)


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_batch_waits_at_most_once(algorithm, pipelined, device_type):
    """Batches that fit in the caches (hits, misses, evictions of dirty rows, two widths, a table
    read by two features): the lookup waits once per batch, the backward never; with the next
    batch prefetched while one trains, the prefetch waits once and the forward and backward not
    at all. On a GPU, torch's own sync debug mode counts the same waits."""
    tables = [(3000, 8), (2000, 16), (1000, 4)]
    features = [0, 1, 2, 2]
    emb = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", feature_table_map=features,
                                    placements="managed_caching", cache_rows=160, cache_algorithm=algorithm,
                                    device=device_type)
    data = [[t.to(device_type) for t in batch]
            for batch in _zipf_batches(tables, features, 31, seed=5, sizes=((8, 3),))]  # (at most 40 rows a table)
    for idx, offsets, grad in data[:10]:
        emb(idx, offsets).backward(grad)
    before = emb.cache_stats()
    if pipelined:
        emb.prefetch(data[10][0], data[10][1])
    with SyncAudit() as audit:
        for k in range(10, 30):
            idx, offsets, grad = data[k]
            audit.mark(f"forward {k}")
            out = emb(idx, offsets)
            if pipelined:
                audit.mark(f"prefetch {k + 1}")
                emb.prefetch(data[k + 1][0], data[k + 1][1])
            audit.mark(f"backward {k}")
            out.backward(grad)
    after = emb.cache_stats()
    assert after["evictions"] > before["evictions"] and after["rows_written_back"] > before["rows_written_back"]
    assert after["backing_rows"] == 0 and after["hits"] > before["hits"]
    mine = [e for e in audit.events if "tbegen/cache.py:" in e.site]
    if device_type == "cpu":  # (on a GPU the module's own D2H copies, if any, are the next check's)
        assert len(mine) == audit.count, audit.report()
    for name, events in audit.sections.items():
        waits = 0 if name.startswith("backward") or (pipelined and name.startswith("forward")) else MAX_WAITS_PER_PREPARE
        events = [e for e in events if "tbegen/cache.py:" in e.site]
        assert len(events) <= waits, (name, audit.report(events))
    assert len(mine) == 20 * MAX_WAITS_PER_PREPARE  # (one per batch: the audit sees them)
    assert after["prepares"] - before["prepares"] == 20 + pipelined
    if device_type == "cuda":  # torch's own count, beside the same steps without a cache
        plain = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", feature_table_map=features,
                                          device=device_type)
        if pipelined:
            emb.prefetch(data[10][0], data[10][1])
        cached_syncs = _torch_syncs(emb, data[10:31], pipelined)
        plain_syncs = _torch_syncs(plain, data[10:31], False)
        assert len(cached_syncs) - len(plain_syncs) <= 20 * MAX_WAITS_PER_PREPARE, cached_syncs[:5]


def _torch_syncs(emb, data, pipelined):
    """The warnings of torch's sync debug mode (one per synchronizing CUDA call) over training
    steps on data[:-1] (with pipelined, each next batch prefetched between forward and backward)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for k in range(len(data) - 1):
                idx, offsets, grad = data[k]
                out = emb(idx, offsets)
                if pipelined:
                    emb.prefetch(data[k + 1][0], data[k + 1][1])
                out.backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_an_overflowing_compact_table_waits_twice(algorithm):
    """A batch with more distinct rows of a compact table than its slots: the table is written
    back and emptied without a wait, and the summary read again without its indices (two waits);
    its backward, which empties the table again, none."""
    tables = [(60, 64), (3000, 4), (400, 8)]
    emb = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", learning_rate=0.05,
                                    placements=["managed_caching", "device", "managed_caching"],
                                    cache_rows=[16, None, 200], cache_algorithm=algorithm)
    assert emb._cache.direct == [False, True]
    data = _zipf_batches(tables, [0, 1, 2], 8, seed=7, sizes=((32, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for idx, offsets, grad in data[:3]:
            emb(idx, offsets).backward(grad)
        before = emb.cache_stats()
        with SyncAudit() as audit:
            for k, (idx, offsets, grad) in enumerate(data[3:]):
                audit.mark(f"forward {k}")
                out = emb(idx, offsets)
                audit.mark(f"backward {k}")
                out.backward(grad)
    after = emb.cache_stats()
    assert after["bypasses"] - before["bypasses"] == 5 and after["rows_loaded"] > before["rows_loaded"]
    for name, events in audit.sections.items():
        assert len(events) <= (0 if name.startswith("backward") else 2), (name, audit.report(events))
