"""Issue 27, the LRU default (TBEGEN_CACHE_PREFETCH_WARM: unset or empty, on for LRU and off for LFU;
"1" on, "0" off; RowCache._prefetch_warm_on / _warm_part): a prefetch
that the held rule would defer for want of slots (a cache too small for two batches: C2 at a 10%
cache) warms the cache with the part of its missing rows that fits (per table its first missing
rows in key order, up to the slots that neither its hits nor a held batch use) instead of changing
nothing; its forward looks the batch up as after a deferral and finds those rows resident. Scaled
down as tests/test_cache_early_deferral.py (4 tables x 10000 rows, 2000 Zipf(1.1) indices a table a
batch, 1000 slots: ~690 distinct rows a batch beside a held batch's ~690), TorchRec's order on the
CPU: bit for bit the device placement's training (fp32, LRU and LFU, weighted); each warm loads
exactly min(missing, free-able slots) rows a table, the first in key order, which the forward
counts as hits and does not load again; no held slot changes its row; the default per algorithm,
the switch overriding it both ways; a bad value is refused."""

from __future__ import annotations

import pytest
import torch

from test_cache_early_deferral import B, L, SHORT, STEPS, TABLES, zipf_batches
from tbegen.module import TableBatchedEmbeddingBags

SWITCH = "TBEGEN_CACHE_PREFETCH_WARM"
KW = dict(optimizer="rowwise_adagrad", learning_rate=0.05)


@pytest.fixture(scope="module", autouse=True)
def built(prebuilt):
    TableBatchedEmbeddingBags([(4, 4)], optimizer="rowwise_adagrad")


def make(monkeypatch, warm, device="cpu", **kw):
    """A module of TABLES, cached (cache_rows=SHORT unless given) with the switch `warm` ("1", "0",
    or None: unset) when the cache is made, or on the device placement (warm "device")."""
    if warm == "device":
        return TableBatchedEmbeddingBags(TABLES, device=device, **KW)
    with monkeypatch.context() as m:
        if warm is None:
            m.delenv(SWITCH, raising=False)
        else:
            m.setenv(SWITCH, warm)
        kw = {**dict(cache_rows=SHORT, cache_algorithm="lru"), **kw}
        return TableBatchedEmbeddingBags(TABLES, device=device, placements="managed_caching", **KW, **kw)


def weights_for(data, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(idx.numel(), generator=gen) + 0.5 for idx, _, _ in data]


def train(emb, data, weights=None, stream=None, before_prefetch=None, after_prefetch=None):
    """TorchRec's order (the next batch prefetched between a batch's forward and its backward; on
    `stream` where given, the forward and backward on the current one); returns the outputs.
    before_prefetch(k) / after_prefetch(k) are called around the prefetch of batch k."""
    dev = emb._registered("weights").device
    data = [(i.to(dev), o.to(dev), g.to(dev)) for i, o, g in data]
    weights = None if weights is None else [w.to(dev) for w in weights]

    def prefetch(k):
        if before_prefetch is not None:
            before_prefetch(k)
        if stream is None:
            emb.prefetch(data[k][0], data[k][1])
        else:
            with torch.cuda.stream(stream):
                emb.prefetch(data[k][0], data[k][1], forward_stream=torch.cuda.current_stream())
        if after_prefetch is not None:
            after_prefetch(k)

    outs = []
    if emb._cache is not None:
        prefetch(0)
    for k, (idx, offsets, grad) in enumerate(data):
        out = emb(idx, offsets, None if weights is None else weights[k])
        if emb._cache is not None and k + 1 < len(data):
            prefetch(k + 1)
        out.backward(grad)
        outs.append(out.detach().cpu())
    return outs


def assert_same(a, b):
    (ea, oa), (eb, ob) = a, b
    assert all(torch.equal(x, y) for x, y in zip(oa, ob))
    for x, y in zip(ea.split_embedding_weights(), eb.split_embedding_weights()):
        assert torch.equal(x.cpu(), y.cpu())
    for x, y in zip(ea.split_optimizer_states(), eb.split_optimizer_states()):
        for name in x:
            assert torch.equal(x[name].cpu(), y[name].cpu()), name


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("weighted", [False, True])
def test_warming_prefetches_train_like_the_device_placement(monkeypatch, algorithm, weighted):
    """Every prefetch beside the held batch warms (none is deferred whole, none before its lookup),
    each batch is looked up once (by its forward: no backward looks its batch up again, so no held
    row moved), and the training is bit for bit the device placement's and the deferral's (the
    switch "0")."""
    data = zipf_batches(STEPS, seed=1)
    weights = weights_for(data) if weighted else None
    device = make(monkeypatch, "device")
    want = train(device, data, weights)
    emb = make(monkeypatch, "1", cache_algorithm=algorithm)
    got = train(emb, data, weights)
    assert_same((emb, got), (device, want))
    # (against the deferral without the warm: "0", the LFU default and the way back from LRU's)
    off = make(monkeypatch, "0", cache_algorithm=algorithm)
    assert_same((emb, got), (off, train(off, data, weights)))
    stats, old = emb.cache_stats(), off.cache_stats()
    assert stats["warmed"] == stats["deferred"] == STEPS - 1 and stats["deferred_early"] == 0
    assert stats["prepares"] == old["prepares"] == STEPS
    assert stats["rows_warmed"] > 0.5 * (stats["rows_loaded"] - len(TABLES) * SHORT)
    if algorithm == "lru":
        # (LRU: the same rows loaded, by the warms or the forwards, and the warmed ones are the
        # forwards' hits. LFU's warm chooses its victims while the held batch's rows, recent but
        # rarely read, are protected, and keeps fewer of the often read rows: more loads here)
        assert stats["rows_loaded"] == old["rows_loaded"] and stats["evictions"] == old["evictions"]
        assert stats["unique_hits"] == old["unique_hits"] + stats["rows_warmed"]
    assert old["warmed"] == old["rows_warmed"] == 0 and old["deferred_early"] > 0


class Watch:
    """Around each prefetch of a module: per table, the batch's distinct rows, those resident, the
    slots held for other batches (tickets) and what they hold; then what the prefetch changed."""

    def __init__(self, emb, data):
        self.emb, self.cache, self.data = emb, emb._cache, data
        self.seen = []

    def rows(self, k):
        """Per table, batch k's distinct rows (global row keys)."""
        idx = self.data[k][0].view(len(TABLES), B * L)
        return [torch.unique(idx[t]) + self.cache._host["rbase"][t] for t in range(len(TABLES))]

    def before(self, k):
        c = self.cache
        held = torch.cat([t.slots for t in c._held]) if c._held else torch.empty(0, dtype=torch.int64)
        self.state = dict(k=k, held=held, held_rows=c._slot_row[held].clone(), tickets=list(c._held),
                          resident=[(c._row_slot[r] >= 0) for r in self.rows(k)], stats=dict(c.stats))

    def after(self, k):
        c, s = self.cache, self.state
        assert torch.equal(c._slot_row[s["held"]], s["held_rows"]), k  # (no held slot changed its row)
        assert all(c.valid(t) for t in s["tickets"]), k
        warmed = []
        for t, (rows, was) in enumerate(zip(self.rows(k), s["resident"])):
            now = c._row_slot[rows] >= 0
            assert not (was & ~now).any(), (k, t)  # (the batch's hits stay)
            missing = rows[~was]  # (ascending: torch.unique sorts)
            new = rows[now & ~was]
            # the first missing rows in key order, as many as the slots neither hits nor held take
            sb, C = c._host["sbase"][t], SHORT
            hit_slots = set((c._row_slot[rows[was]].long() + sb).tolist())
            held = set(x for x in s["held"].tolist() if sb <= x < sb + C)
            room = C - len(hit_slots | held)
            assert torch.equal(new, missing[:max(0, min(missing.numel(), room))]), (k, t)
            warmed.append(new.numel())
        self.seen.append((k, warmed, sum(int(x.sum()) for x in s["resident"]),
                          sum(r.numel() for r in self.rows(k)),
                          c.stats["evictions"] - s["stats"]["evictions"],
                          c.stats["rows_warmed"] - s["stats"]["rows_warmed"]))


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_warmed_rows_are_the_forwards_hits_and_held_rows_stay(monkeypatch, algorithm):
    """Each warm loads, per table, exactly the batch's first missing rows in key order, as many as
    the slots that neither its hits nor the held batch use (the slots of the held batch keep their
    rows, its ticket stays valid), evicting other rows; the forward then counts the batch's hits
    then plus the warmed rows as hits and loads only the rest."""
    data = zipf_batches(12, seed=2)
    emb = make(monkeypatch, "1", cache_algorithm=algorithm)
    watch = Watch(emb, data)
    forwards = []

    def before(k):
        if k > 1:  # (the forward of batch k - 1, the one after the previous prefetch: what it counted)
            forwards.append({n: emb._cache.stats[n] - before.stats[n] for n in ("unique_hits", "rows_loaded")})
        watch.before(k)

    def after(k):
        watch.after(k)
        before.stats = dict(emb._cache.stats)

    train(emb, data, before_prefetch=before, after_prefetch=after)
    assert emb.cache_stats()["warmed"] == len(data) - 1
    for (k, warmed, hits, distinct, evicted, counted), forward in zip(watch.seen[1:], forwards):
        assert counted == sum(warmed) > 0, k
        assert all(w < distinct for w in warmed)
        # (between the warm and the forward only the backward before, on its valid ticket: no move)
        assert forward == dict(unique_hits=hits + sum(warmed), rows_loaded=distinct - hits - sum(warmed)), k
    assert all(seen[4] > 0 for seen in watch.seen[3:])  # (once the cache is full, each warm evicts)


def _warms(monkeypatch, value, algorithm, data):
    """(warmed, rows_warmed, deferred, deferred_early) of a module made with the switch `value`
    (None: unset) and `algorithm`, trained on `data` in TorchRec's order."""
    emb = make(monkeypatch, value, cache_algorithm=algorithm)
    train(emb, data)
    stats = emb.cache_stats()
    return stats["warmed"], stats["rows_warmed"], stats["deferred"], stats["deferred_early"]


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_the_default_warms_with_lru_and_defers_with_lfu(monkeypatch, algorithm):
    """Unset or empty: LRU warms every prefetch that does not fit (none deferred before its lookup),
    LFU defers it whole, the early deferral skipping lookups (with LFU the warm would load more rows
    in all: its victims are chosen while the held batch's recent, rarely read rows are protected)."""
    data = zipf_batches(10, seed=4)
    for value in (None, ""):
        warmed, rows, deferred, early = _warms(monkeypatch, value, algorithm, data)
        assert deferred == 9, value
        if algorithm == "lru":
            assert warmed == 9 and rows > 0 and early == 0, value
        else:
            assert warmed == rows == 0 and early > 0, value


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_the_switch_overrides_the_default_both_ways(monkeypatch, algorithm):
    """"0": deferred whole, the early deferral skipping lookups (the way back from LRU's default);
    "1": every prefetch that does not fit warms, LFU's too."""
    data = zipf_batches(10, seed=4)
    warmed, rows, deferred, early = _warms(monkeypatch, "0", algorithm, data)
    assert warmed == rows == 0 and deferred == 9 and early > 0
    warmed, rows, deferred, early = _warms(monkeypatch, "1", algorithm, data)
    assert warmed == deferred == 9 and rows > 0 and early == 0


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_a_bad_value_is_refused(monkeypatch, algorithm):
    """Anything but unset, empty, "0" or "1" is refused when the cache is made, named, whatever
    the algorithm's default."""
    for bad in ("2", "yes", "on", "off", " 1", "true"):
        with pytest.raises(ValueError, match=f"TBEGEN_CACHE_PREFETCH_WARM must be 0 or 1 \\(or unset\\), got '{bad}'"):
            make(monkeypatch, bad, cache_algorithm=algorithm)


def test_a_batch_read_in_place_still_defers_without_a_warm(monkeypatch):
    """500 slots for ~690 distinct rows a batch: every batch reads rows in their backing rows, so
    a prefetch beside it is deferred before its lookup (any move would make that batch's backward
    look it up again), with the switch on as well: nothing warmed; bits the device placement's."""
    data = zipf_batches(8, seed=6)
    device = make(monkeypatch, "device")
    want = train(device, data)
    emb = make(monkeypatch, "1", cache_rows=500)
    got = train(emb, data)
    assert_same((emb, got), (device, want))
    stats = emb.cache_stats()
    assert stats["backing_rows"] > 0 and stats["deferred"] == stats["deferred_early"] == 7
    assert stats["warmed"] == stats["rows_warmed"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("algorithm,slow", [("lru", False), ("lfu", False), ("lru", True)])
def test_cuda_warming_prefetches_on_a_side_stream_train_like_the_device_placement(monkeypatch, algorithm, slow):
    """The CUDA twin of the first test: TorchRec's order with the prefetches on a stream of their
    own (the warm's exchange on the cache's exchange stream; the forward's own lookup waits for
    the other streams' bookkeeping only, its kernels for the rest: module._lookup_beside): bit for
    bit the device placement's training, every prefetch warmed, each batch looked up once. `slow`:
    the exchange stream held back (torch.cuda._sleep, ~50 ms) before each exchange, so that a
    forward whose kernels did not wait for the warm's rows would read slots not yet loaded."""
    from tbegen import cache as cache_

    if slow:
        launch = cache_.RowCache._launch_aside

        def held_back(self, launches, rows_wait=None):
            if self._aside_stream is None:
                self._aside_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._aside_stream):
                torch.cuda._sleep(100_000_000)
            return launch(self, launches, rows_wait)

        monkeypatch.setattr(cache_.RowCache, "_launch_aside", held_back)
    data = zipf_batches(12 if slow else STEPS, seed=1)
    weights = weights_for(data)
    device = make(monkeypatch, "device", device="cuda")
    want = train(device, data, weights)
    emb = make(monkeypatch, "1", device="cuda", cache_algorithm=algorithm)
    assert emb._cache._aside  # (the default on CUDA: TBEGEN_CACHE_LOOKUP_STREAM on)
    got = train(emb, data, weights, stream=torch.cuda.Stream())
    torch.cuda.synchronize()
    assert_same((emb, got), (device, want))
    stats = emb.cache_stats()
    assert stats["warmed"] == len(data) - 1 and stats["rows_warmed"] > 0 and stats["prepares"] == len(data)


@pytest.mark.parametrize("seed", range(4))
def test_warms_leave_the_slots_of_uses_that_do_not_wait_untouched(monkeypatch, seed):
    """test_prefetch_pipeline's check of the stream rule (_touches_of_unwaited_uses: TorchRec's and
    FBGEMM's orders, 1-5 batches prefetched ahead, holds let go at random, small caches) with the
    switch on: no forward given its prefetched batch, no valid ticket's backward and no reading
    forward finds a slot of its batch loaded, evicted or dropped by a warm since, and warms happen."""
    from tbegen import cache as cache_
    from test_prefetch_pipeline import _touches_of_unwaited_uses

    warms = []
    warm_part = cache_.RowCache._warm_part

    def counted(self, *a, **k):
        before = self.stats["rows_warmed"]
        warm_part(self, *a, **k)
        warms.append(self.stats["rows_warmed"] - before)

    monkeypatch.setattr(cache_.RowCache, "_warm_part", counted)
    monkeypatch.setenv(SWITCH, "1")
    found, checked = _touches_of_unwaited_uses(monkeypatch, seed)
    assert checked[0] > 0 and checked[1] > 0
    assert found == [], found[:5]
    assert sum(1 for w in warms if w) >= 3, warms


class _Order:
    """Stands in for the module's _CacheStreams (module._CacheStreams): logs each call, in host order."""

    def __init__(self, log):
        self.log = log

    def enter(self, device, wait=True, lookup=False):
        self.log.append(("enter", wait, lookup))

    def leave(self, device, lookup=False, read=False):
        self.log.append(("leave", lookup, read))

    def wait_all(self, device):
        self.log.append(("wait_all",))

    def wait_for(self, point, device):
        self.log.append(("wait_for",))

    def wait_rows(self, stream, device):
        self.log.append(("wait_rows",))

    def moved(self, device, stream, event):
        self.log.append(("moved",))

    def mark(self, device):
        self.log.append(("mark",))


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_forwards_own_lookup_waits_as_a_prefetchs_with_the_switch(monkeypatch, warm):
    """With the switch and the exchange aside (TBEGEN_CACHE_LOOKUP_STREAM on; forced here, the CPU
    has no exchange stream), a forward that looks its batch up itself (its prefetch warmed the
    cache) waits for the other streams' bookkeeping only (wait="marks", as a prefetch's lookup),
    passes the prefetch's readers_wait and rows_wait and its fill's exchange aside, marks its end
    (leave), and only then waits for every other stream's latest use (wait_all), before its kernels
    (module._lookup_beside): the warm's exchange overlaps this lookup and the next prefetch's. With
    the switch off: the deferral's lookup, which waits for every other stream first."""
    from tbegen import _ranges

    data = zipf_batches(6, seed=8)
    emb = make(monkeypatch, warm)
    emb._cache._aside = True
    log = []
    emb._cache_order = _Order(log)
    prepare = emb._cache.prepare

    def logged(*a, **k):
        log.append(("prepare", k.get("defer"), k.get("aside"), k.get("readers_wait") is not None,
                    k.get("rows_wait") is not None))
        return prepare(*a, **k)

    emb._cache.prepare = logged
    remove = _ranges.listen(lambda name, how: log.append((how, name)) if name == "tbegen.forward" else None)
    was_on = _ranges.enabled()
    _ranges.enable(True)
    try:
        train(emb, data)
    finally:
        remove()
        _ranges.enable(was_on)
    # the forwards of batches 1..5, each after its prefetch (warmed or deferred), look their batch up
    starts = [k for k, e in enumerate(log) if e == ("begin", "tbegen.forward")]
    assert len(starts) == len(data)
    lookups = []
    for s in starts[1:]:
        k = max(k for k in range(s) if log[k][0] == "enter")
        lookups.append(log[k:s])
    if warm == "1":
        assert emb.cache_stats()["warmed"] == len(data) - 1
        want = [("enter", "marks", True), ("prepare", False, True, True, True), ("leave", True, False), ("wait_all",)]
    else:
        want = [("enter", True, True), ("prepare", False, False, False, False), ("leave", True, False)]
    assert lookups == [want] * (len(data) - 1), lookups[0]
