"""The row cache's sort of a batch's keys through `_sort_keys` on CUDA (templates/include/tbegen/
cache_sort_cuda.cuh; tbegen/cache.py RowCache._sort_keys): only the bits a key can have, and int32
positions, instead of torch.sort's full-width sort with int64 positions; the same stable order.

On the CPU the operator does not exist (it is CUDA's), so the cache's use of it is checked with a
stand-in of its contract (torch.sort's order, the positions as int32, every key inside end_bit):
cached training must stay bitwise that of device placement, with bad indices of direct and compact
tables among the batches (the positions then also mark the indices the kernels skip). The `cuda`
tests check the operator against torch.sort and cached training with it against without.
"""

from __future__ import annotations

import pytest
import torch

from tbegen.module import TableBatchedEmbeddingBags

from test_cache import COMPACT_TABLES, MIXED, TABLES, assert_same_tables, bad_index_batches, train, train_both
from test_row_copy import CACHED_CASES, cached_pair, train_switch_both_ways

cuda = pytest.mark.cuda


def sort_keys_reference(keys, end_bit, calls=None):
    """_sort_keys's contract in torch: torch.sort(keys, stable=True), the positions as int32; every
    key in [0, 2^end_bit)."""
    assert keys.dim() == 1 and keys.dtype in (torch.int32, torch.int64)
    assert 1 <= end_bit <= 8 * keys.element_size() - 1
    if keys.numel():
        assert int(keys.min()) >= 0 and int(keys.max()) < 2 ** end_bit, (int(keys.max()), end_bit)
    if calls is not None:
        calls.append((keys.dtype, end_bit, keys.numel()))
    sorted_keys, perm = torch.sort(keys, stable=True)
    return sorted_keys, perm.to(torch.int32)


def with_key_sort(module, op):
    """The module's cache sorting its keys through `op` (what it does on CUDA unless
    TBEGEN_CACHE_KEY_SORT=0), reading the bits its largest key has."""
    cache = module._cache
    cache._key_sort_op = op
    cache._key_sort_bits = (cache.num_rows + 2).bit_length()
    return module


@pytest.mark.parametrize("optimizer,algorithm,dtype", CACHED_CASES)
def test_cache_sorts_its_keys_through_the_operator_and_trains_like_device(optimizer, algorithm, dtype):
    data, device, cached = cached_pair(optimizer, algorithm, dtype)
    calls = []
    with_key_sort(cached, lambda keys, end_bit: sort_keys_reference(keys, end_bit, calls))
    train_both(device, cached, data)
    assert_same_tables(device, cached)
    assert calls and all(bits == (cached._cache.num_rows + 2).bit_length() for _, bits, _ in calls)
    assert cached.cache_stats()["evictions"] > 0


def test_bad_indices_through_the_operator_like_device():
    """Out-of-range indices of direct and compact cached tables (bounds_check_mode "warn"): their
    sorted positions (int32 from the operator) mark the ones the kernels skip, as with device
    placement."""
    kw = dict(optimizer="sgd", bounds_check_mode="warn", learning_rate=0.5)
    for tables in (TABLES, COMPACT_TABLES):
        data = bad_index_batches(tables)
        with pytest.warns(RuntimeWarning, match="skipped"):
            device = train(TableBatchedEmbeddingBags(tables, **kw), data)
        cached = with_key_sort(TableBatchedEmbeddingBags(tables, placements=MIXED, cache_rows=12, **kw),
                               sort_keys_reference)
        with pytest.warns(RuntimeWarning, match="skipped"):
            train(cached, data)
        assert_same_tables(device, cached)


def test_a_wrong_sort_is_caught():
    """The tests above fail with a stand-in whose positions do not match its sorted keys (the
    first and the last swapped: different keys where a batch reads two rows or more). (Equal keys'
    positions in another order would not change a result: an index's slot follows its key's rank.)"""
    def swapped(keys, end_bit):
        sorted_keys, perm = sort_keys_reference(keys, end_bit)
        perm = perm.clone()
        if perm.numel() > 1:
            perm[[0, -1]] = perm[[-1, 0]]
        return sorted_keys, perm

    data, device, cached = cached_pair("sgd", "lru", torch.float32)
    with_key_sort(cached, swapped)
    with pytest.raises((AssertionError, RuntimeError)):  # (other tables or a slot out of a table's range)
        train_both(device, cached, data)
        assert_same_tables(device, cached)


def test_off_on_the_cpu(monkeypatch):
    monkeypatch.setenv("TBEGEN_CACHE_KEY_SORT", "1")
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)
    assert emb._cache._key_sort_bits == 0  # (no such operator in a CPU build, and a CPU device)


@pytest.mark.parametrize("value", ["yes", "2", "on"])
def test_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("TBEGEN_CACHE_KEY_SORT", value)
    with pytest.raises(ValueError, match="TBEGEN_CACHE_KEY_SORT"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=MIXED, cache_rows=12)


# ---- on a GPU ------------------------------------------------------------------------------------


def _ops():
    return TableBatchedEmbeddingBags([(4, 4)], optimizer="sgd", device="cuda")._ops


@cuda
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,end_bit", [(0, 5), (1, 5), (3000, 9), (100_003, 17), (1_000_000, 25), (2_000_000, 31)])
def test_cuda_sort_keys_matches_torch_sort(dtype, n, end_bit):
    ops = _ops()
    g = torch.Generator().manual_seed(n + end_bit)
    # (many duplicates: the stability is what the cache relies on; the top keys present)
    keys = torch.randint(0, min(2 ** end_bit, max(1, n // 3)), (n,), generator=g, dtype=torch.int64)
    if n:
        keys[torch.randint(0, n, (min(n, 7),), generator=g)] = 2 ** end_bit - 1
    keys = keys.to(dtype).cuda()
    got_keys, got_perm = ops._sort_keys(keys, end_bit)
    want_keys, want_perm = torch.sort(keys, stable=True)
    assert got_perm.dtype == torch.int32 and got_keys.dtype == dtype
    assert torch.equal(got_keys, want_keys) and torch.equal(got_perm.to(torch.int64), want_perm)


@cuda
def test_cuda_sort_keys_refuses_bad_arguments():
    ops = _ops()
    keys = torch.arange(4, dtype=torch.int32, device="cuda")
    for args, message in [
        ((keys.cpu(), 5), "CUDA device"),
        ((keys.float(), 5), "int32 or int64"),
        ((keys.view(2, 2), 5), "1-D"),
        ((keys, 0), "end_bit"),
        ((keys, 32), "end_bit"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ops._sort_keys(*args)


@cuda
@pytest.mark.parametrize("optimizer,dtype,algorithm", [
    ("sgd", torch.float32, "lru"),
    ("rowwise_adagrad", torch.float16, "lfu"),
])
def test_cuda_cached_training_with_the_key_sort_like_without(monkeypatch, optimizer, dtype, algorithm):
    _, off, on = train_switch_both_ways(monkeypatch, "TBEGEN_CACHE_KEY_SORT", optimizer, dtype, algorithm)
    assert on._cache._key_sort_bits > 0 and off._cache._key_sort_bits == 0
