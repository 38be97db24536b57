"""Named ranges around the phases of a cached step, for profiles and timelines (off by default).

`span(name)` is a context manager: while ranges are on (`TBEGEN_RANGES=1`, or `enable(True)`),
it opens a torch.profiler range (`record_function`: in a torch.profiler trace it is a CPU range,
and a `gpu_user_annotation` range over the kernels it issued, on their stream) and, on a machine
with CUDA, an NVTX range (for `nsys profile -t cuda,nvtx`); every listener (`listen`) is told of
its begin and end (benchmarks/cache_timeline.py records the order of the phases, the streams'
waits and the host's waits on the CPU). While off, `span` returns one shared do-nothing context:
no range, no allocation, a few hundred nanoseconds a call.

The names (tbegen/module.py, tbegen/cache.py): tbegen.forward (a forward's kernels),
tbegen.backward (the fused backward), tbegen.prefetch, tbegen.cache.lookup (RowCache.prepare),
tbegen.cache.host_wait (the host reads the batch's summary), tbegen.cache.fill (victims, evictions,
loads), tbegen.cache.writeback (evicted rows issued towards the backing store), tbegen.cache.load
(missed rows copied into their slots), tbegen.cache.drop, tbegen.cache.warm (around the fill of a
prefetch that warms the cache instead of deferring: LRU's default, TBEGEN_CACHE_PREFETCH_WARM).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List

import torch

from ._env import env_flag

__all__ = ["span", "enable", "enabled", "listen"]


def _from_env() -> bool:
    return env_flag("TBEGEN_RANGES", False)


_on = _from_env()
_listeners: List[Callable[[str, str], None]] = []
_NULL = contextlib.nullcontext()


def enable(on: bool = True) -> None:
    """Turns the ranges on or off (for the whole process)."""
    global _on
    _on = bool(on)


def enabled() -> bool:
    return _on


def listen(callback: Callable[[str, str], None]) -> Callable[[], None]:
    """Calls callback(name, "begin" | "end") at each range's begin and end while ranges are on;
    returns a function that removes it."""
    _listeners.append(callback)
    return lambda: _listeners.remove(callback) if callback in _listeners else None


def _nvtx():
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.nvtx
    except (AttributeError, RuntimeError):
        return None


class _Span:
    __slots__ = ("name", "record", "nvtx")

    def __init__(self, name: str):
        self.name = name
        self.record = torch.autograd.profiler.record_function(name)
        self.nvtx = _nvtx()

    def __enter__(self):
        self.record.__enter__()
        if self.nvtx is not None:
            self.nvtx.range_push(self.name)
        for callback in list(_listeners):
            callback(self.name, "begin")
        return self

    def __exit__(self, *exc):
        for callback in list(_listeners):
            callback(self.name, "end")
        if self.nvtx is not None:
            self.nvtx.range_pop()
        self.record.__exit__(*exc)
        return False


def span(name: str):
    """A range named `name` while ranges are on, else a shared do-nothing context."""
    return _Span(name) if _on else _NULL
