#!/usr/bin/env python3
"""The order of a cached step's work per CUDA stream, and of its waits, recorded on the CPU.

    python3 benchmarks/cache_timeline.py                        # TorchRec's order, 3 steps
    python3 benchmarks/cache_timeline.py --order in-step --steps 2
    python3 benchmarks/cache_timeline.py --order fbgemm --cache 0.05

No GPU: the module runs on the CPU, and its cache-ordering object (module._CacheStreams) is
replaced by one that hands every call to a real _CacheStreams on stand-in CUDA streams (D, the
default stream of the forward and backward; P, the prefetch stream of TorchRec's
PrefetchTrainPipelineSparseDist). The tool writes, in host order (the order the work reaches the
streams): each phase's begin and end on its stream (the named ranges of tbegen/_ranges.py:
forward, backward, prefetch, the cache's lookup, fill, write-back, load), each stream's wait for
another (the event it waits for, named after the phase that ended before it was recorded), and
each host wait (tbegen/_sync_audit.py: an operation whose result the host reads, where the host
stops until the stream's queue has run). On a GPU each stream runs its work in this order;
what a stream waits for it cannot start before; and nothing queued after a host wait is issued
until the GPU has run everything the waiting stream had queued. The timeline that follows from
it (what runs beside what) is in benchmarks/NOTES-gpu.md, "Issue 27: the pipelined step's
timeline".

Orders (--order): torchrec (forward i on D, prefetch i + 1 on P, backward i on D), fbgemm
(forward i, backward i, prefetch i + 1 on P), in-step (no prefetch: each forward looks its batch
up itself on D).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tbegen import TableBatchedEmbeddingBags, _ranges  # noqa: E402
from tbegen.cache import RowCache  # noqa: E402
from tbegen._sync_audit import SyncAudit  # noqa: E402
from tbegen.module import _CacheStreams  # noqa: E402

CUDA = torch.device("cuda", 0)


class _Recorder:
    """The log, the stand-in streams and events, and which stream the host has current."""

    def __init__(self):
        self.lines: List[str] = []
        self.current: Optional["_Stream"] = None
        self.events = 0
        self.last_phase = {}  # stream name -> the phase that last ended on it

    def add(self, stream: Optional[str], text: str) -> None:
        self.lines.append(f"  [{stream}] {text}" if stream else f"  {text}")


class _Stream:
    device = CUDA

    def __init__(self, name: str, rec: _Recorder):
        self.name, self.rec = name, rec

    def wait_event(self, event) -> None:
        self.rec.add(self.name, f"waits for {event.name} ({event.stream} after {event.after})")

    def wait_stream(self, stream) -> None:
        self.rec.add(self.name, f"waits for stream {stream.name} (all it queued)")

    def __eq__(self, other):
        return isinstance(other, _Stream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


class _Event:
    rec: _Recorder

    def __init__(self):
        self.name = f"e{self.rec.events}"
        self.rec.events += 1

    def synchronize(self) -> None:  # (the host waits for it: the sync audit counts this)
        pass

    def record(self, stream) -> None:
        self.stream = stream.name
        self.after = self.rec.last_phase.get(stream.name, "nothing")
        self.rec.add(stream.name, f"records {self.name}")


class _Shadow:
    """Stands in for module._CacheStreams on the CPU: every call goes to a real one, on the
    stand-in CUDA streams (the module's device is the CPU). Also the stand-in of
    tests/test_cache_lookup_stream.py."""

    def __init__(self):
        self.inner = _CacheStreams()

    def enter(self, device, wait=True, lookup=False):
        return self.inner.enter(CUDA, wait, lookup)

    def wait_for(self, point, device):
        return self.inner.wait_for(point, CUDA)

    def leave(self, device, lookup=False, read=False):
        return self.inner.leave(CUDA, lookup=lookup, read=read)

    def wait_all(self, device):
        return self.inner.wait_all(CUDA)

    def moved(self, device, stream, event):
        return self.inner.moved(CUDA, stream, event)

    def mark(self, device):
        return self.inner.mark(CUDA)

    def wait_rows(self, stream, device):
        return self.inner.wait_rows(stream, CUDA)


class _Audit(SyncAudit):
    """The sync audit, its waits written into the log as they happen."""

    def __init__(self, rec: _Recorder):
        super().__init__(simulate=True)
        self.rec = rec

    def _record(self, what: str) -> None:
        super()._record(what)
        stream = self.rec.current.name if self.rec.current else "?"
        self.rec.add(None, f"HOST WAITS for {stream} ({what}; {self.events[-1].site})")


def batches(args, count: int):
    g = torch.Generator().manual_seed(args.seed)
    E, T, B, L = args.rows, args.tables, args.batch, args.pooling_factor
    weights = torch.arange(1, E + 1, dtype=torch.float64).pow(-args.alpha)
    out = []
    for _ in range(count):
        rows = torch.multinomial(weights, T * B * L, replacement=True, generator=g)
        out.append((rows, torch.arange(T * B + 1, dtype=torch.int64) * L))
    return out


def timeline(args) -> List[str]:
    """The log of args.steps steps (after one untraced step that fills the pipeline)."""
    rec = _Recorder()
    D, P = _Stream("D", rec), _Stream("P", rec)
    _Event.rec = rec
    emb = TableBatchedEmbeddingBags([(args.rows, args.dim)] * args.tables, optimizer=args.optimizer,
                                    placements="managed_caching", cache_load_factor=args.cache, learning_rate=0.01)
    emb._cache_order = _Shadow()
    data = batches(args, args.steps + 2)
    grad = torch.ones(args.batch, args.tables * args.dim)

    def phase(name, how):
        stream = rec.current.name
        if how == "end":
            rec.last_phase[stream] = name
        if name != "tbegen.cache.host_wait":
            rec.add(stream, f"{'begin' if how == 'begin' else 'end  '} {name}")

    def step(i):
        idx, off = data[i]
        rec.current = D
        out = emb(idx, off)
        if args.order == "torchrec" and i + 1 < len(data):
            rec.current = P
            emb.prefetch(*data[i + 1])
            rec.current = D
        out.backward(grad)
        if args.order == "fbgemm" and i + 1 < len(data):
            rec.current = P
            emb.prefetch(*data[i + 1])
            rec.current = D

    # The write-back stream W (RowCache._side on CUDA; on the CPU the staged writes run at once):
    # what it waits for and what waits for it, as _write_staged and _join_writeback order them.
    write_staged, join = RowCache._write_staged, RowCache._join_writeback
    pending = []

    def staged_on_w(cache, staged):
        if staged:
            rec.add("W", f"waits for stream {rec.current.name} (the evicted rows' gathers)")
            rec.add("W", f"writes the evicted rows back to the backing store ({len(staged)} staged writes)")
            pending.append(True)
        write_staged(cache, staged)

    def joined(cache):
        if pending:
            rec.add(rec.current.name, "waits for stream W (the write-back)")
            pending.clear()
        join(cache)

    was_on = _ranges.enabled()
    _ranges.enable(True)
    remove = _ranges.listen(phase)
    try:
        with mock.patch.object(torch.cuda, "current_stream", lambda device=None: rec.current), \
                mock.patch.object(torch.cuda, "Event", _Event), \
                mock.patch.object(RowCache, "_write_staged", staged_on_w), \
                mock.patch.object(RowCache, "_join_writeback", joined):
            rec.current = D
            if args.order != "in-step":
                emb.prefetch(*data[0])
            step(0)
            for i in range(1, args.steps + 1):
                nxt = {"torchrec": f", prefetch {i + 1} (P)", "fbgemm": f", prefetch {i + 1} (P)", "in-step": ""}
                order = (f"forward {i} (D){nxt[args.order]}, backward {i} (D)" if args.order == "torchrec" else
                         f"forward {i} (D), backward {i} (D){nxt[args.order]}")
                rec.lines.append(f"step {i}: {order}")
                with _Audit(rec):
                    step(i)
    finally:
        remove()
        _ranges.enable(was_on)
    emb._cache_order = _CacheStreams()  # (the statistics' settling use: on the CPU, nothing)
    s = emb.cache_stats()
    rec.lines.append(f"(cache: {s['lookups']} lookups, hit rate {s['hit_rate']:.3f}, {s['deferred']} prefetches deferred)")
    return rec.lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", default="torchrec", choices=["torchrec", "fbgemm", "in-step"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--rows", type=int, default=300, help="rows per table (the default: batches evict rows)")
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pooling-factor", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--cache", type=float, default=0.2, help="cache_load_factor")
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the log here")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    text = "\n".join(timeline(args))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
