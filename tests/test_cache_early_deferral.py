"""Issue 27: a prefetch that the held rule would defer is deferred before its lookup (RowCache.prepare,
_too_short). C2 at a 10% cache (landing12, H100): a batch's distinct rows fit a table's slots, two
batches' do not, so in TorchRec's order (forward i, prefetch i + 1, backward i) every prefetch was
deferred after its whole lookup and host wait, and its forward looked the batch up again: two
lookups and two host waits a step. Scaled down here (4 tables x 10000 rows, 2000 Zipf(1.1) indices
a table a batch: ~690 distinct rows beside a held batch's ~690, ~1145 in all, for 1000 slots) on
the CPU: lookups and host waits (tbegen._sync_audit) a step 2 -> ~1, training bit for bit that of
the in-step order and of the cache without the prediction; at a cache twice that size nothing is
deferred, and every prefetch is taken. The tests of the deferral pin TBEGEN_CACHE_PREFETCH_WARM=0
(`deferring`): with LRU the warm is the default, and it replaces the early deferral
(tests/test_cache_prefetch_warm.py)."""

from __future__ import annotations

import pytest
import torch

from tbegen._sync_audit import SyncAudit
from tbegen.module import TableBatchedEmbeddingBags

TABLES = [(10_000, 8)] * 4
B, L = 100, 20  # (2000 indices a table a batch)
SHORT, ROOMY = 1000, 2000  # cache slots a table: "10%" (two batches do not fit) and "20%"
STEPS = 30
KW = dict(optimizer="rowwise_adagrad", learning_rate=0.05, placements="managed_caching", cache_algorithm="lru")


@pytest.fixture(scope="module", autouse=True)
def built(prebuilt):
    TableBatchedEmbeddingBags([(4, 4)], optimizer="rowwise_adagrad")


@pytest.fixture
def deferring(monkeypatch):
    """The early deferral, without the warm: TBEGEN_CACHE_PREFETCH_WARM=0 when the caches are made.
    The early deferral is the LFU default and the way back from LRU's default, the warm, which
    replaces it (RowCache._prefetch_warm_on); KW's LRU caches would otherwise warm instead."""
    monkeypatch.setenv("TBEGEN_CACHE_PREFETCH_WARM", "0")


def zipf_batches(steps, seed=0, sizes=None):
    """`steps` batches [indices, offsets, grad] of B bags of L rows a table (or sizes[k] bags for
    batch k), each table's rows Zipf(1.1) by rank over a fixed random permutation of its rows."""
    gen = torch.Generator().manual_seed(seed)
    E = TABLES[0][0]
    cdf = torch.cumsum(torch.arange(1, E + 1, dtype=torch.float64).pow(-1.1), 0)
    cdf /= cdf[-1].item()
    perm = torch.stack([torch.randperm(E, generator=gen) for _ in TABLES])
    out = []
    for k in range(steps):
        b = B if sizes is None else sizes[k]
        u = torch.rand((len(TABLES), b * L), dtype=torch.float64, generator=gen)
        rows = torch.gather(perm, 1, torch.searchsorted(cdf, u).clamp_(max=E - 1))
        offsets = torch.arange(len(TABLES) * b + 1, dtype=torch.int64) * L
        grad = torch.randn(b, sum(D for _, D in TABLES), generator=gen)
        out.append((rows.reshape(-1).contiguous(), offsets, grad))
    return out


def train(emb, data, pipelined, audit=None, after_from=None):
    """Trains on `data`; `pipelined`: TorchRec's order, the next batch prefetched between a batch's
    forward and its backward (from step `after_from` on, after its backward: no batch held). Returns
    the outputs and, per prefetch of batches 1.., whether it was looked up (a sort of its keys)."""
    sorts = []
    sort = emb._cache._sort_keys
    emb._cache._sort_keys = lambda keys: sorts.append(1) or sort(keys)
    outs, looked = [], []
    if pipelined:
        emb.prefetch(data[0][0], data[0][1])
    for k, (idx, offsets, grad) in enumerate(data):
        if audit is not None:
            audit.mark(f"step {k}")
        out = emb(idx, offsets)
        after = after_from is not None and k >= after_from
        if after:
            out.backward(grad)
        if pipelined and k + 1 < len(data):
            before = len(sorts)
            emb.prefetch(data[k + 1][0], data[k + 1][1])
            looked.append(len(sorts) > before)
        if not after:
            out.backward(grad)
        outs.append(out.detach())
    emb._cache._sort_keys = sort
    emb.lookups = len(sorts)
    return outs, looked


def assert_same(a, b):
    (ea, oa), (eb, ob) = a, b
    assert all(torch.equal(x, y) for x, y in zip(oa, ob))
    for x, y in zip(ea.split_embedding_weights(), eb.split_embedding_weights()):
        assert torch.equal(x, y)
    for x, y in zip(ea.split_optimizer_states(), eb.split_optimizer_states()):
        for name in x:
            assert torch.equal(x[name], y[name]), name


def no_prediction(emb):
    emb._cache._too_short = lambda n: False  # (every prefetch looked up, as before the prediction)
    return emb


def test_prefetches_too_short_for_two_batches_skip_their_lookups(deferring):
    """"10%": every prefetch beside a held batch is deferred, with the prediction and without; with
    it, the 2nd, 3rd, 4th... consecutive large-shortfall deferral skips the next 1, 2, 4, 8, 8
    prefetches' lookups (the others are probes); lookups and host waits a step 2 -> ~1; the same bits
    as without it and as in-step."""
    data = zipf_batches(STEPS)
    in_step = TableBatchedEmbeddingBags(TABLES, cache_rows=SHORT, **KW)
    in_step_outs, _ = train(in_step, data, pipelined=False)
    runs = {}
    for predict in (True, False):
        emb = TableBatchedEmbeddingBags(TABLES, cache_rows=SHORT, **KW)
        if not predict:
            no_prediction(emb)
        with SyncAudit() as audit:
            outs, looked = train(emb, data, pipelined=True, audit=audit)
        waits = sum(1 for e in audit.events if "tbegen/cache.py:" in e.site)
        runs[predict] = (emb, outs, looked, waits, emb.cache_stats())
    emb, outs, looked, waits, stats = runs[True]
    old_emb, old_outs, old_looked, old_waits, old_stats = runs[False]
    assert_same((emb, outs), (old_emb, old_outs))
    assert_same((emb, outs), (in_step, in_step_outs))
    # every prefetch beside a held batch deferred (its forward looked the batch up), either way
    assert stats["deferred"] == old_stats["deferred"] == STEPS - 1 and stats["backing_rows"] == 0
    assert stats["prepares"] == old_stats["prepares"] == STEPS
    assert old_looked == [True] * (STEPS - 1) and old_stats["deferred_early"] == 0
    probes = [k for k, x in enumerate(looked) if x]
    assert probes == [0, 1, 3, 6, 11, 20], looked  # (skips between them: 1, 2, 4, 8, 8)
    assert stats["deferred_early"] == STEPS - 1 - len(probes)
    # lookups and host waits a step (STEPS steps: the first prefetch, STEPS forwards, the probes)
    assert old_emb.lookups == 1 + 2 * (STEPS - 1) and old_waits == old_emb.lookups
    assert emb.lookups == 1 + (STEPS - 1) + len(probes) and waits == emb.lookups
    assert old_waits / STEPS > 1.9 and waits / STEPS < 1.25


def test_prefetches_that_fit_are_taken():
    """"20%": two batches fit: nothing deferred, every prefetch taken (one lookup a step), the same
    bits as in-step."""
    data = zipf_batches(12)
    in_step = TableBatchedEmbeddingBags(TABLES, cache_rows=ROOMY, **KW)
    in_step_outs, _ = train(in_step, data, pipelined=False)
    emb = TableBatchedEmbeddingBags(TABLES, cache_rows=ROOMY, **KW)
    outs, looked = train(emb, data, pipelined=True)
    assert_same((emb, outs), (in_step, in_step_outs))
    stats = emb.cache_stats()
    assert stats["deferred"] == stats["deferred_early"] == 0 and stats["evictions"] > 0
    assert looked == [True] * 11 and emb.lookups == stats["prepares"] == 12


@pytest.mark.parametrize("change", ["smaller batches", "no batch held"])
def test_a_change_ends_the_skips_at_once(deferring, change):
    """A run of skips (prefetches 0, 1, 3 looked up, 2 and 4, 5 skipped, 6..9 to skip), then from
    batch 9 on either batches of a tenth the bags (the first small one's prefetch, beside a large
    held batch, is looked up: its fewer indices leave too little of the shortfall predicted) or
    each prefetch issued after its batch's backward (no batch held: the held rule cannot defer it):
    each of those prefetches looked up and taken, where the skips left would have deferred them;
    the same bits as without the prediction."""
    small = change == "smaller batches"
    sizes = [B] * 9 + [B // 10 if small else B] * 8
    data = zipf_batches(len(sizes), seed=3, sizes=sizes)
    after_from = None if small else 8  # (from batch 8's backward on: batch 9's prefetch after it)
    emb = TableBatchedEmbeddingBags(TABLES, cache_rows=SHORT, **KW)
    outs, looked = train(emb, data, pipelined=True, after_from=after_from)
    old = no_prediction(TableBatchedEmbeddingBags(TABLES, cache_rows=SHORT, **KW))
    old_outs, old_looked = train(old, data, pipelined=True, after_from=after_from)
    assert_same((emb, outs), (old, old_outs))
    stats, old_stats = emb.cache_stats(), old.cache_stats()
    assert old_stats["deferred"] == stats["deferred"] == 8  # (the large batches' prefetches beside one held)
    assert [k for k, x in enumerate(looked[:8]) if x] == [0, 1, 3, 6] and stats["deferred_early"] == 4
    assert looked[8:] == [True] * 8 and old_looked == [True] * 16  # (batches 9..16's prefetches: taken)
    assert emb.lookups == old.lookups - stats["deferred_early"]


def test_the_shortfall_is_large_from_twice_its_deviation():
    """s * s >= 8 * (C + s): from 899 slots short of 100k (C2 at 10%: 1449 on average), 94 of 1000,
    and never for a table of 16 slots short of less than all of them (TorchRec's test pipeline)."""
    emb = TableBatchedEmbeddingBags([(100_000, 4), (10_000, 4), (160, 4)], cache_rows=[100_000, 1000, 16], **KW)
    large = emb._cache._large_short
    assert [large(0, s) for s in (898, 899, 1449)] == [False, True, True]
    assert [large(1, s) for s in (93, 94)] == [False, True]
    assert not any(large(2, s) for s in range(-1, 16)) and large(2, 16)
    assert not large(1, 0) and not large(1, -5000)


def test_the_backoff_stays_constant_time_however_long_the_run():
    """A cache too small for two batches defers every prefetch for the whole training, so the run
    of large-shortfall deferrals (a probe every 9th prefetch) never ends: the skips stay 1, 2, 4, 8,
    8, ... and the count behind them stays bounded (it was the run's length, shifted: 1 << (run - 2),
    an integer of run bits per probe, ~50 us a probe after 10^6 probes, ms after 10^7)."""
    cache = TableBatchedEmbeddingBags(TABLES, cache_rows=SHORT, **KW)._cache
    assert cache._large_short(0, 100)
    skips = []
    for _ in range(200):
        cache._note_short([100, 0, 0, 0], [700, 0, 0, 0], B * L * len(TABLES))
        skips.append(cache._short_skips)
    assert skips[:6] == [0, 1, 2, 4, 8, 8] and set(skips[4:]) == {cache._SHORT_SKIPS_MAX}
    assert cache._short_run <= 8, cache._short_run
    cache._note_short([0, 0, 0, 0], [700, 0, 0, 0], B * L * len(TABLES))  # (a prefetch short by little: the end)
    assert cache._short_run == cache._short_skips == 0 and cache._short_seen is None
