"""TBEGEN_CACHE_LOOKUP_STREAM=1: a prefetch's row exchange on the cache's own stream, so that the next
prefetch's lookup runs beside it (issue 27; tbegen/cache.py RowCache._exchange_aside_on and
_launch_aside, module._CacheStreams.moved; docs/placements.md, "Prefetching on another stream").

In TorchRec's order the prefetch of batch i + 1 is queued on the stream that holds batch i's
exchange kernels: its lookup and its one host wait (the summary) waited for the rest of that
exchange (H100, C2 at 20%: pipelined 20.1 ms a step, ~12.3 ms of it the exchange). The lookup
reads only the bookkeeping the previous fill wrote on that stream (row to slot, slot to row, last
use, dirty flags, holds), never the rows the exchange moves. With the switch, the exchange
kernels go to a stream of the cache's own, which waits for an event recorded after the fill's
bookkeeping; the forward that takes the batch waits for that exchange, and every other move of
rows (flush, drop, a fill on another stream) for the exchange stream's latest event.

On the CPU (no streams, no exchange operator) the cache fills through a stand-in of the exchange
operator (tests/test_row_exchange.py) and the module's stream calls go to stand-in streams and
events. The exchange stream is *lazy*: its kernels run only when some stream waits for an event
recorded after them (or for the stream), the latest schedule the declared order allows. A use
that read the slots or the backing rows without waiting for the exchange would then read them
before the rows moved, and the training would differ from in-step lookups; a lookup that needed
the moved rows would, too. The `cuda` tests check the same on a GPU, with the exchange stream
held back by torch.cuda._sleep.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from tbegen import _ranges
from tbegen import cache as cache_
from tbegen import module as module_
from tbegen.module import TableBatchedEmbeddingBags

from test_prefetch_pipeline import (  # noqa: F401 (built: the module's autouse build)
    FEATURES, LR, TABLES, _hot_batches, _sleep_seconds, built)
from test_row_exchange import exchange_rows_reference, with_exchange

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cache_timeline import _Shadow  # noqa: E402 (module._CacheStreams on the stand-in streams)

cuda = pytest.mark.cuda
CUDA = torch.device("cuda", 0)
SWITCH = "TBEGEN_CACHE_LOOKUP_STREAM"


def _module(device="cpu", cache_rows=(34, None, 40), **kw):
    return TableBatchedEmbeddingBags(TABLES, optimizer="adam", learning_rate=LR, feature_table_map=FEATURES,
                                     device=device, placements=["managed_caching", "device", "managed_caching"],
                                     cache_rows=list(cache_rows), **kw)


def _batches(steps, seed, hot=150, device="cpu"):
    """test_prefetch_pipeline's batches (4 bags a feature, 0-3 rows a bag, rows from the first `hot`
    of each table), on `device`."""
    return [tuple(t.to(device) for t in batch) for batch in _hot_batches(steps, seed, hot)]


# ---- the switch -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["2", "on", "true", " 1", "01"])
def test_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(ValueError, match=f"TBEGEN_CACHE_LOOKUP_STREAM must be 0 or 1 \\(or unset\\), got {value!r}"):
        _module()


@pytest.mark.parametrize("value", [None, "", "0", "1"])
def test_switch_is_off_without_the_exchange(monkeypatch, value):
    """Accepted values; on the CPU (no exchange operator) the fill moves rows on its own stream
    whatever the switch says, and nothing is handed to the module."""
    if value is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, value)
    emb = _module()
    assert emb._cache._aside is False
    data = _batches(3, seed=1)
    emb.prefetch(data[0][0], data[0][1])
    assert emb._cache.take_aside() is None and emb._cache._aside_stream is None


def test_switch_is_read_with_the_exchange(monkeypatch):
    """Where the fill exchanges (on CUDA by default: here through the stand-in), unset, "" and
    "1" take the exchange stream (the default since landing12), "0" leaves it off; read when the
    cache's state is made."""
    monkeypatch.delenv(SWITCH, raising=False)
    emb = with_exchange(_module(), exchange_rows_reference)
    assert emb._cache._exchange_aside_on() is True
    for value, on in (("1", True), ("0", False), ("", True)):
        monkeypatch.setenv(SWITCH, value)
        emb = with_exchange(_module(), exchange_rows_reference)
        emb._cache._aside = emb._cache._exchange_aside_on()
        assert emb._cache._aside is on


# ---- the order, on stand-in streams with a lazy exchange stream -------------------------------------


class _Sim:
    """Stand-in CUDA streams and events. Work on the prefetch stream P and the default stream D
    runs at once (the host issues it in order); the exchange stream X queues the exchange
    operator's calls and runs them only when a stream waits for an event recorded on X after
    them, or for X itself."""

    def __init__(self):
        self.log = []
        self.current = None
        self.events = 0
        self.queue = []  # X's calls not run yet, with their sequence numbers
        self.issued = 0  # calls queued on X so far
        self.handed = []  # ids of the tensors handed to X (cache._hand_off)
        self.pending_at_host_waits = []  # X's calls not run when each lookup read its summary

    def run_x(self, upto=None):
        while self.queue and (upto is None or self.queue[0][0] < upto):
            self.queue.pop(0)[1]()


class _Stream:
    device = CUDA

    def __init__(self, name, sim):
        self.name, self.sim = name, sim

    def wait_event(self, event):
        self.sim.log.append((self.name, "waits", event.name, event.stream))
        if event.stream == "X":
            self.sim.run_x(event.upto)

    def wait_stream(self, stream):
        self.sim.log.append((self.name, "waits for stream", stream.name, stream.name))
        if stream.name == "X":
            self.sim.run_x()

    def __repr__(self):
        return self.name


def _events(sim):
    class Event:
        def __init__(self):
            self.name = f"e{sim.events}"
            sim.events += 1
            self.stream, self.upto = None, None

        def record(self, stream):
            self.stream, self.upto = stream.name, sim.issued
            sim.log.append((stream.name, "records", self.name, None))

    return Event


@contextlib.contextmanager
def _simulated(monkeypatch):
    sim = _Sim()
    D, P, X = _Stream("D", sim), _Stream("P", sim), _Stream("X", sim)
    made = []

    def new_stream(device=None):
        made.append(X)
        return X

    @contextlib.contextmanager
    def on(stream):
        was, sim.current = sim.current, stream
        try:
            yield
        finally:
            sim.current = was

    def hand_off(tensors, stream):
        assert stream is X
        sim.handed.extend(id(t) for t in tensors)

    def listener(name, how):
        if name == "tbegen.cache.host_wait" and how == "begin":
            sim.pending_at_host_waits.append((sim.current.name, len(sim.queue)))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.current)
    monkeypatch.setattr(torch.cuda, "Event", _events(sim))
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(cache_, "_hand_off", hand_off)
    was_on = _ranges.enabled()
    _ranges.enable(True)
    remove = _ranges.listen(listener)
    sim.current = D
    try:
        yield sim, D, P, X, made
    finally:
        remove()
        _ranges.enable(was_on)


def _lazy_op(sim, X, calls, bounds=None):
    """The exchange operator's stand-in: run at once, or, issued on X, queued until waited for;
    the tensors it is given must have been handed to X first. `bounds` (a list): gets (stream
    name, grid bound) of each call."""
    def op(rows, slot_rows, out_rows, in_rows, max_blocks):
        calls.append(sim.current.name)
        if bounds is not None:
            bounds.append((sim.current.name, max_blocks))
        if sim.current is X:
            for t in (slot_rows, out_rows, in_rows):
                assert t is None or id(t) in sim.handed, "an index tensor read on X was not handed to it"
            sim.issued += 1
            sim.queue.append((sim.issued - 1, lambda: exchange_rows_reference(rows, slot_rows, out_rows, in_rows,
                                                                             max_blocks)))
        else:
            exchange_rows_reference(rows, slot_rows, out_rows, in_rows, max_blocks)
    return op


def _train(emb, data, order, sim=None, D=None, P=None, mark=None, let_go=0.0):
    """order "in-step" (each forward looks its batch up), "torchrec" (forward i on D, prefetch of
    i + 1 on P, backward i on D: bench_cache's --pipelined step), "ahead" (as torchrec, two
    batches ahead: the prefetch of i + 2 after the forward of i), "fbgemm" (the prefetch of i + 1
    after the backward of i). `let_go`: the chance, before each prefetch, that every hold is let
    go (as a cache too small for the batches in flight does; their backwards then look their
    batches up again). Returns the outputs."""
    ahead = {"in-step": 0, "torchrec": 1, "ahead": 2, "fbgemm": 1}[order]
    rnd = torch.Generator().manual_seed(99)

    def on(stream):
        return torch.cuda.stream(stream) if sim is not None else contextlib.nullcontext()

    def prefetch(k):
        if k < len(data):
            if let_go and float(torch.rand(1, generator=rnd)) < let_go:
                emb._cache._release_all()
            if mark is not None:
                mark(f"prefetch {k}")
            with on(P):
                emb.prefetch(data[k][0], data[k][1])

    outs = []
    for k in range(ahead):
        prefetch(k)
    for k, (idx, offsets, grad) in enumerate(data):
        if mark is not None:
            mark(f"forward {k}")
        out = emb(idx, offsets)
        if ahead and order != "fbgemm":
            prefetch(k + ahead)
        if mark is not None:
            mark(f"backward {k}")
        out.backward(grad)
        if order == "fbgemm":
            prefetch(k + 1)
        outs.append(out.detach().clone())
    if mark is not None:
        mark("flush")
    emb.flush()
    return outs


def _same(a_outs, a, b_outs, b):
    assert len(a_outs) == len(b_outs)
    for k, (x, y) in enumerate(zip(a_outs, b_outs)):
        assert torch.equal(x, y), f"output of batch {k}"
    assert torch.equal(a.weights.detach(), b.weights.detach()), "weights"
    for name, state in a.states.named_buffers():
        assert torch.equal(state, getattr(b.states, name)), name


def _lazy_run(monkeypatch, order, seed, cache_rows=(34, None, 40), hot=150, steps=12, let_go=0.0):
    """In-step training (exchange at once, switch off) and `order` with the switch on and the lazy
    exchange stream: (reference outputs, reference module, outputs, module, sim, calls, log marks)."""
    data = _batches(steps, seed, hot)
    want_module = with_exchange(_module(cache_rows=cache_rows), exchange_rows_reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (overflow warnings)
        want = _train(want_module, data, "in-step")
    calls, marks = [], []
    with _simulated(monkeypatch) as (sim, D, P, X, made):
        emb = with_exchange(_module(cache_rows=cache_rows), _lazy_op(sim, X, calls))
        emb._cache._aside = True  # (as TBEGEN_CACHE_LOOKUP_STREAM=1 does where the fill exchanges)
        emb._cache_order = _Shadow()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _train(emb, data, order, sim, D, P, mark=lambda text: marks.append((text, len(sim.log))),
                         let_go=let_go)
        assert sim.queue == [], "the flush waits for the exchange stream"
    return want, want_module, got, emb, sim, calls, marks, made


@pytest.mark.parametrize("warm", ["0", "1"])
@pytest.mark.parametrize("order", ["torchrec", "ahead"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lazy_exchange_stream_trains_like_in_step(monkeypatch, order, seed, warm):
    """Every prefetch's exchange on X, run as late as the declared order allows: bitwise the
    in-step training. Two batches ahead, each prefetch's lookup reads its summary while the
    previous prefetch's exchange has not run (the lookup needs none of the rows it moves).
    `warm`: TBEGEN_CACHE_PREFETCH_WARM ("0": a prefetch that does not fit is deferred whole, the
    LFU default and the way back from LRU's; "1": it warms, the LRU default, these modules')."""
    monkeypatch.setenv("TBEGEN_CACHE_PREFETCH_WARM", warm)
    want, want_module, got, emb, sim, calls, _, made = _lazy_run(monkeypatch, order, seed)
    _same(want, want_module, got, emb)
    assert len(made) == 1  # (one exchange stream, made at the first fill)
    # every prefetch's fill exchanged on X (two ahead, some forwards look their batch up
    # themselves, their prefetch deferred: without the warm those fills exchange on D, after X's
    # latest; with it on X too, module._lookup_beside)
    assert set(calls) == ({"X"} if order == "torchrec" or warm == "1" else {"X", "D"}), set(calls)
    if order == "ahead":
        assert emb.cache_stats()["deferred"] > 0
    stats = emb.cache_stats()
    assert stats["evictions"] > 0 and stats["rows_written_back"] > 0
    prefetch_waits = [n for stream, n in sim.pending_at_host_waits if stream == "P"]
    if order == "ahead":
        assert max(prefetch_waits) > 0, sim.pending_at_host_waits


@pytest.mark.parametrize("seed", [0, 1])
def test_lazy_exchange_stream_in_step_with_lrus_default(monkeypatch, seed):
    """No prefetch at all, the warm unset (LRU's default since b9c6633): on CUDA every forward's own
    lookup takes module._lookup_beside, its fill's exchange on X, and only its kernels wait for X
    (wait_all). With X lazy, a forward whose kernels did not wait for its rows, or a fill whose
    exchange ran before the backward that updated its victims, would differ: bitwise the in-step
    training with the exchange at once."""
    monkeypatch.delenv("TBEGEN_CACHE_PREFETCH_WARM", raising=False)
    want, want_module, got, emb, sim, calls, _, made = _lazy_run(monkeypatch, "in-step", seed)
    assert emb._cache.algorithm == "lru" and emb._cache._warm
    _same(want, want_module, got, emb)
    assert len(made) == 1 and calls and set(calls) == {"X"}, set(calls)
    stats = emb.cache_stats()
    assert stats["evictions"] > 0 and stats["rows_written_back"] > 0 and stats["prepares"] == 12


@pytest.mark.parametrize("given", [None, "5"])
def test_the_exchange_stream_and_the_fill_share_one_grid(monkeypatch, given):
    """A prefetch's exchange on X (beside the backward before) and a forward's fill on D take the
    same grid bound (the cache's _exchange_blocks; TBEGEN_CACHE_EXCHANGE_BLOCKS=n sets it). Two
    batches ahead, so that both kinds of fill happen (deferred prefetches leave their batch to a
    forward's fill on D)."""
    if given is None:
        monkeypatch.delenv("TBEGEN_CACHE_EXCHANGE_BLOCKS", raising=False)
    else:
        monkeypatch.setenv("TBEGEN_CACHE_EXCHANGE_BLOCKS", given)
    # (deferred without the warm, the LFU default and the way back from LRU's: with LRU's default,
    # the warm, a forward's own fill exchanges on X too, module._lookup_beside)
    monkeypatch.setenv("TBEGEN_CACHE_PREFETCH_WARM", "0")
    data = _batches(12, seed=1)
    calls, bounds = [], []
    with _simulated(monkeypatch) as (sim, D, P, X, made):
        emb = with_exchange(_module(), _lazy_op(sim, X, calls, bounds), blocks=int(given or 12))
        emb._cache._aside = True
        emb._cache_order = _Shadow()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(emb, data, "ahead", sim, D, P)
    assert {name for name, _ in bounds} == {"X", "D"}, bounds
    assert all(b == int(given or 12) for _, b in bounds), bounds


def _sections(sim, marks):
    """{mark: the log entries from that mark to the next}."""
    out = {}
    for k, (text, start) in enumerate(marks):
        end = marks[k + 1][1] if k + 1 < len(marks) else len(sim.log)
        out[text] = sim.log[start:end]
    return out


def test_the_order_of_the_streams(monkeypatch):
    """TorchRec's order with the switch: each prefetch's P waits for the point after the bookkeeping
    of the backward before (its dirty flags: `mark`), not for that backward's kernels, and never
    for X; X waits for an event that P recorded after the fill's bookkeeping and for the end of
    that backward (whose rows the exchange may write back), then runs the exchange; the forward
    that takes the batch waits for that prefetch's X event; the backward of a valid ticket waits
    for nothing; the flush waits for X's latest event."""
    want, want_module, got, emb, sim, calls, marks, _ = _lazy_run(monkeypatch, "torchrec", seed=3)
    _same(want, want_module, got, emb)
    _check_order(sim, marks)


@pytest.mark.parametrize("broken", ["wait_rows", "mark"])
def test_the_order_check_catches_a_missing_wait(monkeypatch, broken):
    """The order test can fail: without wait_rows the exchange does not wait for the backward
    before (the lazy stream cannot show that on the CPU: the backward has run when the host issues
    the exchange); without mark the lookup waits for that backward's end."""
    monkeypatch.setattr(module_._CacheStreams, broken, lambda self, *args: None)
    _, _, _, _, sim, _, marks, _ = _lazy_run(monkeypatch, "torchrec", seed=3)
    with pytest.raises(AssertionError):
        _check_order(sim, marks)


def _check_order(sim, marks):
    sections = _sections(sim, marks)
    x_events = {}
    for k in range(1, 11):
        pre, back = sections[f"prefetch {k + 1}"], sections[f"backward {k - 1}"]
        # the backward before: its mark (after its dirty flags), then its end
        recorded = [e[2] for e in back if e[0] == "D" and e[1] == "records"]
        assert len(recorded) == 2, back
        back_mark, back_end = recorded
        assert not [e for e in pre if e[0] == "P" and e[3] == "X"], pre  # (P never waits for X)
        assert [e[2] for e in pre if e[0] == "P" and e[1] == "waits"] == [back_mark], (pre, back)
        x = [e for e in pre if e[0] == "X"]
        assert [e[1] for e in x] == ["waits", "waits", "records"] and x[0][3] == "P", pre
        assert x[1][2:] == (back_end, "D"), (x, back)
        x_events[k + 1] = x[2][2]
        # X's first wait is for the event P recorded last before it (after the fill's bookkeeping)
        p_records = [e[2] for e in pre[:pre.index(x[0])] if e[0] == "P" and e[1] == "records"]
        assert p_records and p_records[-1] == x[0][2]
        assert not [e for e in sections[f"backward {k}"] if e[1] == "waits"], sections[f"backward {k}"]
    for k in range(2, 12):
        fwd = sections[f"forward {k}"]
        assert ("D", "waits", x_events[k], "X") in fwd, fwd
    assert any(e[0] == "D" and e[3] == "X" for e in sections["flush"])


def test_the_bookkeeping_is_written_before_the_exchange_stream_is_released(monkeypatch):
    """What _launch_aside's event rests on: when P records the event X waits for, the fill has
    written every bookkeeping tensor it writes (row to slot, slot to row, dirty flags), so the next
    lookup, queued on P after it, reads this fill's map; and X's kernels read only tensors made
    before it. (Fails if the launch moved before the fill's writes.)"""
    snaps, checked = [], []
    launch, fill = cache_.RowCache._launch_aside, cache_.RowCache._fill

    def snapshot(self, launches, rows_wait=None):
        snaps.append([t.clone() for t in (self._row_slot, self._slot_row, self._dirty)])
        launch(self, launches, rows_wait)

    def checked_fill(self, *args, **kwargs):
        n = len(snaps)
        fill(self, *args, **kwargs)
        if len(snaps) > n:
            assert all(torch.equal(a, b) for a, b in zip(snaps[-1], (self._row_slot, self._slot_row, self._dirty)))
            checked.append(True)

    monkeypatch.setattr(cache_.RowCache, "_launch_aside", snapshot)
    monkeypatch.setattr(cache_.RowCache, "_fill", checked_fill)
    _lazy_run(monkeypatch, "torchrec", seed=4)
    assert len(checked) >= 8


@pytest.mark.parametrize("broken", ["forward does not wait for the rows", "no exchange-stream wait anywhere"])
def test_the_lazy_stream_catches_a_missing_wait(monkeypatch, broken):
    """The test above can fail: a forward that takes its prefetched batch without waiting for that
    prefetch's exchange reads slots whose rows have not arrived; with no use waiting for X (the
    module not told, RowCache not joining), the flush does not run X either."""
    if broken == "forward does not wait for the rows":
        wait_for = module_._CacheStreams.wait_for
        monkeypatch.setattr(module_._CacheStreams, "wait_for",
                            lambda self, point, device: wait_for(self, point[:2], device))
    else:
        monkeypatch.setattr(module_._CacheStreams, "wait_for",
                            lambda self, point, device: None)
        monkeypatch.setattr(module_._CacheStreams, "moved", lambda self, device, stream, event: None)
        monkeypatch.setattr(cache_.RowCache, "_join_aside", lambda self: None)
    if broken == "forward does not wait for the rows":
        want, want_module, got, emb, *_ = _lazy_run(monkeypatch, "torchrec", seed=0)
        with pytest.raises(AssertionError, match="output of batch"):
            _same(want, want_module, got, emb)
    else:
        with pytest.raises(AssertionError, match="the flush waits for the exchange stream"):
            _lazy_run(monkeypatch, "torchrec", seed=0)


@pytest.mark.parametrize("order", ["torchrec", "fbgemm", "ahead"])
@pytest.mark.parametrize("seed", [7, 8])
def test_holds_let_go_with_the_lazy_stream(monkeypatch, order, seed):
    """Holds let go at random before prefetches (their batches' backwards look them up again; the
    prefetch's fill first waits for every other stream, exchange stream included): bitwise the
    in-step training, in TorchRec's, FBGEMM's and the two-ahead order."""
    want, want_module, got, emb, sim, *_ = _lazy_run(monkeypatch, order, seed, let_go=0.3)
    _same(want, want_module, got, emb)
    assert emb.cache_stats()["evictions"] > 0
    if order != "fbgemm":  # (holds let go while a batch is held: the prefetch's fill waited for X, wait_all)
        assert any(e[0] == "P" and e[1] == "waits" and e[3] == "X" for e in sim.log)


def test_a_prefetch_of_hits_only_still_orders_its_forward_after_the_exchange(monkeypatch):
    """A prefetch that loads nothing (its rows all loaded by the prefetch before it, whose exchange
    has not run) issues no exchange, but the forward that takes it, on a third stream that waited
    for nothing else, must still wait for the exchange stream: the point carries its latest event.
    (Without it, that forward reads slots whose rows have not arrived.)"""
    (idx, offsets, grad), = _batches(1, seed=9)
    again = (idx.clone(), offsets.clone())  # (the same rows, other tensors: a second prefetch)
    want_module = with_exchange(_module(), exchange_rows_reference)
    want = want_module(*again)
    want.backward(grad)
    want_module.flush()
    calls = []
    with _simulated(monkeypatch) as (sim, D, P, X, made):
        E = _Stream("E", sim)
        emb = with_exchange(_module(), _lazy_op(sim, X, calls))
        emb._cache._aside = True
        emb._cache_order = _Shadow()
        with torch.cuda.stream(P):
            emb.prefetch(idx, offsets)
            loads = len(sim.queue)
            emb.prefetch(*again)
        assert loads > 0 and len(sim.queue) == loads  # (the second loaded nothing: no new exchange)
        with torch.cuda.stream(E):
            out = emb(*again)
            assert sim.queue == []  # (E waited for the exchange stream before the forward's kernels)
            out.backward(grad)
        emb.flush()
    _same([want.detach()], want_module, [out.detach()], emb)


@pytest.mark.parametrize("seed", [5, 6])
def test_overflow_and_deferred_prefetches_with_the_lazy_stream(monkeypatch, seed):
    """Small caches (batches that overflow a compact table's cache: its drop moves rows on P, after
    X's latest exchange; prefetches deferred beside batches held or read in place): still
    bitwise the in-step training."""
    want, want_module, got, emb, sim, *_ = _lazy_run(monkeypatch, "torchrec", seed, cache_rows=(12, None, 16),
                                                    hot=60)
    _same(want, want_module, got, emb)
    stats = emb.cache_stats()
    assert stats["deferred"] > 0 or stats["bypasses"] > 0, stats


# ---- CUDA ---------------------------------------------------------------------------------------------


def _cuda_module(monkeypatch, switch, make):
    if switch is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, switch)
    emb = make()
    monkeypatch.delenv(SWITCH, raising=False)
    return emb


def _cuda_pipelined(emb, data, side, hold_back=0, late_backward=0):
    """bench_cache's --pipelined step: forward(i) on the current stream, prefetch(i + 1) on `side`
    (forward_stream given), backward(i). `hold_back`: cycles of torch.cuda._sleep queued on the
    exchange stream before each prefetch (once it exists), so that its kernels run late;
    `late_backward`: the same on the current stream before each backward, so that the next
    prefetch's lookup (which waits only for the backward's dirty flags) and above all its
    exchange (which must wait for the backward's updates of the rows it writes back) are issued
    while the backward has not run."""
    main = torch.cuda.current_stream()

    def prefetch(k):
        xs = emb._cache._aside_stream
        if hold_back and xs is not None:
            with torch.cuda.stream(xs):
                torch.cuda._sleep(hold_back)
        with torch.cuda.stream(side):
            emb.prefetch(data[k][0], data[k][1], forward_stream=main)

    outs = []
    prefetch(0)
    for k, (idx, offsets, grad) in enumerate(data):
        out = emb(idx, offsets)
        if k + 1 < len(data):
            prefetch(k + 1)
        if late_backward:
            torch.cuda._sleep(late_backward)
        out.backward(grad)
        outs.append(out.detach().clone())
    emb.flush()
    torch.cuda.synchronize()
    return outs


def _cuda_in_step(emb, data):
    outs = []
    for idx, offsets, grad in data:
        out = emb(idx, offsets)
        out.backward(grad)
        outs.append(out.detach().clone())
    emb.flush()
    torch.cuda.synchronize()
    return outs


def _exact_fit(steps, seed):
    """Batch k reads rows 8k..8k+7 (mod 64) of one table whose cache holds 8 rows: every batch
    evicts all of the batch before's rows, and each prefetch between a forward and its backward
    is deferred (its rows need the held slots)."""
    g = torch.Generator().manual_seed(seed)
    return [(((torch.arange(8) + 8 * k) % 64).cuda(), torch.arange(9).cuda(), torch.randn(8, 8, generator=g).cuda())
            for k in range(steps)]


@cuda
@pytest.mark.parametrize("case", ["evicting", "exact-fit", "rowwise_adagrad"])
def test_cuda_exchange_stream_trains_like_in_step(monkeypatch, case):
    """Pipelined training with the switch on (its exchange stream also held back ~50 ms before
    each prefetch; or the backwards held back ~50 ms), with it off, and in-step: bitwise the same
    outputs, weights and states.
    What would fail if the order were wrong: a forward that did not wait for its prefetch's
    exchange reads slots whose rows have not arrived (the outputs differ; with the stream held
    back, every step); a lookup that saw stale slot tags (not ordered after the previous fill's
    bookkeeping) would take a slot for a row it no longer holds, or load a resident row into a
    second slot (the weights differ at the flush: two slots of one row, one written back last);
    an exchange not ordered after the backward whose rows it evicts (wait_rows) writes back rows
    before their update, with the backwards held back (the weights differ)."""
    if case == "exact-fit":
        def make():
            return TableBatchedEmbeddingBags([(64, 8)], optimizer="adam", learning_rate=LR, device="cuda",
                                             placements="managed_caching", cache_rows=8)
        data = _exact_fit(10, seed=31)
    elif case == "rowwise_adagrad":
        def make():
            return TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", learning_rate=LR,
                                             feature_table_map=FEATURES, device="cuda",
                                             placements=["managed_caching", "device", "managed_caching"],
                                             cache_rows=[34, None, 40])
        data = _batches(12, seed=32, device="cuda")
    else:
        def make():
            return _module("cuda")
        data = _batches(12, seed=33, device="cuda")
    ref = _cuda_module(monkeypatch, None, make)
    want = _cuda_in_step(ref, data)
    side = torch.cuda.Stream()
    off = _cuda_module(monkeypatch, "0", make)
    got_off = _cuda_pipelined(off, data, side)
    on = _cuda_module(monkeypatch, "1", make)
    assert on._cache._aside and not off._cache._aside
    got_on = _cuda_pipelined(on, data, side)
    late = _cuda_module(monkeypatch, "1", make)
    got_late = _cuda_pipelined(late, data, side, hold_back=100_000_000)
    slow = _cuda_module(monkeypatch, "1", make)
    got_slow = _cuda_pipelined(slow, data, side, late_backward=100_000_000)
    for outs, emb in ((got_off, off), (got_on, on), (got_late, late), (got_slow, slow)):
        _same(want, ref, outs, emb)
    stats = on.cache_stats()
    assert stats["evictions"] > 0 and on._cache._aside_stream is not None
    assert off._cache._aside_stream is None
    if case == "exact-fit":
        assert stats["deferred"] > 0 and stats["evictions"] >= 8 * (len(data) - 1)
    else:
        assert stats["deferred"] == 0 and stats["rows_written_back"] > 0


@cuda
def test_cuda_prefetch_lookup_does_not_wait_for_the_previous_exchange(monkeypatch):
    """The point of the switch: with the exchange stream held back (~50 ms of torch.cuda._sleep
    queued there after the exchange of batch k), the prefetch of batch k + 1 returns (its host
    wait, the summary, done) long before the sleep ends; without the switch the exchange is on
    the prefetch stream, and a sleep queued there holds the prefetch for the whole sleep. The
    training is bitwise that of in-step lookups."""
    data = _batches(8, seed=35, device="cuda")
    ref = _cuda_module(monkeypatch, None, lambda: _module("cuda"))
    want = _cuda_in_step(ref, data)
    sleep = 100_000_000
    sleep_s = _sleep_seconds(sleep)
    took = {}
    for switch in ("1", "0"):
        emb = _cuda_module(monkeypatch, switch, lambda: _module("cuda"))
        side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        outs, times = [], []
        with torch.cuda.stream(side):
            emb.prefetch(data[0][0], data[0][1], forward_stream=main)
        for k, (idx, offsets, grad) in enumerate(data):
            out = emb(idx, offsets)
            if k + 1 < len(data):
                torch.cuda.synchronize()
                held = emb._cache._aside_stream if switch == "1" else side
                with torch.cuda.stream(held):
                    torch.cuda._sleep(sleep)
                t0 = time.perf_counter()
                with torch.cuda.stream(side):
                    emb.prefetch(data[k + 1][0], data[k + 1][1], forward_stream=main)
                times.append(time.perf_counter() - t0)
            out.backward(grad)
            outs.append(out.detach().clone())
        emb.flush()
        torch.cuda.synchronize()
        _same(want, ref, outs, emb)
        assert emb.cache_stats()["deferred"] == 0
        took[switch] = times
    assert max(took["1"]) < 0.5 * sleep_s, (took, sleep_s)
    assert min(took["0"]) > 0.8 * sleep_s, (took, sleep_s)  # (the old order: the host waited for the sleep)


@cuda
def test_cuda_exchange_stream_adds_no_host_wait(monkeypatch):
    """The exchange stream's order is event waits on the device: with the switch the pipelined
    steps make no more synchronizing calls than without it (torch's sync debug mode), and the
    prefetch's host waits stay its one summary read (tbegen/_sync_audit.py)."""
    from tbegen._sync_audit import SyncAudit

    data = _batches(10, seed=37, device="cuda")

    def steps(emb, side, audit=None):
        main = torch.cuda.current_stream()
        for k in range(3, len(data) - 1):
            if audit is not None:
                audit.mark(f"forward {k}")
            out = emb(data[k][0], data[k][1])
            if audit is not None:
                audit.mark(f"prefetch {k + 1}")
            with torch.cuda.stream(side):
                emb.prefetch(data[k + 1][0], data[k + 1][1], forward_stream=main)
            if audit is not None:
                audit.mark(f"backward {k}")
            out.backward(data[k][2])

    def fresh(switch):
        emb = _cuda_module(monkeypatch, switch, lambda: _module("cuda"))
        side = torch.cuda.Stream()
        _cuda_pipelined(emb, data[:4], side)  # (the exchange stream made, events recorded from here on)
        with torch.cuda.stream(side):
            emb.prefetch(data[3][0], data[3][1], forward_stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        return emb, side

    emb, side = fresh("1")
    with SyncAudit() as audit:
        steps(emb, side, audit)
    for name, events in audit.sections.items():
        mine = [e for e in events if "tbegen/cache.py:" in e.site]
        assert len(mine) <= (1 if name.startswith("prefetch") else 0), (name, audit.report(mine))
    counts = {}
    for switch in ("0", "1"):
        emb, side = fresh(switch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                steps(emb, side)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[switch] = sum("synchroniz" in str(w.message) for w in caught)
    assert counts["1"] <= counts["0"], counts
