"""prefetch as TorchRec's prefetch pipeline calls it (issues 25 and 27).

TorchRec's PrefetchTrainPipelineSparseDist calls the sharded collection's `prefetch` for batch
i + 1 on its prefetch stream between the forward and the backward of batch i; its lookup hands
each group's features to the kernel's module with FBGEMM's keywords (`forward_stream`, and
`batch_size_per_feature_per_rank` for a variable batch). Here:

- the module's prefetch takes those arguments (bad ones named), and a variable batch (VBE) it
  prefetched is taken by the VBE forward of the same tensors and sizes;
- FBGEMM's class passes them through;
- TorchRec (one gloo rank; the pipeline itself cannot run on the CPU: it prefetches only with a
  data-dist stream, and then its forward refuses to run) with FUSED_UVM_CACHING tables, in
  several groups (prefetch_pipeline=True: TorchRec then groups cached tables per width, and splits
  each batch's features into new KJTs for the prefetch and again for the forward): the sharded
  collection driven in the pipeline's order trains bit for bit as without prefetching, and every
  forward takes its prefetched batch;
- on CUDA (marker `cuda`): prefetches on a side stream (torch.cuda.Stream), in TorchRec's and in
  FBGEMM's order, train bit for bit as in-step lookups, also when the stream of the cache's last
  user is held back (torch.cuda._sleep), and add no host wait.
"""

from __future__ import annotations

import os
import random
import time
import warnings

import pytest

import torch

from tbegen import TableBatchedEmbeddingBags
from tbegen._sync_audit import SyncAudit

TABLES = [(120, 8), (30, 16), (150, 4)]
FEATURES = [0, 1, 2, 0]
LR = 0.05


@pytest.fixture(scope="module", autouse=True)
def built(prebuilt):
    TableBatchedEmbeddingBags([(4, 4)], optimizer="adam")


def _module(device="cpu", **kw):
    kw.setdefault("placements", ["managed_caching", "device", "managed_caching"])
    # (room for two batches' rows, never for all of them: evictions, and no hold is let go)
    kw.setdefault("cache_rows", [34, None, 40])
    return TableBatchedEmbeddingBags(TABLES, optimizer="adam", learning_rate=LR, feature_table_map=FEATURES,
                                     device=device, **kw)


def _vbe_batches(steps, seed, device="cpu", R=2):
    """`steps` variable batches (indices, offsets, batch_size_per_feature_per_rank, grad): feature f
    has B[f][r] bags on rank r (0-2), bags of 0-2 rows; grad is the 1-D VBE output's gradient."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sizes = torch.randint(0, 3, (len(FEATURES), R), generator=g).tolist()
        idx, lengths, n_out = [], [], 0
        for f, per_rank in enumerate(sizes):
            E, D = TABLES[FEATURES[f]]
            n = sum(per_rank)
            ln = torch.randint(0, 3, (n,), generator=g)
            lengths.append(ln)
            idx.append(torch.randint(0, E, (int(ln.sum()),), generator=g))
            n_out += n * D
        lengths = torch.cat(lengths)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        grad = torch.randn(n_out, generator=g)
        out.append((torch.cat(idx).to(device), offsets.to(device), sizes, grad.to(device)))
    return out


def _train_vbe(emb, data, prefetch):
    """Trains on `data`; with `prefetch`, batch k + 1 is prefetched between the forward and the
    backward of batch k (TorchRec's order), each forward given its own copy of the sizes."""
    outs = []
    if prefetch:
        emb.prefetch(data[0][0], data[0][1], batch_size_per_feature_per_rank=data[0][2])
    for k, (idx, offsets, sizes, grad) in enumerate(data):
        out = emb(idx, offsets, batch_size_per_feature_per_rank=[list(s) for s in sizes])
        if prefetch and k + 1 < len(data):
            emb.prefetch(data[k + 1][0], data[k + 1][1], batch_size_per_feature_per_rank=data[k + 1][2])
        out.backward(grad)
        outs.append(out.detach().clone())
    emb.flush()
    return outs


def _count_takes(emb):
    """A list that gets, for each forward of `emb` with cached tables, whether it took a
    prefetched batch (instead of looking its batch up itself)."""
    takes = []
    take = emb._take_prefetched

    def counted(*args, **kwargs):
        ticket = take(*args, **kwargs)
        takes.append(ticket is not None)
        return ticket

    emb._take_prefetched = counted
    return takes


def _same_training(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert torch.equal(a[1].weights.detach(), b[1].weights.detach())
    for name, state in a[1].states.named_buffers():
        assert torch.equal(state, getattr(b[1].states, name)), name


def test_vbe_prefetch_is_taken_by_the_vbe_forward():
    """A variable batch prefetched ahead (between the forward and the backward of the batch
    before, the caches small enough for evictions) is the one its VBE forward uses: one lookup per
    batch, and the training is bit for bit the training without prefetching."""
    data = _vbe_batches(20, seed=3)
    plain = _module()
    fetched = _module()
    takes = _count_takes(fetched)
    a = (_train_vbe(plain, data, prefetch=False), plain)
    b = (_train_vbe(fetched, data, prefetch=True), fetched)
    _same_training(a, b)
    assert fetched.cache_stats()["evictions"] > 0
    assert takes == [True] * len(data)  # (each forward took its prefetch)
    assert fetched._prefetched == []


def test_vbe_prefetch_is_not_taken_by_another_batch():
    """A VBE prefetch belongs to its tensors and sizes: a forward with other sizes (the same
    number of bags), or a fixed-batch forward, looks its batch up itself, with the right result."""
    emb, ref = _module(), _module()
    idx = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    offsets = torch.tensor([0, 2, 3, 5, 6, 7, 8, 10])  # 7 bags
    sizes, other = [[1, 1], [1, 1], [1, 1], [0, 1]], [[1, 1], [1, 1], [0, 1], [1, 1]]
    emb.prefetch(idx, offsets, batch_size_per_feature_per_rank=sizes)
    got = emb(idx, offsets, batch_size_per_feature_per_rank=other)
    assert torch.equal(got, ref(idx, offsets, batch_size_per_feature_per_rank=other))
    assert emb.cache_stats()["prepares"] == 2 and len(emb._prefetched) == 1  # (still there for its own forward)
    emb.prefetch(idx, offsets[:5], batch_size_per_feature_per_rank=[[1, 0], [1, 0], [1, 0], [1, 0]])
    plain = torch.tensor([0, 2, 3, 5, 6])  # (a fixed batch of 1, not the prefetched tensors)
    assert torch.equal(emb(idx[:6], plain), ref(idx[:6], plain))
    assert emb.cache_stats()["prepares"] == 4


def test_prefetch_arguments_are_checked_and_named():
    emb = _module()
    idx, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4])
    with pytest.raises(TypeError, match="forward_stream must be a torch.cuda.Stream or None, got str"):
        emb.prefetch(idx, offsets, forward_stream="cuda")
    with pytest.raises(ValueError, match="forward_stream is a stream of cpu but the module's weights are on cpu"):
        emb.prefetch(idx, offsets, forward_stream=torch.Stream(device="cpu"))
    with pytest.raises(ValueError, match=r"batch_size_per_feature_per_rank must be a list with one list .* \(4\)"):
        emb.prefetch(idx, offsets, batch_size_per_feature_per_rank=[[1], [1]])
    with pytest.raises(ValueError, match=r"batch_size_per_feature_per_rank\[1\]\[0\] must be a non-negative int"):
        emb.prefetch(idx, offsets, batch_size_per_feature_per_rank=[[1], [-1], [1], [1]])
    with pytest.raises(ValueError, match=r"with batch_size_per_feature_per_rank, offsets must be 1-D with .* = 6 entries"):
        emb.prefetch(idx, offsets, batch_size_per_feature_per_rank=[[2], [1], [1], [1]])
    assert emb.cache_stats()["prepares"] == 0 and emb._prefetched == []
    # without cached tables: checked all the same, nothing kept
    dev = _module(placements="device", cache_rows=None)
    with pytest.raises(TypeError, match="forward_stream must be"):
        dev.prefetch(idx, offsets, forward_stream=1)
    dev.prefetch(idx, offsets, forward_stream=None, batch_size_per_feature_per_rank=[[1], [1], [1], [1]])
    assert dev._prefetched == []


def _fake_cuda_streams(monkeypatch):
    """torch.cuda.current_stream and torch.cuda.Event replaced by stand-ins: returns (log, current):
    `log` collects (stream, what, event) entries, `current["s"]` is the stream current_stream
    returns; events are named e0, e1, ... in the order they are made."""
    log, events, current = [], [], {}

    class FakeEvent:
        def __init__(self):
            self.name = f"e{len(events)}"
            events.append(self)

        def record(self, stream):
            log.append((stream.name, "records", self.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["s"])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return log, current


def test_cache_streams_forget_the_oldest_past_eight(monkeypatch):
    """A loop that makes a new stream for each prefetch: the rule remembers at most 8 streams (else
    every use would wait for every stream ever seen); the stream forgotten is first waited for by
    the current one, and a later settling use waits for all the current stream queued, which
    covers it."""
    from tbegen.module import _CacheStreams

    log, current = _fake_cuda_streams(monkeypatch)
    cuda = torch.device("cuda", 0)
    order = _CacheStreams()
    D = _FakeStream("D", log)
    streams = [_FakeStream(f"S{k}", log) for k in range(12)]
    for k, side in enumerate(streams):
        current["s"] = D  # a flush on the main stream (a settling use)
        order.enter(cuda)
        order.leave(cuda)
        current["s"] = side  # the next batch's prefetch on a new stream
        del log[:]
        order.enter(cuda, lookup=True)
        order.leave(cuda, lookup=True)
        assert len(order.last) <= _CacheStreams._MAX_STREAMS and set(order.settling) <= set(order.last)
        waited = [entry[2] for entry in log if entry[0] == side.name and "waits" in entry[1]]
        # it waits for every stream remembered, and for the one it makes the rule forget
        assert len(waited) == min(k + 1, _CacheStreams._MAX_STREAMS) + (k + 2 > _CacheStreams._MAX_STREAMS)
    assert D not in order.last or streams[0] not in order.last  # (the first seen were forgotten)
    # a backward's settling wait after the forgetting: waits for all the latest stream queued
    del log[:]
    current["s"] = D
    order.enter(cuda, wait="settling")
    assert ("D", "waits for stream", "S11") in log


class _FakeStream:
    """Stands in for a torch.cuda.Stream: records what it was made to wait for."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append((self.name, "waits for event", event.name))

    def wait_stream(self, stream):
        self.log.append((self.name, "waits for stream", stream.name))


def test_cache_stream_rule_on_fake_streams(monkeypatch):
    """The ordering rule (module._CacheStreams) with stand-in CUDA streams and events, in TorchRec's
    prefetch pipeline's order (forward i, prefetch i + 1 on a side stream, backward i): a lookup
    (enter) waits for the latest use on every other stream (for the stream itself until a second
    stream has been seen, then for the event recorded after that use); a forward waits only for
    the prefetch of its batch (wait_for); a backward of a valid ticket waits for nothing (so the
    next batch's prefetch runs beside it); a prefetch waits for the latest lookup or settling use
    of every other stream, not for a forward's kernels reading held slots (so it runs beside the
    forward of the batch before too); a use that recorded no end is waited for as a stream."""
    from tbegen.module import _CacheStreams

    log, current = _fake_cuda_streams(monkeypatch)
    D, S = _FakeStream("D", log), _FakeStream("S", log)
    cuda = torch.device("cuda", 0)
    order = _CacheStreams()

    def lookup(stream, leave=True):  # (a forward's own lookup)
        current["s"] = stream
        order.enter(cuda, lookup=True)
        return order.leave(cuda, lookup=True) if leave else None

    def prefetch(stream):  # (RowCache.prepare with defer: its lookup leaves held slots alone)
        current["s"] = stream
        order.enter(cuda, wait="changes", lookup=True)
        return order.leave(cuda, lookup=True)

    def settle(stream):  # (flush, drop, the statistics)
        current["s"] = stream
        order.enter(cuda)
        return order.leave(cuda)

    def forward(point):  # (a forward given a prefetched batch: its kernels read its held slots)
        current["s"] = D
        order.wait_for(point, cuda)
        return order.leave(cuda, lookup=True, read=True)

    def backward():  # (a valid ticket's backward)
        current["s"] = D
        order.enter(cuda, wait="settling")
        return order.leave(cuda)

    lookup(D)  # forward of batch 0, looking its batch up itself
    backward()
    assert log == []
    p1 = prefetch(S)  # prefetch of batch 1 on a side stream: waits for all D queued (no event yet)
    assert p1[0] is S and log == [("S", "waits for stream", "D"), ("S", "records", "e0")]
    del log[:]
    forward(p1)  # forward of batch 1: waits for its prefetch; its kernels read its held slots
    p2 = prefetch(S)  # prefetch of batch 2 (D's latest change, the backward of batch 0, has no event)
    backward()  # backward of batch 1: does not wait for the prefetch of batch 2
    forward(p2)
    assert log == [("D", "waits for event", "e0"), ("D", "records", "e1"),
                   ("S", "waits for stream", "D"), ("S", "records", "e2"),
                   ("D", "records", "e3"),
                   ("D", "waits for event", "e2"), ("D", "records", "e4")]
    del log[:]
    # the next prefetch waits for the backward of batch 1 (e3), whose rows it may evict and write
    # back, not for the forward of batch 2 (e4), which reads only held slots: the two run together
    prefetch(S)
    assert log == [("S", "waits for event", "e3"), ("S", "records", "e5")]
    del log[:]
    lookup(S)  # a forward's own lookup (it may let the holds go) waits for D's latest use, the read
    assert log == [("S", "waits for event", "e4"), ("S", "records", "e6")]
    del log[:]
    # a flush on a third stream between a forward and its backward: the backward waits for it
    # (a settling use), though not for the prefetch queued after it on S
    X = _FakeStream("X", log)
    settle(X)
    prefetch(S)
    backward()
    assert log == [("X", "waits for event", "e4"), ("X", "waits for event", "e6"), ("X", "records", "e7"),
                   ("S", "waits for event", "e3"), ("S", "waits for event", "e7"), ("S", "records", "e8"),
                   ("D", "waits for event", "e7"), ("D", "records", "e9")]
    del log[:]
    lookup(S, leave=False)  # a use without an end recorded (torch.compile's forward): waited for as a stream
    lookup(D)
    assert log == [("S", "waits for event", "e9"), ("S", "waits for event", "e7"),
                   ("D", "waits for stream", "S"), ("D", "waits for event", "e7"), ("D", "records", "e10")]
    del log[:]
    # a lookup that moves rows whose holds were let go waits for every other stream's latest use
    current["s"] = S
    order.wait_all(cuda)
    assert log == [("S", "waits for event", "e10"), ("S", "waits for event", "e7")]
    # nothing on the CPU, and a copy of a module starts with no use recorded
    order.enter(torch.device("cpu"))
    assert order.leave(torch.device("cpu")) is None and set(order.last) == {D, S, X}
    import copy
    import pickle

    assert copy.deepcopy(order).last == {} and pickle.loads(pickle.dumps(order)).last == {}


def test_every_use_of_the_cache_is_ordered():
    """Where the module applies the rule: a prefetch and a forward's own lookup enter (wait) and
    leave; a forward given its prefetched batch waits for that prefetch only; a backward whose
    ticket is valid enters without waiting, one whose ticket is not (its rows evicted) waits and
    looks its batch up again; flush, drop_cache and cache_stats enter."""
    calls = []

    class Recorder(_OrderRecorder):
        def __init__(self):
            super().__init__(calls)

    emb = _module()
    emb._cache_order = Recorder()
    idx, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4])
    emb.prefetch(idx, offsets)
    assert calls == ["enter after changes lookup", "leave lookup"]  # (not after other streams' reads)
    del calls[:]
    out = emb(idx, offsets)  # (takes the prefetched batch)
    assert calls == ["leave read"]  # (on the CPU the prefetch recorded no point to wait for)
    emb._prefetched.clear()
    del calls[:]
    out.sum().backward()
    assert calls == ["enter after settling uses", "leave"]
    del calls[:]
    out = emb(idx, offsets)  # (looks its batch up itself: the lookup ends before the kernels, which read)
    assert calls == ["enter lookup", "leave lookup", "leave read"]
    del calls[:]
    with torch.no_grad():  # (a batch not held: its kernels' end is a lookup's, which a prefetch waits for)
        emb(idx, offsets)
    assert calls == ["enter lookup", "leave lookup", "leave lookup"]
    del calls[:]
    emb._cache._release_all()  # (its rows no longer held: its ticket lasts only until the next load)
    emb(torch.tensor([100, 25, 140, 110]), offsets)
    del calls[:]
    out.sum().backward()  # (its ticket is no longer valid: looked up again, after the others)
    assert calls == ["enter", "enter", "leave"]
    del calls[:]
    emb.flush()
    emb.cache_stats()
    emb.drop_cache()
    assert calls == ["enter", "leave"] * 3


def test_fbgemm_class_passes_stream_and_vbe_sizes_through(monkeypatch):
    """FBGEMM's prefetch(indices, offsets, forward_stream, batch_size_per_feature_per_rank): handed
    to the module as given (no NotImplementedError for VBE); with bounds_check_mode WARNING the
    indices the module prefetches are those the forward will pass (out-of-range ones zeroed, the
    bags of a variable batch taken as the forward takes them, padded)."""
    from tbegen.fbgemm_compat import BoundsCheckMode, ComputeDevice, EmbeddingLocation, EmbOptimType
    from tbegen.fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen as Compat

    specs = [(E, D, EmbeddingLocation.HOST, ComputeDevice.CPU) for E, D in TABLES[:2]]
    m = Compat(specs, optimizer=EmbOptimType.ADAM, learning_rate=LR, bounds_check_mode=BoundsCheckMode.WARNING)
    seen = []
    monkeypatch.setattr(m._tbe, "prefetch", lambda *a, **k: seen.append((a, k)))
    idx = torch.tensor([1, 200, 3, 29, 30])  # 200 is out of table 0's range, 30 of table 1's
    offsets = torch.tensor([0, 2, 3, 3, 5])  # VBE: feature 0 has 2 + 1 bags, feature 1 has 0 + 1
    sizes = [[2, 1], [0, 1]]
    with pytest.warns(UserWarning, match="out of range"):
        m.prefetch(idx, offsets, forward_stream=None, batch_size_per_feature_per_rank=sizes)
    (args, kwargs), = seen
    assert torch.equal(args[0], torch.tensor([1, 0, 3, 29, 0])) and args[1] is offsets
    assert kwargs == {"forward_stream": None, "batch_size_per_feature_per_rank": sizes}
    stream = object()
    m.prefetch(idx[:1], torch.tensor([0, 1, 1, 1, 1]), forward_stream=stream)
    assert seen[1][1]["forward_stream"] is stream and seen[1][1]["batch_size_per_feature_per_rank"] is None



class _OrderRecorder:
    """A stand-in of module._CacheStreams that records the calls in `calls`."""

    def __init__(self, calls):
        self.calls = calls

    def enter(self, device, wait=True, lookup=False):
        self.calls.append({True: "enter", "changes": "enter after changes", "settling": "enter after settling uses",
                           False: "begin"}[wait] + (" lookup" if lookup else ""))

    def wait_all(self, device):
        self.calls.append("wait_all")

    def wait_for(self, point, device):
        self.calls.append("wait_for")

    def leave(self, device, lookup=False, read=False):
        self.calls.append("leave read" if read else "leave lookup" if lookup else "leave")
        return None


def test_vbe_prefetch_waits_before_its_padding_reads_a_kept_plan(monkeypatch):
    """A VBE prefetch pads the offsets with a kept plan of those sizes, which the last forward of
    the same sizes may have made on its own stream (the plan's kernel still queued there when the
    prefetch is issued on a side stream): the prefetch waits for the cache's last user before the
    padding reads the plan, not only before its lookup. The module's prefetch and FBGEMM's (whose
    WARNING check pads the offsets first)."""
    from tbegen.fbgemm_compat import BoundsCheckMode, ComputeDevice, EmbeddingLocation, EmbOptimType
    from tbegen.fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen as Compat

    idx, offsets, sizes, grad = _vbe_batches(1, seed=5)[0]
    emb = _module()
    emb(idx, offsets, batch_size_per_feature_per_rank=sizes).backward(grad)  # (the plan kept)
    # (FBGEMM's class with CPU tables has no cache: one stands in for its module's, whose prefetch
    # is recorded, not run)
    compat = Compat([(E, D, EmbeddingLocation.HOST, ComputeDevice.CPU) for E, D in TABLES],
                    feature_table_map=FEATURES, optimizer=EmbOptimType.ADAM, learning_rate=LR,
                    bounds_check_mode=BoundsCheckMode.WARNING)
    monkeypatch.setattr(compat._tbe, "_cache", object())
    for module, prefetch in ((emb, emb.prefetch), (compat._tbe, compat.prefetch)):
        calls = []
        module._cache_order = _OrderRecorder(calls)
        pad = module._vbe_pad
        monkeypatch.setattr(module, "_vbe_pad", lambda o, plan, pad=pad, calls=calls: (calls.append("pad"), pad(o, plan))[1])
        if module is compat._tbe:
            monkeypatch.setattr(module, "prefetch", lambda *a, calls=calls, **k: calls.append("prefetch"))
        prefetch(idx, offsets, batch_size_per_feature_per_rank=sizes)
        assert "pad" in calls and calls.index("enter lookup") < calls.index("pad"), calls



def _hot_batches(steps, seed, hot):
    """Batches of the _module tables whose rows are drawn from the first `hot` of each table (a
    small `hot`: batches share rows; a large one: they evict each other)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    B = 4
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(FEATURES) * B,), generator=g)
        idx = torch.cat([torch.randint(0, min(hot, TABLES[FEATURES[k // B]][0]), (int(n),), generator=g)
                         for k, n in enumerate(lengths)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out.append((idx, offsets, torch.randn(B, sum(TABLES[t][1] for t in FEATURES), generator=g)))
    return out


def _touches_of_unwaited_uses(monkeypatch, seed, readers_wait=True, beside=False):
    """For _CacheStreams' uses that do not wait for other streams (a forward given its prefetched
    batch waits only for that prefetch; a valid ticket's backward for nothing): every row load
    into one of the ticket's slots, eviction of one, or table dropped between the making of the
    ticket and that use, in host order (the order the streams' work is issued in), over TorchRec's
    order and FBGEMM's, 1-5 batches prefetched ahead, holds let go at random, caches that overflow
    or not. And for the kernels of a forward of a held batch (a read, which a prefetch does not
    wait for): every such touch of its slots between that forward and its backward, unless a
    `wait_all` (the prefetch waiting for every stream's latest use: holds let go) came between the
    forward and the touch ("forward reads"). `readers_wait=False`: RowCache never calls that
    wait (the check must then fail). `beside`: the exchange aside forced on (as on CUDA, where the
    CPU has no exchange stream), so that with LRU's default, the warm, every forward that looks its
    batch up itself takes module._lookup_beside (its reads begin after that lookup's wait_all).
    Returns (those touches, [forwards checked, backwards checked, forwards' own lookups beside])."""
    from tbegen import cache as cache_
    from tbegen import module as module_

    rnd = random.Random(seed)
    touched = []  # (kind, global slots) of every move and drop, in host order
    move, drop = cache_.RowCache._move, cache_.RowCache.drop
    monkeypatch.setattr(module_._CacheStreams, "wait_all", lambda self, device: touched.append(("waited", None)))
    if not readers_wait:
        monkeypatch.setattr(cache_.RowCache, "_before_unheld_move",
                            lambda self, wait, evicting_held=False: setattr(self, "_unheld", False))

    def logged_move(self, buffers, c, rows, slots, to_slots, staged=None, per_table=None):
        touched.append(("load" if to_slots else "evict", set((self._t["sbase"][c] + slots).tolist())))
        return move(self, buffers, c, rows, slots, to_slots, staged, per_table)

    def logged_drop(self, buffers, tables, readers_wait=None, rows_wait=None):
        hard = self.hard_epoch
        drop(self, buffers, tables, readers_wait, rows_wait)
        if self.hard_epoch != hard:
            touched.append(("drop", None))

    monkeypatch.setattr(cache_.RowCache, "_move", logged_move)
    monkeypatch.setattr(cache_.RowCache, "drop", logged_drop)
    if beside:  # (no exchange stream on the CPU: nothing for a move of rows to wait for, rows_wait's stream none)
        monkeypatch.setattr(cache_.RowCache, "_join_aside", lambda self, rows_wait=None: None)
    found, checked = [], [0, 0, 0]
    for run in range(5):
        ahead, order = rnd.choice([1, 1, 2, 3, 5]), rnd.choice(["torchrec", "fbgemm"])
        kw = {"cache_rows": [rnd.choice([12, 20, 34]), None, rnd.choice([16, 24, 40])]} if rnd.random() < 0.5 else {}
        emb = _module(**kw)
        if beside:
            emb._cache._aside = True
        made, reads = {}, {}
        prepare, take, for_backward = emb._prepare, emb._take_prefetched, emb._ticket_for_backward
        lookup_beside = emb._lookup_beside

        def check(ticket, use):
            slots = set(ticket.slots.tolist())
            found.extend((run, use, kind) for kind, s in touched[made[id(ticket)]:]
                         if kind != "waited" and (s is None or s & slots))

        def made_now(*a, **k):
            ticket = prepare(*a, **k)
            made[id(ticket)] = len(touched)
            if not k and ticket is not None and ticket.slots.numel() and not ticket.backing:
                reads[id(ticket)] = len(touched)  # (a forward's own lookup, its batch then held)
            return ticket

        def looked_up_beside(*a, **k):  # (its reads begin after its own wait_all)
            ticket = lookup_beside(*a, **k)
            checked[2] += 1
            if ticket.slots.numel() and not ticket.backing:
                reads[id(ticket)] = len(touched)
            return ticket

        def taken(*a, **k):
            ticket = take(*a, **k)
            if ticket is not None:
                checked[0] += 1
                check(ticket, "forward")
                if ticket.slots.numel() and not ticket.backing:  # (held by its forward: its kernels a read)
                    reads[id(ticket)] = len(touched)
            return ticket

        def check_reads(ticket):
            slots = set(ticket.slots.tolist())
            for kind, s in touched[reads.pop(id(ticket)):]:
                if kind == "waited":
                    break
                if s is None or s & slots:
                    found.append((run, "forward reads", kind))

        def backward(ticket):
            if id(ticket) in reads:
                check_reads(ticket)
            if emb._cache.valid(ticket) and not ticket.bypass:  # (the backward that waits for nothing)
                checked[1] += 1
                check(ticket, "backward")
            return for_backward(ticket)

        emb._prepare, emb._take_prefetched, emb._ticket_for_backward = made_now, taken, backward
        emb._lookup_beside = looked_up_beside
        data = _hot_batches(16, 100 * seed + run, rnd.choice([40, 80, 150]))
        queued = iter(data)

        def prefetch():
            batch = next(queued, None)
            if batch is not None:
                emb.prefetch(batch[0], batch[1])

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (overflow warnings)
            for _ in range(ahead):
                prefetch()
            for idx, offsets, grad in data:
                out = emb(idx, offsets)
                if order == "torchrec":
                    if rnd.random() < 0.1:
                        emb._cache._release_all()
                    prefetch()
                if rnd.random() < 0.1:
                    emb._cache._release_all()
                out.backward(grad)
                if order == "fbgemm":
                    prefetch()
    return found, checked


@pytest.mark.parametrize("seed", range(8))
def test_uses_that_do_not_wait_find_their_slots_untouched(monkeypatch, seed):
    """What the stream rule rests on: no use that does not wait finds its slots touched since its
    ticket was made (_touches_of_unwaited_uses)."""
    found, checked = _touches_of_unwaited_uses(monkeypatch, seed)
    assert checked[0] > 0 and checked[1] > 0
    assert found == [], found[:5]


def test_unwaited_uses_are_caught_when_held_slots_are_not_protected(monkeypatch):
    """The check above can fail: with no slot protected for the batches in flight (their holds
    ignored by the victim choice), loads and evictions take their slots."""
    from tbegen import cache as cache_

    monkeypatch.setattr(cache_.RowCache, "_held_mask", lambda self: None)
    found, _ = _touches_of_unwaited_uses(monkeypatch, 0)
    assert {use for _, use, _ in found} == {"forward", "backward", "forward reads"}


@pytest.mark.parametrize("seed", range(6))
def test_forwards_own_lookups_beside_find_their_slots_untouched(monkeypatch, seed):
    """The same check with the exchange aside (as on CUDA) and LRU's default, the warm: the
    forwards that look their batch up themselves take module._lookup_beside (waiting, like a
    prefetch, for the other streams' bookkeeping only); no use that does not wait, and no
    reading forward, finds its slots touched."""
    monkeypatch.delenv("TBEGEN_CACHE_PREFETCH_WARM", raising=False)
    found, checked = _touches_of_unwaited_uses(monkeypatch, seed, beside=True)
    assert checked[0] > 0 and checked[1] > 0 and checked[2] > 0, checked
    assert found == [], found[:5]


@pytest.mark.parametrize("seed", [1, 2, 7])
def test_prefetch_waits_for_forward_reads_where_holds_were_let_go(monkeypatch, seed):
    """A prefetch does not wait for the kernels of forwards on other streams that read held
    batches (_CacheStreams: it runs beside the forward of the batch before); where holds were let
    go since (or a drop evicts held slots), RowCache calls the prefetch's `readers_wait` before
    moving rows. test_uses_that_do_not_wait_find_their_slots_untouched checks that no prefetch
    touches a reading forward's slots without that wait; without the call (these seeds: loads,
    evictions and drops), prefetches do."""
    found, _ = _touches_of_unwaited_uses(monkeypatch, seed, readers_wait=False)
    assert "forward reads" in {use for _, use, _ in found}

# ---- TorchRec -----------------------------------------------------------------------------------

RANK_TABLES = [("t0", 100, 8, "fused_uvm_caching"), ("t1", 61, 12, "fused"), ("t2", 150, 16, "fused_uvm_caching"),
               ("t3", 160, 8, "fused_uvm_caching")]
STEPS = 8
LOAD_FACTOR = 0.1  # (10-16 slots a table: room for two batches' rows, 5 bags of 0-1 rows, not for all)


def _rank_kjt(step, vbe):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(50 + step)
    keys, lengths, values, strides = [], [], [], []
    for name, rows, _, _ in RANK_TABLES:
        b = int(torch.randint(1, 6, (1,), generator=gen)) if vbe else 5
        ln = torch.randint(0, 2, (b,), generator=gen)
        keys.append("f_" + name)
        strides.append([b])
        lengths.append(ln)
        values.append(torch.randint(0, rows, (int(ln.sum()),), generator=gen))
    if not vbe:
        return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths).to(torch.int32))
    B = max(s[0] for s in strides)
    inverse = torch.stack([torch.arange(B) % s[0] for s in strides])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths).to(torch.int32),
                             stride_per_key_per_rank=strides, inverse_indices=(keys, inverse))


def _rank_train(vbe, prefetch, lookup_prefetch=None):
    """One gloo rank: an EmbeddingBagCollection sharded table-wise by tbegen's sharder with the
    FUSED_UVM_CACHING kernel forced (the CPU planner does not offer it) and prefetch_pipeline on
    (off for a variable batch);
    STEPS steps, the loss a fixed projection of the pooled output. With `prefetch`, the sharded
    collection is driven as PrefetchTrainPipelineSparseDist drives it: input_dist of batch i + 1,
    forward of batch i (compute_and_output_dist), prefetch of batch i + 1, backward of batch i."""
    import torch.distributed as dist
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import CacheParams, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder

    class Sharder(TbegenEmbeddingBagCollectionSharder):
        def compute_kernels(self, sharding_type, compute_device_type):
            return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM_CACHING.value]

    # (a variable batch over several groups meets TorchRec's preallocated VBE output, which the
    # tbegen kernel refuses: the VBE run keeps its tables in one group)
    sharder = Sharder("adam", learning_rate=LR, fused_params={"prefetch_pipeline": not vbe})
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=E, embedding_dim=D,
                                                            feature_names=["f_" + n]) for n, E, D, _ in RANK_TABLES],
                                 device=torch.device("cpu"))
    plan = construct_module_sharding_plan(ebc, {n: table_wise(rank=0, compute_kernel=k) for n, _, _, k in RANK_TABLES},
                                          local_size=1, world_size=1, device_type="cpu", sharder=sharder)
    for p in plan.values():
        p.cache_params = CacheParams(load_factor=LOAD_FACTOR)
    state = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])
    dmp.load_state_dict(state)
    sebc = next(m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection))
    kernels = [k for lookup in sebc._lookups for k in lookup._emb_modules]
    cached = [k for k in kernels if "managed_caching" in k.emb_module.placements]
    takes = [_count_takes(k.emb_module) for k in cached]
    if lookup_prefetch is not None:  # (the lookup's prefetch replaced, to show what it does)
        for lookup in sebc._lookups:
            lookup.prefetch = lookup_prefetch.__get__(lookup)
    batches = [_rank_kjt(step, vbe) for step in range(STEPS)]

    def input_dist(kjt):
        ctx = sebc.create_context()
        return ctx, sebc.input_dist(ctx, kjt).wait().wait()

    outs = []
    pending = None
    if prefetch:
        pending = input_dist(batches[0])
        sebc.prefetch(dist_input=pending[1], forward_stream=None, ctx=pending[0])
    for step in range(STEPS):
        if prefetch:
            ctx, features = pending
            pending = input_dist(batches[step + 1]) if step + 1 < STEPS else None
            pooled = sebc.compute_and_output_dist(ctx, features).wait()
            if pending is not None:
                sebc.prefetch(dist_input=pending[1], forward_stream=None, ctx=pending[0])
        else:
            pooled = dmp(batches[step])
        values = pooled.values()
        proj = torch.randn(values.shape, generator=torch.Generator().manual_seed(7 + step))
        (values * proj).sum().backward()
        outs.append(values.detach().clone())
    def local(t):  # (a ShardedTensor's one local shard: the whole table on the one rank)
        shards = t.local_shards() if hasattr(t, "local_shards") else None
        return (shards[0].tensor if shards is not None else t).detach().clone()

    weights = {k: local(v) for k, v in dmp.state_dict().items() if k.endswith(".weight")}
    states = {}
    for entry in dmp.fused_optimizer.state_dict()["state"].values():
        states.update({k: local(v) for k, v in entry.items() if torch.is_tensor(v)})
    return dict(outs=outs, weights=weights, states=states, groups=len(kernels), takes=takes,
                left=[len(k.emb_module._prefetched) for k in cached],
                deferred=[k.emb_module.cache_stats()["deferred"] for k in cached],
                evictions=sum(k.emb_module.cache_stats()["evictions"] for k in cached))


def _rank_worker(rank, port, outdir):
    import torch.distributed as dist
    from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        res = {}
        for vbe in (False, True):
            res[vbe, "plain"] = _rank_train(vbe, prefetch=False)
            res[vbe, "prefetch"] = _rank_train(vbe, prefetch=True)
        # TorchRec's own lookup prefetch in front of tbegen's kernels: the module prefetches
        # features.values() / features.offsets() of KJTs split anew, not the forward's tensors
        res["torchrec lookup"] = _rank_train(False, prefetch=True,
                                             lookup_prefetch=GroupedPooledEmbeddingsLookup.prefetch)
        torch.save(res, os.path.join(outdir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def torchrec_results(tmp_path_factory):
    pytest.importorskip("torchrec")
    pytest.importorskip("fbgemm_gpu")
    from ranks import free_port  # (tests/ranks.py)

    outdir = tmp_path_factory.mktemp("prefetch_pipeline")
    torch.multiprocessing.start_processes(_rank_worker, args=(free_port(), str(outdir)), nprocs=1, join=True,
                                          start_method="fork")
    return torch.load(outdir / "rank0.pt", weights_only=False)


@pytest.mark.parametrize("vbe", [False, True], ids=["fixed", "vbe"])
def test_torchrec_prefetch_trains_like_no_prefetch(torchrec_results, vbe):
    plain, fetched = torchrec_results[vbe, "plain"], torchrec_results[vbe, "prefetch"]
    groups = 1 if vbe else 2  # (fixed: cached tables in two groups, per width, beside the fused one)
    assert fetched["groups"] == (1 if vbe else 3) and len(fetched["takes"]) == groups
    assert fetched["evictions"] > 0
    assert all(torch.equal(a, b) for a, b in zip(plain["outs"], fetched["outs"]))
    assert sorted(plain["weights"]) == sorted(fetched["weights"]) and sorted(plain["states"]) == sorted(fetched["states"])
    for k in plain["weights"]:
        assert torch.equal(plain["weights"][k], fetched["weights"][k]), k
    for k in plain["states"]:
        assert torch.equal(plain["states"][k], fetched["states"][k]), k
    # every forward of each cached group took its prefetched batch, but where that prefetch was
    # deferred (a batch in flight had read rows of an overflowing cache in place: docs/placements.md)
    assert [len(t) for t in fetched["takes"]] == [STEPS] * groups and fetched["left"] == [0] * groups
    assert [t.count(False) for t in fetched["takes"]] == fetched["deferred"]
    assert all(sum(t) > STEPS // 2 for t in fetched["takes"])  # (most prefetches were taken)


def test_torchrecs_own_lookup_prefetch_misses_the_forward(torchrec_results):
    """Why the kernel prefetches itself: through TorchRec's lookup prefetch, the module is handed
    tensors the forward never passes, so every forward looks its batch up again (same numbers,
    the prefetched batches left behind)."""
    r, plain = torchrec_results["torchrec lookup"], torchrec_results[False, "plain"]
    assert all(torch.equal(a, b) for a, b in zip(plain["outs"], r["outs"]))
    assert r["takes"] == [[False] * STEPS] * 2 and r["left"] != [0, 0]


def _pipeline_train(device, pipeline):
    """TorchRec's PrefetchTrainPipelineSparseDist itself (CUDA: it prefetches only with streams)
    over the same sharded collection as _rank_train (fixed batches), or plain DMP training."""
    from dataclasses import dataclass

    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist
    from torchrec.distributed.types import CacheParams, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.streamable import Pipelineable

    from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder

    @dataclass
    class Batch(Pipelineable):
        kjt: object
        proj: torch.Tensor

        def to(self, device, non_blocking=False):
            return Batch(self.kjt.to(device, non_blocking=non_blocking), self.proj.to(device, non_blocking=non_blocking))

        def record_stream(self, stream):
            self.kjt.record_stream(stream)
            self.proj.record_stream(stream)

    class Model(torch.nn.Module):
        def __init__(self, ebc):
            super().__init__()
            self.ebc = ebc

        def forward(self, batch):
            values = self.ebc(batch.kjt).values()
            return (values * batch.proj).sum(), values.detach()

    class Sharder(TbegenEmbeddingBagCollectionSharder):
        def compute_kernels(self, sharding_type, compute_device_type):
            return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM_CACHING.value]

    sharder = Sharder("adam", learning_rate=LR, fused_params={"prefetch_pipeline": True})
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=E, embedding_dim=D,
                                                            feature_names=["f_" + n]) for n, E, D, _ in RANK_TABLES],
                                 device=torch.device("cpu"))
    plan = construct_module_sharding_plan(ebc, {n: table_wise(rank=0, compute_kernel=k) for n, _, _, k in RANK_TABLES},
                                          local_size=1, world_size=1, device_type=device.type, sharder=sharder)
    for p in plan.values():
        p.cache_params = CacheParams(load_factor=LOAD_FACTOR)
    model = Model(ebc)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dmp = DistributedModelParallel(model, device=device, plan=ShardingPlan({"ebc": plan}), sharders=[sharder])
    dmp.load_state_dict(state)
    sebc = next(m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection))
    cached = [k for lookup in sebc._lookups for k in lookup._emb_modules if "managed_caching" in k.emb_module.placements]
    takes = [_count_takes(k.emb_module) for k in cached]
    total_D = sum(D for _, _, D, _ in RANK_TABLES)
    batches = [Batch(_rank_kjt(step, False), torch.randn(5, total_D, generator=torch.Generator().manual_seed(7 + step)))
               for step in range(STEPS)]
    outs = []
    if pipeline:
        pipe = PrefetchTrainPipelineSparseDist(dmp, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0),
                                               device)
        it = iter(batches)
        for _ in range(STEPS):
            outs.append(pipe.progress(it).clone())
    else:
        for b in batches:
            loss, values = dmp(b.to(device))
            loss.backward()
            outs.append(values.clone())
    if device.type == "cuda":
        torch.cuda.synchronize()
    weights = {}
    for k, v in dmp.state_dict().items():
        if k.endswith(".weight"):
            shards = v.local_shards() if hasattr(v, "local_shards") else None
            weights[k] = (shards[0].tensor if shards is not None else v).detach().cpu().clone()
    return dict(outs=[o.cpu() for o in outs], weights=weights, takes=takes,
                deferred=[k.emb_module.cache_stats()["deferred"] for k in cached])


def _pipeline_worker(rank, port, outdir):
    import torch.distributed as dist

    from ranks import start_rank  # (tests/ranks.py)

    device = start_rank(0, 1, port, on_gpu=True)
    try:
        res = {"plain": _pipeline_train(device, False), "pipeline": _pipeline_train(device, True)}
        torch.save(res, os.path.join(outdir, "pipeline.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_torchrec_prefetch_pipeline_trains_like_plain_dmp(tmp_path):
    """TorchRec's PrefetchTrainPipelineSparseDist on one NCCL rank, FUSED_UVM_CACHING tables in
    two cached groups (prefetch_pipeline on): its prefetch stream, its forward and backward on
    the default stream; bit for bit the plain DMP training, and every forward took its prefetched
    batch but where the cache deferred that prefetch (counted by cache_stats)."""
    pytest.importorskip("torchrec")
    pytest.importorskip("fbgemm_gpu")
    from ranks import free_port  # (tests/ranks.py)

    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    torch.multiprocessing.start_processes(_pipeline_worker, args=(free_port(), str(tmp_path)), nprocs=1, join=True,
                                          start_method="spawn")
    res = torch.load(tmp_path / "pipeline.pt", weights_only=False)
    plain, piped = res["plain"], res["pipeline"]
    assert len(piped["outs"]) == STEPS and all(torch.equal(a, b) for a, b in zip(plain["outs"], piped["outs"]))
    assert sorted(plain["weights"]) == sorted(piped["weights"])
    for k in plain["weights"]:
        assert torch.equal(plain["weights"][k], piped["weights"][k]), k
    # every forward took its prefetched batch, but where that prefetch was deferred (it did not
    # fit beside the batch in flight: docs/placements.md); the plain run prefetches nothing
    assert len(piped["takes"]) == 2 and [len(t) for t in piped["takes"]] == [STEPS] * 2
    assert [t.count(False) for t in piped["takes"]] == piped["deferred"]
    assert all(sum(t) > STEPS // 2 for t in piped["takes"])  # (most prefetches were taken)


# ---- CUDA: a prefetch on a side stream ----------------------------------------------------------


def _cuda_batches(steps, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    B = 4
    for _ in range(steps):
        lengths = torch.randint(0, 3, (len(FEATURES) * B,), generator=g)
        idx = torch.cat([torch.randint(0, TABLES[FEATURES[k // B]][0], (int(n),), generator=g)
                         for k, n in enumerate(lengths)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        grad = torch.randn(B, sum(TABLES[t][1] for t in FEATURES), generator=g)
        out.append((idx.cuda(), offsets.cuda(), grad.cuda()))
    return out


def _exact_fit_batches(steps, seed):
    """Batches of the exact-fit module below: batch k reads rows 8k..8k+7 (mod 64) of its one
    table, whose cache holds 8 rows, so each batch's rows evict all of the batch before's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        idx = (torch.arange(8) + 8 * k) % 64
        out.append((idx.cuda(), torch.arange(9).cuda(), torch.randn(8, 8, generator=g).cuda()))
    return out


def _cuda_train(emb, data, order, stream=None, sleep=0, audit=None, finish=True):
    """order "in-step": no prefetch; "torchrec": batch k + 1 prefetched between forward and
    backward of batch k; "fbgemm": after the backward of batch k. The prefetches run on `stream`
    (the current one if None). `sleep`: cycles of torch.cuda._sleep queued on the current stream
    before each forward ("torchrec") or backward ("fbgemm"), so that the cache's last user is still
    to run when the next prefetch is queued."""
    def prefetch(k):
        if audit is not None:
            audit.mark(f"prefetch {k}")
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            emb.prefetch(data[k][0], data[k][1], forward_stream=forward if stream is not None else None)

    forward = torch.cuda.current_stream()
    outs = []
    if order != "in-step":
        prefetch(0)
    for k, (idx, offsets, grad) in enumerate(data):
        if audit is not None:
            audit.mark(f"forward {k}")
        if sleep and order == "torchrec":
            torch.cuda._sleep(sleep)
        out = emb(idx, offsets)
        if order == "torchrec" and k + 1 < len(data):
            prefetch(k + 1)
        if audit is not None:
            audit.mark(f"backward {k}")
        if sleep and order == "fbgemm":
            torch.cuda._sleep(sleep)
        out.backward(grad)
        if order == "fbgemm" and k + 1 < len(data):
            prefetch(k + 1)
        outs.append(out.detach().clone())
    if finish:
        emb.flush()
        torch.cuda.synchronize()
    return outs, emb


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["torchrec", "fbgemm"])
def test_cuda_side_stream_prefetch_equals_in_step(order):
    """Prefetches on a torch.cuda.Stream of their own, the forward and backward on the default
    stream: bit for bit the in-step training, and every forward takes its prefetched batch."""
    data = _cuda_batches(10, seed=11)
    want = _cuda_train(_module("cuda"), data, "in-step")
    emb = _module("cuda")
    takes = _count_takes(emb)
    got = _cuda_train(emb, data, order, stream=torch.cuda.Stream())
    _same_training(want, got)
    assert got[1].cache_stats()["evictions"] > 0
    assert takes == [True] * len(data)  # (every forward took its prefetch)


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["torchrec", "fbgemm"])
def test_cuda_side_stream_prefetch_waits_for_the_caches_last_user(order):
    """Each prefetch evicts every row of the batch before (the exact-fit batches), and the
    default stream is held back (torch.cuda._sleep, about 50 ms) before that batch's forward
    (TorchRec's order) or backward (FBGEMM's): a prefetch that did not wait for them on the device
    would move the rows out of their slots before the forward read them, or before the backward
    updated them, and load the next batch's rows there (a different result, every step)."""
    def make():
        return TableBatchedEmbeddingBags([(64, 8)], optimizer="adam", learning_rate=LR, device="cuda",
                                         placements="managed_caching", cache_rows=8)

    data = _exact_fit_batches(8, seed=17)
    want = _cuda_train(make(), data, "in-step")
    got = _cuda_train(make(), data, order, stream=torch.cuda.Stream(), sleep=100_000_000)
    _same_training(want, got)
    assert got[1].cache_stats()["evictions"] >= 8 * (len(data) - 1)


@pytest.mark.cuda
def test_cuda_pipelined_prefetch_does_not_wait_for_the_forward_before():
    """TorchRec's order with the default stream held back (torch.cuda._sleep, ~50 ms) just before
    the forward of batch k, which takes its prefetched batch: the prefetch of batch k + 1 on the
    side stream waits for the backward of batch k - 1 (queued before the sleep), not for that
    forward, so its one host wait (the summary) returns long before the sleep ends; the prefetch
    that waited for the forward (before 2026-12-05) took the whole sleep. The training is bitwise
    that of in-step lookups."""
    data = _cuda_batches(8, seed=23)
    side = torch.cuda.Stream()
    want = _cuda_train(_module("cuda"), data, "in-step")
    emb = _module("cuda")
    _cuda_train(emb, data[:2], "torchrec", stream=side, finish=False)  # (events recorded from here on)
    outs, took = [], []
    with torch.cuda.stream(side):
        emb.prefetch(data[2][0], data[2][1], forward_stream=torch.cuda.current_stream())
    for k in range(2, len(data)):
        idx, offsets, grad = data[k]
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        out = emb(idx, offsets)
        t0 = time.perf_counter()
        if k + 1 < len(data):
            with torch.cuda.stream(side):
                emb.prefetch(data[k + 1][0], data[k + 1][1])
        took.append(time.perf_counter() - t0)
        out.backward(grad)
        outs.append(out.detach().clone())
    torch.cuda.synchronize()
    sleep_s = _sleep_seconds(100_000_000)
    assert emb.cache_stats()["deferred"] == 0
    assert max(took[:-1]) < 0.5 * sleep_s, (took, sleep_s)
    emb.flush()
    _same_training((want[0][2:], want[1]), (outs, emb))


def _sleep_seconds(cycles):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@pytest.mark.cuda
def test_cuda_side_stream_prefetch_adds_no_host_wait():
    """The ordering between the streams is event waits on the device: the prefetch on its own
    stream waits for the host once (its batch's summary, as an in-step lookup), the forward and
    the backward never (tbegen/_sync_audit.py; torch's sync debug mode agrees)."""
    data = _cuda_batches(12, seed=13)
    side = torch.cuda.Stream()
    emb = _module("cuda")
    _cuda_train(emb, data[:2], "in-step")
    with SyncAudit() as audit:
        _cuda_train(emb, data[2:], "torchrec", stream=side, audit=audit, finish=False)
    for name, events in audit.sections.items():
        mine = [e for e in events if "tbegen/cache.py:" in e.site]  # (the module's own, if any: torch's count below)
        allowed = 1 if name.startswith("prefetch") else 0
        assert len(mine) <= allowed, (name, audit.report(mine))
    counts = []
    for order, stream in (("in-step", None), ("torchrec", side)):
        m = _module("cuda")
        _cuda_train(m, data[:2], "in-step")
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _cuda_train(m, data[2:], order, stream=stream, finish=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts[1] <= counts[0], counts


def test_a_plan_made_by_a_prefetch_is_waited_for_on_another_stream(monkeypatch):
    """A VBE plan that a prefetch made on its stream (plan["ready"]): the forward, or FBGEMM's
    padding, on another stream waits for that point before reading the plan; on the same stream
    it does not (stand-in streams and event)."""
    log = []
    S, D = _FakeStream("S", log), _FakeStream("D", log)
    current = {"s": D}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["s"])
    S.device = torch.device("cuda", 0)

    class Event:
        name = "e0"

    class Tensor:  # (records record_stream)
        def __init__(self, name):
            self.name = name

        def record_stream(self, stream):
            log.append((self.name, "recorded on", stream.name))

    plan = {"ready": (S, Event()), "pad": Tensor("pad"), "bag_out": Tensor("bag_out")}
    TableBatchedEmbeddingBags._vbe_plan_ready(plan)
    assert log == [("D", "waits for event", "e0"), ("pad", "recorded on", "D"), ("bag_out", "recorded on", "D")]
    del log[:]
    current["s"] = S
    TableBatchedEmbeddingBags._vbe_plan_ready(plan)
    assert log == []
    # where the module calls it: the VBE forward and vbe_padded_offsets
    emb = _module()
    idx, offsets, sizes, grad = _vbe_batches(1, seed=7)[0]
    waited = []
    monkeypatch.setattr(TableBatchedEmbeddingBags, "_vbe_plan_ready", staticmethod(lambda p: waited.append(p)))
    emb(idx, offsets, batch_size_per_feature_per_rank=sizes)  # (a plan made by the forward: no mark)
    assert waited == []
    plan = next(iter(emb._vbe_plans.values()))
    plan["ready"] = (S, Event())  # (as a prefetch on CUDA marks it)
    emb(idx, offsets, batch_size_per_feature_per_rank=sizes)
    emb.vbe_padded_offsets(offsets, sizes)
    assert waited == [plan, plan]
