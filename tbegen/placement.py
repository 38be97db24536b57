"""Where a module's tables live: the `placements` argument of TableBatchedEmbeddingBags.

    "device"           weights and optimizer states in GPU memory (the default)
    "managed"          weights and optimizer states in CUDA managed (unified) memory, preferred in
                       host memory and mapped for the GPU, which reads and writes them in place:
                       the table may be larger than GPU memory
    "managed_caching"  weights and optimizer states in managed memory as with "managed" (the
                       backing store), behind a cache of hot rows in GPU memory that the kernels
                       read and update (tbegen/cache.py)
    "host"             weights and optimizer states in page-locked host memory mapped for the
                       GPU (FBGEMM's uvm_host_mapped): the kernels read and write them in place
                       over the interconnect and the pages never move. When every table of a GPU
                       module is "host", its buffers are such memory (host_empty); in a module
                       that mixes "host" with other placements the buffers are managed memory and
                       "host" tables are hinted exactly as "managed" ones (preferred in host
                       memory, mapped for the GPU: the same access, only the allocator differs)

TBEGEN_CACHE_BACKING (read each time a module allocates its buffers on a GPU) picks the host
memory of the host-resident rows: unset (or "managed") as above; "host-huge" (issue 27, opt-in)
page-locked host memory in 2 MB pieces, which the GPU translates with far fewer page-table walks
when it reads or writes scattered rows: a module whose tables are all "host" allocates its
buffers with host_empty_huge (an anonymous mapping advised into transparent huge pages before its
first touch, then registered with CUDA: memory_kind "host-huge"), and a module with
managed_caching tables with split_empty (one virtual range of CUDA's virtual memory API whose
2 MB chunks are page-locked host memory for the host-preferred tables and GPU memory for device
tables and the cache region: memory_kind "split"; nothing migrates, no hints). Other modules
(managed tables without a cache) keep managed memory. Only where the bytes live changes: the
kernels, the cache and every result are the same, bit for bit.

How managed tables meet the kernels (docs/placements.md): the GPU kernels take one flat weights
buffer and one buffer per optimizer state, with every table at its offset. A module with at least
one managed table on a GPU therefore allocates each of those buffers whole in managed memory
(the runtime operator managed_empty, include/tbegen/managed_memory.h) and gives each table's
range its own hint: managed tables preferred in host memory (the GPU maps them), device tables
preferred in GPU memory (and prefetched there). The kernels, unchanged, see one device pointer
per buffer; which memory a table's pages sit in is the driver's business. A module whose tables
are all "device" allocates exactly as before (ordinary device tensors).

A module with managed_caching tables adds a cache region after the tables in every buffer,
hinted like a device table (tbegen/cache.py); its tables' ranges are hinted like managed ones.

On the CPU every buffer is host memory already: "managed" is accepted there and means just that,
so that a model configured with placements runs unchanged (and bitwise the same) on the CPU.
"managed_caching" runs its cache logic over the host buffers (the cache region is host memory
too): the same code and the same numbers as on a GPU, so CI exercises it. A CPU buffer of 4 MB
or more is advised into transparent huge pages (`advise_huge_pages`, Linux): the lookups and the
update jump between rows of hundreds of megabytes, and with 4 KB pages a good part of their time
is page walks (benchmarks/NOTES-cpu.md: forward -15%, backward -8% at CPU-2). TBEGEN_HUGE_PAGES=0
leaves the buffers as torch allocates them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ._env import env_choice

__all__ = ["PLACEMENTS", "CACHE_BACKINGS", "check_placements", "cache_backing", "allocate", "memory_kind",
           "huge_page_share"]

PLACEMENTS = ("device", "managed", "managed_caching", "host")
# Placements whose tables live in host memory that the GPU maps (on a GPU).
HOST_PREFERRED = ("managed", "managed_caching", "host")


def check_placements(placements: Union[None, str, Sequence[str]], num_tables: int, *,
                     dense_gradient: bool = False, optimizer: str = "") -> Tuple[str, ...]:
    """One placement per table, checked: None means every table "device"; a single string applies
    to every table; otherwise a list with one entry per table."""
    if placements is None:
        return ("device",) * num_tables
    if isinstance(placements, str):
        placements = [placements] * num_tables
    elif isinstance(placements, bytes) or not isinstance(placements, Sequence):
        raise TypeError(
            f"tbegen: placements must be a list with one placement per table (or one placement for all), "
            f"got {type(placements).__name__}"
        )
    placements = list(placements)
    if len(placements) != num_tables:
        raise ValueError(
            f"tbegen: placements has {len(placements)} entries but the module has {num_tables} table(s); "
            f"give one placement per table, or one string for all"
        )
    for t, p in enumerate(placements):
        if not isinstance(p, str) or p not in PLACEMENTS:
            raise ValueError(f"tbegen: placements[{t}] must be one of {list(PLACEMENTS)}, got {p!r}")
    for p in HOST_PREFERRED:
        if dense_gradient and p in placements:
            raise ValueError(
                f"tbegen: placement {p!r} with optimizer {optimizer!r} (dense gradients): the dense weight "
                f"gradient would be an ordinary device tensor as large as every table, which defeats a "
                f"host-resident table; use a fused optimizer, or placement 'device'"
            )
    return tuple(placements)


# TBEGEN_CACHE_BACKING's values: "managed" (the default, also when unset or empty) and "host-huge"
CACHE_BACKINGS = ("managed", "host-huge")


def cache_backing() -> str:
    """TBEGEN_CACHE_BACKING, checked: "managed" (unset or empty) or "host-huge"."""
    return env_choice("TBEGEN_CACHE_BACKING", CACHE_BACKINGS, "managed memory")


# TBEGEN_CACHE_ROW_STATES's values: where the per-row optimizer states (rowwise_adagrad's momentum:
# one element per row) of managed_caching tables live
CACHE_ROW_STATES = ("auto", "device", "cached")


def cache_row_states() -> str:
    """TBEGEN_CACHE_ROW_STATES, checked: "auto" (unset or empty), "device" or "cached"."""
    return env_choice("TBEGEN_CACHE_ROW_STATES", CACHE_ROW_STATES, "auto")


def row_states_on_device(row_state_bytes: int, cache_bytes: int) -> bool:
    """Whether the per-row states of a module's managed_caching tables live whole in GPU memory
    (their backing rows with their cache slots) instead of behind the cache in host memory.

    A per-row state is a few bytes a row (4 for rowwise_adagrad's momentum, against a row's D
    elements), so its fill moves one tiny transfer each way per victim: measured on the H100
    (docs/gpu-runs/2026-12-05-landing13, C2 at a 20% cache) the states' exchange took 1.68 ms a
    step for 6 MB, against 10.0 ms for the rows' 806 MB, because the link's cost is per transfer,
    not per byte. Kept on the device, the same exchange is a copy within GPU memory and the
    kernels read and update them there; the results are the same bit for bit (only where the
    bytes live changes). "auto" (the default) keeps them on the device where all of them take at
    most a quarter of the GPU memory the cache's own rows take (`cache_bytes`; C2: 128 MB of
    momentum beside 3.3 GB of cached rows at 20%, 0.8 GB at 5%), "device" always, "cached" never."""
    choice = cache_row_states()
    if choice == "auto":
        return 4 * int(row_state_bytes) <= int(cache_bytes)
    return choice == "device"


def buffer_memory(placements: Sequence[str], device: torch.device) -> Optional[str]:
    """What the module's buffers are allocated in (as memory_kind names it), on a GPU with some
    table in host memory: "host" (page-locked, mapped) when every table is "host", else
    "managed"; with TBEGEN_CACHE_BACKING=host-huge, "host-huge" for every table "host" and
    "split" for a module with managed_caching tables. None for ordinary tensors (the CPU, or
    every table "device"). The variable is read (and a bad value refused) wherever some table is
    host-resident, on the CPU too, where it changes nothing."""
    if not any(p in HOST_PREFERRED for p in placements):
        return None
    huge = cache_backing() == "host-huge"
    if device.type != "cuda":
        return None
    if all(p == "host" for p in placements):
        return "host-huge" if huge else "host"
    return "split" if huge and "managed_caching" in placements else "managed"


def needs_managed(placements: Sequence[str], device: torch.device) -> bool:
    """Whether the module's buffers are allocated by tbegen (managed or mapped host memory) rather
    than as ordinary tensors."""
    return buffer_memory(placements, device) is not None


def _managed_ops(ops):
    if not hasattr(ops, "managed_empty"):
        raise RuntimeError(
            "tbegen: this extension was built without CUDA, so it has no managed-memory operators; "
            "placement 'managed' on a GPU needs the CUDA build"
        )
    return ops


def allocate(ops, numel: int, dtype: torch.dtype, device: torch.device, placements: Sequence[str],
             ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """An uninitialised 1-D buffer of `numel` elements for tables whose elements are `ranges`
    ((start, count) per table, in table order): an ordinary tensor on `device`, or, where
    `needs_managed`, one managed allocation with each table's range hinted to its placement.

    Host-preferred ranges are hinted first and device-preferred ones last: the driver applies
    hints to whole pages, and a page shared by a managed and a device table is then preferred on
    the device (the few bytes of the managed table in it are read from GPU memory)."""
    memory = buffer_memory(placements, device)
    if memory is None:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        if buffer.device.type == "cpu":
            advise_huge_pages(buffer)
        return buffer
    ops = _managed_ops(ops)
    if memory == "host":
        return ops.host_empty(numel, dtype, device)
    if memory == "host-huge":
        return ops.host_empty_huge(numel, dtype, device)
    if memory == "split":
        return ops.split_empty(numel, dtype, device, split_device_ranges(placements, ranges))
    buffer = ops.managed_empty(numel, dtype, device)
    for location in ("host", "device"):
        for placement, (start, count) in zip(placements, ranges):
            if (placement in HOST_PREFERRED) == (location == "host"):
                ops.managed_advise(buffer, start, count, location)
    return buffer


def split_device_ranges(placements: Sequence[str], ranges: Sequence[Tuple[int, int]]) -> List[int]:
    """split_empty's device_ranges: the (start, count) of every range whose placement is not
    host-resident ("device" tables and the cache region), flattened; every chunk of the buffer
    that none of them touches is host memory."""
    out: List[int] = []
    for placement, (start, count) in zip(placements, ranges):
        if placement not in HOST_PREFERRED:
            out += [int(start), int(count)]
    return out


# 2 MB huge pages; buffers from twice that size are advised (a smaller one would get a huge page
# only where one falls inside it whole)
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # (linux/mman.h)


@functools.lru_cache(maxsize=None)
def _libc_madvise():
    """libc's madvise, or None where there is none to call (not Linux, or switched off)."""
    if not sys.platform.startswith("linux") or os.environ.get("TBEGEN_HUGE_PAGES", "1") == "0":
        return None
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Asks Linux to back the 2 MB-aligned part of a fresh (not yet written) CPU buffer with
    transparent huge pages, where the system lets programs ask (transparent_hugepage "madvise" or
    "always"; with "never" the advice has no effect). Only a hint: the contents and every result
    are the same with or without it, and a refusal is ignored. True where the advice was taken."""
    madvise = _libc_madvise()
    nbytes = buffer.numel() * buffer.element_size()
    if madvise is None or nbytes < 2 * _HUGE_PAGE:
        return False
    start = buffer.data_ptr()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (start + nbytes - first) // _HUGE_PAGE * _HUGE_PAGE
    return length > 0 and madvise(first, length, _MADV_HUGEPAGE) == 0


def huge_page_share(address: int, nbytes: int, smaps: str = "/proc/self/smaps") -> Optional[float]:
    """The share of this process's mappings that overlap [address, address + nbytes) that Linux
    backs with transparent huge pages (AnonHugePages over Size, summed over those mappings, from
    /proc/self/smaps), or None where that cannot be read (not Linux) or no mapping overlaps (GPU
    memory, or memory the CUDA driver maps for itself). Whole mappings are counted: a buffer of
    host_empty_huge is one mapping of its own (Linux may merge it with a neighbour of the same
    kind). For registered host memory a CUDA tensor's data_ptr is the host address (unified
    addressing on 64-bit Linux). A hint only, as the pages themselves are."""
    try:
        with open(smaps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    end = address + max(nbytes, 1)
    size = huge = 0
    inside = False
    found = False
    for line in lines:
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and address < hi
            found = found or inside
        elif inside and head == "Size:":
            size += int(line.split()[1]) * 1024
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1]) * 1024
    if not found or size == 0:
        return None
    return huge / size


def memory_kind(ops, tensor: torch.Tensor) -> str:
    """What backs a tensor: "managed", "device", "host" (page-locked), "host-huge" (page-locked,
    from host_empty_huge), "split" (split_empty: host and GPU memory in one virtual range),
    "unregistered" (pageable host memory), or "cpu" for a CPU tensor (no CUDA query)."""
    if tensor.device.type == "cpu":
        return "cpu"
    return _managed_ops(ops).memory_kind(tensor)


def preferred_locations(ops, tensor: torch.Tensor, ranges: Sequence[Tuple[int, int]]) -> List[Optional[str]]:
    """Per (start, count) range of a managed tensor, the preferred location its pages share:
    "host", "device", or None (no hint, or its pages disagree)."""
    out: List[Optional[str]] = []
    for start, count in ranges:
        loc = int(_managed_ops(ops).managed_preferred_location(tensor, start, count))
        out.append("host" if loc == -1 else "device" if loc == tensor.device.index else None)
    return out
