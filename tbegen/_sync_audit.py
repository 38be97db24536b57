"""Counts the places where code would make the host wait for a CUDA device, on any device.

A CUDA program runs ahead of its GPU: the host queues kernels and returns. An operation whose
result the *host* needs (a value it branches on, or the size of an output it must allocate) makes
it wait until everything queued before has run: the queue drains, and whatever the host queues
next (a prefetch on a side stream, the next forward) cannot overlap the work in flight. Such waits
are invisible on the CPU, where every op runs at once, and so they creep in. `SyncAudit` is a
TorchDispatchMode that records each operation that *would* wait on CUDA, with the line of the
caller that issued it, while the code runs anywhere (CI runs it on the CPU: tests/test_sync_audit.py,
tests/test_cache_syncs.py; `python3 -m tbegen._sync_audit` prints a cached module's waits per
call site).

What counts as a wait (checked against torch's own list: torch.cuda.set_sync_debug_mode warns
on every cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize and on every
synchronous cudaMemcpy, c10/cuda/CUDAFunctions.h; the aten ops below are those whose CUDA kernels
call one of them, most of them tagged `dynamic_output_shape` or `data_dependent_output` in
native_functions.yaml, the tags torch.compile uses for the same reason):

- output size decided by the data (the kernel copies a count to the host to allocate the output):
  aten.nonzero (also torch.where(cond), argwhere), aten._unique / _unique2 / unique_dim /
  unique_consecutive / unique_dim_consecutive (torch.unique), aten.masked_select,
  aten.index.Tensor and aten.index_put_ / index_put with a bool or uint8 index (x[mask],
  x[mask] = v: a nonzero inside), aten.repeat_interleave.Tensor *without* output_size,
  aten.bincount (its length is the maximum + 1), aten.one_hot with num_classes = -1,
  aten.histc with min == max (it reads the range from the data).
- a value read by the host: aten._local_scalar_dense / aten.item (Tensor.item, int(t), float(t),
  bool(t), `if t:`), aten.equal and aten.allclose (return a Python bool), aten.is_nonzero,
  aten.masked_fill with a tensor value (CUDA reads the value with .item());
  Tensor.tolist() and Tensor.numpy() (a device-to-host copy, then the host reads it), Tensor.cpu()
  and .to("cpu") of device values, torch.tensor / torch.as_tensor of a list holding tensors (one
  .item() per element on CUDA).
- copies between host and device that are not non_blocking, in either direction: torch issues
  them as cudaMemcpyAsync followed by cudaStreamSynchronize (at::cuda::memcpy_and_sync, which the
  sync debug mode reports), so even a host-to-device copy waits for everything queued on the
  stream. aten._to_copy / aten.copy_ between the CPU and a GPU without non_blocking, and
  torch.tensor / torch.as_tensor with a `device` (the data is built on the host, then copied
  that way); x[idx] = a Python number where idx holds an integer tensor or a list (advanced
  indexing), or ints for every dimension (one element): for a CUDA tensor torch makes the number
  a CPU tensor (python_variable_indexing.cpp, THPVariable_setitem), which index_put_ copies to
  the device that way (_index_put_impl_, value.to(self.device())) and so does the copy into one
  element (at::indexing::copy_to; torch 2.11 and 2.13; pytorch PRs 188267 and 188330 propose
  fills instead), so x.index_fill_(0, idx, number) and x[i:i + 1] = number do not wait; explicit waits:
  torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize.

Not waits (and not counted): indexing with integer tensors (aten.index.Tensor with int64
indices, index_select, gather, index_copy_, index_put_ with integer indices and a device
tensor as the value, index_fill_ with a number), x[i] = a Python number where x[i] has more
than one element, e.g. a slice (filled on the device), repeat_interleave with output_size, nonzero_static,
sort/argsort, cumsum, searchsorted, isin, masked_fill with a Python scalar, torch.where(cond, a,
b), factories (zeros, full, arange, new_full with Python numbers: filled on the device), and
every elementwise op.

With `simulate` (the default where no GPU is present), every CPU tensor stands for a device
tensor (the code under audit is written for one device): a .tolist() of a CPU tensor counts, and
so does torch.tensor(data, device=...) whatever the device; values that were host values to
begin with should stay Python numbers in such code.
"""

from __future__ import annotations

import collections
import numbers
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncAudit", "SyncEvent"]

aten = torch.ops.aten

# Ops that always make the host wait on CUDA (output size or a value read by the host).
_ALWAYS = {
    aten.nonzero.default: "nonzero (output size from the data)",
    aten.nonzero.out: "nonzero (output size from the data)",
    aten._unique.default: "unique (output size from the data)",
    aten._unique2.default: "unique (output size from the data)",
    aten.unique_dim.default: "unique (output size from the data)",
    aten.unique_consecutive.default: "unique_consecutive (output size from the data)",
    aten.unique_dim_consecutive.default: "unique_consecutive (output size from the data)",
    aten.masked_select.default: "masked_select (output size from the data)",
    aten.masked_select.out: "masked_select (output size from the data)",
    aten.bincount.default: "bincount (length from the maximum)",
    aten._local_scalar_dense.default: "a value read by the host (item / int / float / bool)",
    aten.item.default: "a value read by the host (item)",
    aten.equal.default: "equal (a Python bool)",
    aten.allclose.default: "allclose (a Python bool)",
    aten.is_nonzero.default: "is_nonzero (a Python bool)",
}
_BOOL_INDEX = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
               aten._index_put_impl_.default)
_COPIES = (aten._to_copy.default, aten.copy_.default)


@dataclass(frozen=True)
class SyncEvent:
    what: str  # the operation and why it waits
    site: str  # "path:line function" of the innermost caller in the audited files


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _advanced_index(index) -> bool:
    """Whether a __setitem__ index holds an integer tensor or a list (advanced indexing by
    integers; a bool mask is aten.index_put_'s own rule above)."""
    for i in (index if isinstance(index, tuple) else (index,)):
        if isinstance(i, torch.Tensor) and i.dtype not in (torch.bool, torch.uint8) and i.dim() > 0:
            return True
        if isinstance(i, list):
            return True
    return False


def _holds_tensor(data) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return any(_holds_tensor(x) for x in data)
    return False


def _why(func, args, kwargs) -> Optional[str]:
    """Why `func(*args, **kwargs)` would make the host wait on CUDA, or None."""
    why = _ALWAYS.get(func)
    if why is not None:
        return why
    if func in _BOOL_INDEX:
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if _has_bool_index(indices):
            return f"{func.__name__} with a bool mask (a nonzero inside)"
        return None
    if func is aten.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None):
            return "repeat_interleave without output_size (output size from the data)"
        return None
    if func is aten.one_hot.default:
        num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return "one_hot without num_classes (the maximum read)" if num_classes == -1 else None
    if func is aten.histc.default:
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return "histc with min == max (the range read from the data)" if lo == hi else None
    if func in (aten.masked_fill.Tensor, aten.masked_fill_.Tensor):
        return "masked_fill with a tensor value (read by the host on CUDA)"
    if func in _COPIES:
        src = args[0] if func is aten._to_copy.default else args[1]
        dev = kwargs.get("device") if func is aten._to_copy.default else args[0].device
        blocking = not kwargs.get("non_blocking", False) if func is aten._to_copy.default else not (
            len(args) > 2 and args[2] or kwargs.get("non_blocking", False))
        if isinstance(src, torch.Tensor) and dev is not None and blocking:
            to = torch.device(dev).type
            if src.device.type != "cpu" and to == "cpu":
                return "device-to-host copy (not non_blocking: torch synchronizes the stream)"
            if src.device.type == "cpu" and to != "cpu":
                return "host-to-device copy (not non_blocking: torch synchronizes the stream)"
    return None


class SyncAudit(TorchDispatchMode):
    """Records every operation run inside `with SyncAudit() as audit:` that would make the host
    wait for a CUDA device (module docstring), with its call site: the innermost frame whose file
    is under one of `paths` (default: the tbegen package), else the innermost frame outside torch.

    audit.events: the SyncEvents in order; audit.count; audit.by_site(): {site: count};
    audit.report(): one line per site, most first. `mark(name)` starts a new section (events
    recorded after it are listed under that name in audit.sections)."""

    def __init__(self, paths: Optional[Sequence[str]] = None, simulate: Optional[bool] = None):
        super().__init__()
        self.simulate = not torch.cuda.is_available() if simulate is None else bool(simulate)
        here = os.path.dirname(os.path.abspath(__file__))
        self.paths = tuple(os.path.abspath(p) for p in (paths or (here,)))
        self.events: List[SyncEvent] = []
        self.sections: Dict[str, List[SyncEvent]] = collections.OrderedDict()
        self._section: Optional[str] = None
        self._patched: List[Tuple[object, str, object]] = []
        self._inside = threading.local()  # (in a patched Python call: its own ops are not counted twice)

    # ---- recording ----

    def _site(self) -> str:
        frame = sys._getframe(2)
        fallback = None
        torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
        me = os.path.abspath(__file__)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if path != me:
                if path.startswith(self.paths):
                    return f"{os.path.relpath(path)}:{frame.f_lineno} {frame.f_code.co_name}"
                if fallback is None and not path.startswith(torch_dir):
                    fallback = f"{os.path.relpath(path)}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return fallback or "?"

    def _record(self, what: str) -> None:
        event = SyncEvent(what, self._site())
        self.events.append(event)
        if self._section is not None:
            self.sections[self._section].append(event)

    def mark(self, name: str) -> None:
        self._section = name
        self.sections.setdefault(name, [])

    @property
    def count(self) -> int:
        return len(self.events)

    def by_site(self, events: Optional[Sequence[SyncEvent]] = None) -> Dict[str, int]:
        return dict(collections.Counter(e.site for e in (self.events if events is None else events)).most_common())

    def report(self, events: Optional[Sequence[SyncEvent]] = None) -> str:
        events = self.events if events is None else events
        whats = collections.defaultdict(set)
        for e in events:
            whats[e.site].add(e.what)
        lines = [f"{n:5d}  {site}  [{'; '.join(sorted(whats[site]))}]" for site, n in self.by_site(events).items()]
        return "\n".join(lines + [f"{len(events):5d}  in all"])

    # ---- the dispatch mode ----

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(self._inside, "on", False):
            why = _why(func, args, kwargs)
            if why is not None:
                self._record(f"{func}: {why}")
        return func(*args, **kwargs)

    # ---- Python-level reads that reach no aten op on the CPU ----

    def _wrap(self, owner, name: str, why: Callable[..., Optional[str]]) -> None:
        original = getattr(owner, name)
        own = name in vars(owner)  # (else inherited: restored by deleting the wrapper)
        audit = self

        def wrapper(*args, **kwargs):
            reason = why(*args, **kwargs)
            if reason is None:
                return original(*args, **kwargs)
            audit._record(reason)
            audit._inside.on = True
            try:
                return original(*args, **kwargs)
            finally:
                audit._inside.on = False

        wrapper.__wrapped__ = original
        setattr(owner, name, wrapper)
        self._patched.append((owner, name, original if own else None))

    def __enter__(self):
        def to_cpu(t, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" and not kwargs.get(
                    "non_blocking", False):
                return "Tensor.to('cpu'): a device-to-host copy"
            return None

        self._wrap(torch.Tensor, "tolist", lambda t: "Tensor.tolist(): a device-to-host copy read by the host")
        self._wrap(torch.Tensor, "numpy", lambda t, *a, **k: "Tensor.numpy(): a device-to-host copy")
        self._wrap(torch.Tensor, "cpu", lambda t, *a, **k: "Tensor.cpu(): a device-to-host copy")
        self._wrap(torch.Tensor, "to", to_cpu)
        def from_data(name):
            def why(data=None, *a, **k):
                if not isinstance(data, torch.Tensor) and _holds_tensor(data):
                    return f"torch.{name} of a list holding tensors (each element read by the host)"
                device = k.get("device")
                if device is not None and (self.simulate or torch.device(device).type != "cpu"):
                    return (f"torch.{name}(data, device=...): a host-to-device copy (not non_blocking: "
                            f"torch synchronizes the stream)")
                return None
            return why

        for name in ("tensor", "as_tensor"):
            self._wrap(torch, name, from_data(name))

        def setitem(t, index, value):
            if isinstance(value, torch.Tensor) or not isinstance(value, numbers.Number):
                return None
            if not (self.simulate or t.device.type != "cpu"):
                return None
            if _advanced_index(index):
                return ("x[idx] = a Python number with a tensor index: a CPU scalar that index_put_ copies to the "
                        "device (not non_blocking: torch synchronizes the stream; index_fill_ does not)")
            ints = index if isinstance(index, tuple) else (index,)
            if t.dim() > 0 and len(ints) == t.dim() and all(
                    isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ints):
                return ("x[i] = a Python number into one element: a CPU scalar copied to the device (not "
                        "non_blocking: torch synchronizes the stream; a one-element slice is filled instead)")
            return None

        self._wrap(torch.Tensor, "__setitem__", setitem)
        self._wrap(torch.cuda, "synchronize", lambda *a, **k: "torch.cuda.synchronize()")
        self._wrap(torch.cuda.Stream, "synchronize", lambda *a, **k: "Stream.synchronize()")
        self._wrap(torch.cuda.Event, "synchronize", lambda *a, **k: "Event.synchronize()")
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._patched):
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._patched.clear()


def _main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the waits of a cached module's steps per call site (benchmarks/NOTES-gpu.md)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m tbegen._sync_audit", description=_main.__doc__)
    parser.add_argument("--algorithm", default="lru", choices=["lru", "lfu"])
    parser.add_argument("--steps", type=int, default=20, help="steps run first (not counted)")
    parser.add_argument("--measure", type=int, default=5, help="steps counted (their mean is printed)")
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--bag", type=int, default=8)
    parser.add_argument("--load-factor", type=float, default=0.05)
    parser.add_argument("--widths", default="", help="comma-separated dims per table (mixed widths)")
    parser.add_argument("--pipelined", action="store_true",
                        help="prefetch the next batch between each forward and its backward (TorchRec's pipeline)")
    args = parser.parse_args(argv)

    from .module import TableBatchedEmbeddingBags

    dims = [int(d) for d in args.widths.split(",")] if args.widths else [args.dim] * args.tables
    tables = [(args.rows, d) for d in dims]
    emb = TableBatchedEmbeddingBags(tables, optimizer="sgd", placements="managed_caching",
                                    cache_load_factor=args.load_factor, cache_algorithm=args.algorithm)
    g = torch.Generator().manual_seed(0)
    probs = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.1
    n = len(tables) * args.batch * args.bag

    def batch():
        idx = torch.multinomial(probs, n, replacement=True, generator=g)
        offsets = torch.arange(0, n + 1, args.bag)
        return idx, offsets

    grad = torch.ones(args.batch, sum(dims))
    for _ in range(args.steps):
        emb(*batch()).backward(grad)
    data = [batch() for _ in range(args.measure + 1)]
    if args.pipelined:
        emb.prefetch(*data[0])
    with SyncAudit() as audit:
        for k, (idx, offsets) in enumerate(data[:-1]):
            audit.mark(f"step {k}: forward (prepare)")
            out = emb(idx, offsets)
            if args.pipelined:
                audit.mark(f"step {k}: forward (prefetch of the next batch)")
                emb.prefetch(*data[k + 1])
            audit.mark(f"step {k}: backward")
            out.backward(grad)
    forward = [e for name, ev in audit.sections.items() if "forward" in name for e in ev]
    backward = [e for name, ev in audit.sections.items() if "backward" in name for e in ev]
    print(f"{len(tables)} tables x {args.rows} rows, dims {sorted(set(dims))}, {args.algorithm}, cache "
          f"{args.load_factor:g}, {n} indices per step{', pipelined' if args.pipelined else ''}, {args.measure} "
          f"steps after {args.steps}: host waits "
          f"per step {len(forward) / args.measure:g} in the forward (the cache's prepare), "
          f"{len(backward) / args.measure:g} in the backward")
    print("forward, per call site (all counted steps):")
    print(audit.report(forward))
    if backward:
        print("backward, per call site:")
        print(audit.report(backward))
    stats = emb.cache_stats()
    print(f"hit rate {stats['hit_rate']:.3f}, rows loaded {stats['rows_loaded']}, evictions {stats['evictions']}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
