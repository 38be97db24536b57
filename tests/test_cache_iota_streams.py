"""RowCache._iota's kept 0, 1, 2, ... tensor across CUDA streams (review of issue 27's lookup).

The lookup keeps one arange per dtype and grows it when a batch needs more. The tensor it drops
may still be read by kernels queued on the current stream (since its last host wait), and the
caching allocator hands a block out again on the stream that *allocated* it without waiting for
any other stream. An iota made by a prefetch on a side stream and dropped by a lookup on the
forward's stream could thus be overwritten by the side stream's next allocation before the
forward stream's kernels read it. The dropped tensor is recorded as used by the current stream.
"""

from __future__ import annotations

import pytest
import torch

from tbegen.module import TableBatchedEmbeddingBags

cuda = pytest.mark.cuda


def _cache(device="cpu"):
    emb = TableBatchedEmbeddingBags([(1000, 4), (500, 8)], optimizer="sgd", device=device,
                                    placements="managed_caching", cache_rows=100)
    cache = emb._cache
    cache._iotas = {}
    return cache


def test_iota_views_count_from_start():
    cache = _cache()
    assert torch.equal(cache._iota(5, start=2), torch.arange(2, 7))
    assert torch.equal(cache._iota(3, torch.int32, 1), torch.arange(1, 4, dtype=torch.int32))
    big = cache._iota(5000, start=7)
    assert big.numel() == 5000 and int(big[0]) == 7 and int(big[-1]) == 5006


class _DeviceIota:
    """Stands in for a kept CUDA iota (the CPU has none): records the streams it is recorded on."""

    is_cuda = True

    def __init__(self, n):
        self.n = n
        self.recorded = []

    def numel(self):
        return self.n

    def record_stream(self, stream):
        self.recorded.append(stream)

    def __getitem__(self, key):
        return self


def test_a_grown_iota_records_the_dropped_one_on_the_current_stream(monkeypatch):
    cache = _cache()
    old = _DeviceIota(1024)
    cache._iotas[torch.int64] = old
    marker = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: marker)
    cache._iota(1024)  # (fits: nothing dropped, nothing recorded)
    assert old.recorded == []
    cache._iota(2000)  # grown: the dropped tensor is recorded as used by this stream
    assert old.recorded == [marker]
    assert cache._iotas[torch.int64] is not old


@cuda
def test_cuda_a_dropped_iota_is_not_handed_out_on_its_stream_while_this_one_reads_it():
    """The iota made on a side stream; the current stream reads it behind a long kernel, then a
    lookup there grows it; an allocation of the same size on the side stream, written at once,
    must not get its memory before the current stream's read ran."""
    cache = _cache("cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        first = cache._iota(4096)
    ptr = first.data_ptr()
    del first
    cur = torch.cuda.current_stream()
    cur.wait_stream(side)
    torch.cuda._sleep(300_000_000)  # (the current stream busy for ~0.2 s)
    total = cache._iota(4096).sum()  # a read queued behind it
    cache._iota(8192)  # grown: the old one dropped while that read is still queued
    with torch.cuda.stream(side):
        other = torch.empty(4096, dtype=torch.int64, device="cuda")
        other.fill_(-1)
    torch.cuda.synchronize()
    # the read saw the iota's values, not the side stream's -1s (landing9, H100: the allocator did
    # hand the side stream a block at the old iota's address, and the read was still right: which
    # block the allocator picks is its own affair; what the cache needs is this read's values)
    assert int(total) == 4095 * 4096 // 2
    assert ptr != 0
