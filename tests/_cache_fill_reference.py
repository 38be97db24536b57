# FROZEN REFERENCE (tests only): tbegen/cache.py as of commit 02e0adc (before the fill's victims
# came from a per-table selection instead of a sort of every slot, and _move computed its positions
# with fewer operators), kept verbatim below this note (only its two relative imports made absolute)
# so that tests/test_cache_fill_ops.py can run the previous fill beside the new one and require the
# same victims, cache state, statistics and moved bits. Do not edit it; it is not imported by tbegen.
"""The row cache of placement "managed_caching": host-resident tables behind a cache of hot rows.

Design (docs/placements.md, "managed_caching"): the kernels are not changed. Every flat buffer
(the weights and each optimizer state) is allocated with a *cache region* after the module's
tables: table t's full rows stay at their usual offsets (in managed memory on a GPU, preferred in
host memory: the backing store), and its `cache_rows[t]` cache slots sit in the region (preferred
in GPU memory). The kernels' feature table (`features`) points a cached table's features at its
slots: weights offset = its slots' offset, rows = its number of slots, key base = its first slot's
key after the tables' keys (so per-row states are cached with the rows). Before the kernels run,
`RowCache.prepare` makes every row a batch touches resident (loading missing rows with their
states, evicting the coldest rows, writing back dirty ones) and rewrites the batch's indices of
cached tables into slot numbers. The forward and the fused backward then read and update the
cached rows in place, exactly as they update a device table's rows.

int8 rows (weights_dtype "int8"): the weights buffer is bytes, the row of element offset o and
key k being the D + 8 bytes (codes, float32 scale and bias) from byte o + 8k. The slots follow the
same rule (their element offsets and keys are those above), so the cache region of the weights
holds 8 more bytes per slot key, and a row moves as its D + 8 bytes ("int8 rows" buffers, _move).

The cache is fully associative per table, with exact LRU or LFU replacement: a table's map from
row to slot is a dense int32 array (4 bytes per row of the table, on the module's device), so a
lookup is a gather, there are no conflict misses, and the victims are the globally coldest slots
(a stable sort of the slots' scores, ties broken by slot number: deterministic). Everything is
torch tensor operations on the module's device, so the same code serves CUDA and the CPU (where
CI exercises it). On CUDA the host waits for the device once per batch, to read the batch's
summary (prepare); every other size is known to the host (tests/test_cache_syncs.py counts the
waits with tbegen/_sync_audit.py).

A batch whose distinct rows of a table outnumber that table's cache slots ("overflow") is not
refused: for that batch the table *bypasses* its cache. Its cached rows are written back and its
cache emptied, and the batch's feature table points that table's features at its backing rows
(as for placement "managed"), so the kernels read and update them in managed memory directly, with
the indices as given. The module warns once per table; `cache_stats()` counts the bypasses.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from tbegen._ranges import span
from tbegen.int8 import QPARAM_BYTES

__all__ = ["CACHE_ALGORITHMS", "cache_sizes", "RowCache", "Ticket"]

CACHE_ALGORITHMS = ("lru", "lfu")

# Moved rows are copied in chunks of at most this many elements (bounds the index tensors).
_CHUNK_ELEMENTS = 1 << 24
_NEVER = torch.iinfo(torch.int64).max  # the score of a slot that may not be evicted
_TICK_LIMIT = 1 << 40  # LRU sorts (table, last use) as one int64 while fewer batches were seen
# prepare's sort keys of the indices it does not look up, after every row's key (num_rows + these):
# out of range of a direct table (the kernels read -1), out of range of a compact table, and
# every other one (not of a cached table, or of a table bypassing its cache: kept as given)
_SENT_DIRECT_BAD, _SENT_KEEP_BAD, _SENT_KEEP = 0, 1, 2


def _copy_or_stage(view: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, staged: Optional[list]) -> None:
    """view[dst] = rows (whole rows), now or, with `staged`, appended to it for later."""
    if staged is None:
        view.index_copy_(0, dst, rows)
    else:
        staged.append((view, dst, rows))


def _wide_rows(view: torch.Tensor) -> torch.Tensor:
    """The same rows, their bytes seen as 16-byte elements where they divide into them (and start
    16-byte aligned): a row copy then moves 16 bytes per element, not 2 or 4 (the copies are of
    bits, never of values, so the element type does not matter)."""
    row_bytes = view.shape[1] * view.element_size()
    if row_bytes % 16 == 0 and view.data_ptr() % 16 == 0:
        return view.view(torch.uint8).view(torch.complex128)
    return view


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def cache_sizes(tables: Sequence[Tuple[int, int]], placements: Sequence[str],
                cache_rows: Union[None, int, Sequence[Optional[int]]], cache_load_factor: float) -> List[int]:
    """Cache slots of each table (0 for tables that are not "managed_caching").

    `cache_rows`: one int for every cached table, or a list with one entry per table (None or
    ignored for tables that are not cached); at most the table's rows (larger is capped). Without
    it, `cache_load_factor` (0 < f <= 1) of each cached table's rows, rounded up."""
    if isinstance(cache_load_factor, bool) or not isinstance(cache_load_factor, numbers.Real) or not (
        0.0 < float(cache_load_factor) <= 1.0
    ):
        raise ValueError(f"tbegen: cache_load_factor must be a number in (0, 1] (the fraction of a cached table's rows "
                         f"its cache holds), got {cache_load_factor!r}")
    n = len(tables)
    if cache_rows is None:
        per_table: List[Optional[int]] = [None] * n
    elif _is_int(cache_rows):
        per_table = [int(cache_rows)] * n
    elif isinstance(cache_rows, Sequence) and not isinstance(cache_rows, (str, bytes)):
        if len(cache_rows) != n:
            raise ValueError(f"tbegen: cache_rows has {len(cache_rows)} entries but the module has {n} table(s); "
                             f"give one int for every cached table, or one entry per table")
        per_table = list(cache_rows)
    else:
        raise TypeError(f"tbegen: cache_rows must be an int or a list with one entry per table, got {cache_rows!r}")
    out = []
    for t, ((E, _), p) in enumerate(zip(tables, placements)):
        if p != "managed_caching":
            out.append(0)
            continue
        c = per_table[t]
        if c is None:
            c = max(1, math.ceil(E * float(cache_load_factor)))
        elif not _is_int(c) or c < 1:
            raise ValueError(f"tbegen: cache_rows for table {t} must be a positive int, got {c!r}")
        out.append(min(int(c), E))
    return out


@dataclass
class Ticket:
    """What `prepare` did for one batch: the indices the kernels read (cached tables' rows
    rewritten into slot numbers), the batch's slots (marked dirty by a backward), and the cache's
    epoch then (the slot numbers stay valid while no row has been evicted since)."""

    indices: torch.Tensor
    slots: torch.Tensor
    epoch: int
    original: torch.Tensor  # the indices as given (to prepare again if the epoch moved on)
    offsets: torch.Tensor
    features: torch.Tensor  # the kernels' feature table for this batch
    bypass: Tuple[int, ...] = ()  # cached tables (0..nc-1) this batch reads in their backing rows
    # the cache's hard epoch then (moves when rows may leave the cache whatever their holds), and
    # whether the batch reads some rows in their backing rows: a held ticket without backing reads
    # stays valid while the hard epoch holds (RowCache.hold)
    hard_epoch: int = 0
    backing: bool = True


class RowCache:
    """The cache state of a module's managed_caching tables, on the module's device.

    Geometry: the cached tables c = 0..nc-1 (module tables `tables[c]`, in table order) have
    E[c] rows of D[c] columns and C[c] slots. In the flat buffers their backing rows start at
    `layout.table_offsets` / `layout.table_key_base` and their slots at `slot_woff[c]` (elements,
    after every table) / `slot_kbase[c]` (row keys, after every table's keys). Global numbering:
    cached row g = rbase[c] + row, slot s = sbase[c] + local slot.
    """

    def __init__(self, layout, placements: Sequence[str], sizes: Sequence[int], algorithm: str,
                 element_sizes: Sequence[int], row_sizes: Sequence[int], device: torch.device,
                 row_copy=None, row_exchange=None):
        if algorithm not in CACHE_ALGORITHMS:
            raise ValueError(f"tbegen: cache_algorithm must be one of {list(CACHE_ALGORITHMS)}, got {algorithm!r}")
        self.algorithm = algorithm
        self.tables = [t for t, p in enumerate(placements) if p == "managed_caching"]
        if not self.tables:
            raise ValueError("tbegen: a row cache needs at least one 'managed_caching' table")
        self.rows = [layout.tables[t][0] for t in self.tables]
        self.dims = [layout.tables[t][1] for t in self.tables]
        self.slots = [int(sizes[t]) for t in self.tables]
        self.num_slots = sum(self.slots)
        self.num_rows = sum(self.rows)
        # bytes a row moves with (weights, element states, row states), per cached table
        self.row_bytes = [D * sum(element_sizes) + sum(row_sizes) for D in self.dims]
        back_woff = [layout.table_offsets[t] for t in self.tables]
        back_kbase = [layout.table_key_base[t] for t in self.tables]
        # Where each table's slots go, after every table (w: elements, k: row keys). A "direct"
        # table's slots sit where its rows would continue: slot s is virtual row vbase + s of the
        # table (slot_woff = back_woff + vbase * D, slot_kbase = back_kbase + vbase), so that one
        # feature table reaches its backing rows (0..E-1) and its slots (vbase..vbase+C-1): a
        # batch then reads rows that did not fit in the cache from the backing store (see
        # prepare). That needs padding where the widths of the tables after it differ from its
        # own; a table whose padding would cost more than its cache region is "compact" (slots
        # packed, features pointed at the slots only; rows that do not fit: bypass).
        slot_woff, slot_kbase, vbase, direct, sbase, rbase = [], [], [], [], [], []
        w, k, s, r = layout.weights_numel, layout.total_hash_size, 0, 0
        elem_bytes, key_bytes = sum(element_sizes), sum(row_sizes)
        for E, D, C, bw, bk, rb in zip(self.rows, self.dims, self.slots, back_woff, back_kbase, self.row_bytes):
            v = max(-(-(w - bw) // D), k - bk)
            pad_w, pad_k = bw + v * D - w, bk + v - k
            if pad_w * elem_bytes + pad_k * key_bytes <= C * rb:
                direct.append(True)
                vbase.append(v)
                slot_woff.append(bw + v * D)
                slot_kbase.append(bk + v)
            else:
                direct.append(False)
                vbase.append(0)
                slot_woff.append(-(-w // 4) * 4)  # (a multiple of 4, as the CUDA 4-wide kernels want)
                slot_kbase.append(k)
            sbase.append(s)
            rbase.append(r)
            w, k, s, r = slot_woff[-1] + C * D, slot_kbase[-1] + C, s + C, r + E
        self.weights_tail = w - layout.weights_numel  # elements after the tables
        self.keys_tail = k - layout.total_hash_size  # row keys after the tables' keys
        self.direct = direct
        # a direct table's slots are indices past its rows: int32 indices may not reach them
        self.needs_int64 = max(v + C for v, C in zip(vbase, self.slots)) >= 2 ** 31
        self._host = dict(
            E=self.rows, D=self.dims, C=self.slots, back_woff=back_woff, back_kbase=back_kbase,
            slot_woff=slot_woff, slot_kbase=slot_kbase, sbase=sbase, rbase=rbase,
            # what a resident row's index becomes: its slot plus this
            index_base=[v if d else 0 for v, d in zip(vbase, direct)],
            direct=[int(d) for d in direct],
            rbase_end=rbase + [self.num_rows],  # (each table's first row key, then the end)
            row_bytes=self.row_bytes,
        )
        cached_of_table = {t: c for c, t in enumerate(self.tables)}
        # per feature, its cached table (or -1); padded with -1 at both ends (see prepare)
        self._feature_cached = [-1] + [cached_of_table.get(t, -1) for t in layout.feature_table_map] + [-1]
        self.epoch = 0
        self.hard_epoch = 0
        self._held: List[Ticket] = []
        # holds were let go since the last move that waited for the kernels reading held batches
        # (a prefetch's lookup does not wait for them: _before_unheld_move)
        self._unheld = False
        # batches in flight that read some rows in their backing rows (never held: any row moved
        # into the cache invalidates them), for a prefetch to leave them alone (prepare's `defer`)
        self._in_flight_backing: List[Ticket] = []
        self.tick = 0
        self._warned = set()
        self.stats = self._zero_stats()
        # The CUDA extension's _copy_rows operator (managed_memory.h), or None: the rows then move
        # with torch's index kernels. Used on CUDA unless TBEGEN_CACHE_ROW_COPY=0 (see _copy_blocks).
        self._row_copy_op = row_copy
        # Its _exchange_rows operator, or None: with TBEGEN_CACHE_EXCHANGE=1 a fill writes each
        # victim's old row back and loads the new one in one kernel per buffer (see _exchange_grid).
        self._exchange_op = row_exchange
        # LFU: at least every access count (the sum of all counted accesses; the counts only grow
        # and are kept across moves): bounds the victim order's sort key
        self._count_bound = 0
        self._allocate(device)

    # ---- the kernels' view: a cached table's features point at its slots ----

    def compute_features(self, features: torch.Tensor, layout) -> torch.Tensor:
        """The kernels' feature table: `features` (layout.features_tensor) with each cached
        table's features pointed at its slots."""
        out = features.clone()
        h = self._host
        for f, t in enumerate(layout.feature_table_map):
            c = self._feature_cached[f + 1]
            if c >= 0 and self.direct[c]:  # backing rows, then (after padding) the slots
                out[f, 1] = h["index_base"][c] + h["C"][c]  # kFeatRows
            elif c >= 0:
                out[f, 0] = h["slot_woff"][c]  # kFeatWeightsOffset
                out[f, 1] = h["C"][c]  # kFeatRows
                out[f, 4] = h["slot_kbase"][c]  # kFeatKeyBase
        self._features = {(): out, "tables": features.clone()}
        return out

    def table_features(self) -> torch.Tensor:
        """The feature table of the tables themselves (every feature reading its table's rows,
        none its cache slots): what the whole-table reduce stages walk."""
        return self._features["tables"]

    def _features_for(self, bypass: Tuple[int, ...]) -> torch.Tensor:
        """The feature table of a batch whose cached tables `bypass` read their backing rows."""
        out = self._features.get(bypass)
        if out is None:
            mask = torch.tensor([c in bypass for c in self._feature_cached[1:-1]], device=self.device)
            out = torch.where(mask[:, None], self._features["tables"], self._features[()])
            if len(self._features) >= 18:  # (kept: the two base tables and the 16 latest)
                del self._features[next(k for k in self._features if k not in ((), "tables"))]
            self._features[bypass] = out
        return out

    # ---- state ----

    def _allocate(self, device: torch.device) -> None:
        self.device = device
        h = self._host
        if hasattr(self, "_features"):
            self._features = {k: v.to(device) for k, v in self._features.items() if k in ((), "tables")}

        def t(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._t = {k: t(v) for k, v in h.items()}
        self._feature_cached_t = t(self._feature_cached)
        self._slot_table = torch.repeat_interleave(torch.arange(len(self.tables), device=device), self._t["C"])
        # prepare's per-feature tables (padded as _feature_cached: indexed by feature + 1): the first
        # row key of the feature's cached table (0 if none), its rows (0 if none: no index is valid),
        # and the sort key of an index that is not looked up (see prepare)
        nr = self.num_rows
        fc = self._feature_cached
        # sort keys in 32 bits while the rows and the three not-looked-up keys fit (the radix sort
        # then makes half the passes); the per-feature tables in that type too (their gathers
        # over the N indices then write half the bytes)
        self._key_type = torch.int32 if nr + _SENT_KEEP < 2 ** 31 else torch.int64
        kt = self._key_type
        self._f_rbase = torch.tensor([h["rbase"][c] if c >= 0 else 0 for c in fc], dtype=kt, device=device)
        self._f_rows = torch.tensor([h["E"][c] if c >= 0 else 0 for c in fc], dtype=kt, device=device)
        self._f_sent = torch.tensor([nr + (_SENT_DIRECT_BAD if self.direct[c] else _SENT_KEEP_BAD) if c >= 0
                                     else nr + _SENT_KEEP for c in fc], dtype=kt, device=device)
        # the sorted keys' boundaries: each table's first key, then the three not-looked-up keys
        self._edge_keys = torch.tensor(h["rbase"] + [nr + _SENT_DIRECT_BAD, nr + _SENT_KEEP_BAD, nr + _SENT_KEEP],
                                       dtype=self._key_type, device=device)
        # each table's first key after the first table's, then the end: searchsorted(right) of a
        # looked-up key in it is the key's table
        self._table_ends = torch.tensor(h["rbase"][1:] + [nr], dtype=self._key_type, device=device)
        self._slot_bounds = t(h["sbase"] + [self.num_slots])  # each table's first slot, then the end
        self._true1 = torch.ones(1, dtype=torch.bool, device=device)
        self._row_and_bytes = t([1, self.row_bytes[0]])  # (a written-back row, where every row moves as many bytes)
        self._iotas: Dict[torch.dtype, torch.Tensor] = {}  # 0, 1, 2, ... (_iota)
        # local slot of a row (-1: not resident), and -1 for the three not-looked-up keys after
        # the rows (so that a sorted key's slot is one gather, without a clamp)
        self._row_slot_ext = torch.full((nr + _SENT_KEEP + 1,), -1, dtype=torch.int32, device=device)
        self._row_slot = self._row_slot_ext[:nr]
        self._slot_row = torch.full((self.num_slots,), -1, dtype=torch.int64, device=device)  # local row in a slot
        self._last_used = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self._dirty = torch.zeros(self.num_slots, dtype=torch.bool, device=device)
        # kept by the host, so that no batch waits for them: the rows in each table's slots, and
        # whether some slot may be dirty (mark_dirty since the cache was last clean)
        self._occupied = [0] * len(self.tables)
        self._maybe_dirty = False
        self._table_masks: Dict[Tuple[int, ...], torch.Tensor] = {}
        # statistics that the device counts (rows_written_back, bytes_written_back,
        # backing_lookups: read by report), kept across moves
        old_stats = getattr(self, "_device_stats", None)
        self._device_stats = (old_stats.to(device) if old_stats is not None else
                              torch.zeros(3, dtype=torch.int64, device=device))
        if self.algorithm == "lfu":
            old = getattr(self, "_counts", None)
            self._counts = (old.to(device) if old is not None else
                            torch.zeros(self.num_rows, dtype=torch.int64, device=device))
        self._dims = sorted(set(self.dims))
        self._units = self._row_units()
        self._side = None  # the write-back stream (CUDA), made on first use
        self._writeback_pending = False
        self._row_copy_blocks = self._copy_blocks(device)
        self._exchange_blocks = self._exchange_grid(device)

    def _copy_blocks(self, device: torch.device) -> int:
        """The grid bound of each row copy on CUDA (_copy_rows), or 0 where the rows move with
        torch's index kernels (the CPU, and CUDA with TBEGEN_CACHE_ROW_COPY=0, the way back). Half
        the SMs: the loads of missed rows and the write-back of evicted ones then run at the same
        time, one towards the GPU and one towards the host, and each keeps ~1 MB of rows in flight
        (8 warps a block, 4 rows a warp), well above what one direction of the host link needs to
        stay busy. Measured on the H200 (docs/gpu-runs/2026-12-05-landing8, C2 rowwise_adagrad):
        the cached step 39.6 -> 35.3 ms at a 5% cache, 32.5 -> 27.7 at 10%, 25.6 -> 22.3 at 20%."""
        flag = os.environ.get("TBEGEN_CACHE_ROW_COPY", "")
        if flag not in ("", "0", "1"):
            raise ValueError(f"tbegen: TBEGEN_CACHE_ROW_COPY must be 0 or 1 (or unset), got {flag!r}")
        if device.type != "cuda" or self._row_copy_op is None or flag == "0":
            return 0
        return max(1, torch.cuda.get_device_properties(device).multi_processor_count // 2)

    def _exchange_grid(self, device: torch.device) -> int:
        """The grid bound of the fill's exchange (_exchange_rows, row_copy_cuda.cuh), or 0 where the
        fill makes two copies, the write-back on a side stream beside the loads (the default).
        TBEGEN_CACHE_EXCHANGE=1 (opt-in until measured on a GPU: issue 27, benchmarks/NOTES-gpu.md
        "Cache: the fill's two directions in one kernel") on CUDA with the row copy on: each
        victim slot's old row and the row that replaces it move in the same warp, one kernel per
        buffer, on the SMs that the two copies share today (half each). Unset, empty or "0": off;
        anything else is refused. The same rows move either way, bit for bit."""
        flag = os.environ.get("TBEGEN_CACHE_EXCHANGE", "")
        if flag not in ("", "0", "1"):
            raise ValueError(f"tbegen: TBEGEN_CACHE_EXCHANGE must be 0 or 1 (or unset), got {flag!r}")
        if flag != "1" or not self._row_copy_blocks or self._exchange_op is None:
            return 0
        return 2 * self._row_copy_blocks

    def to(self, device: torch.device) -> None:
        """Moves the cache's bookkeeping to `device`, empty (flush first: the slots' contents are
        not carried). The LFU access counts are kept."""
        self._join_writeback()
        self._allocate(device)
        self.epoch += 1
        self._release_all()

    def _zero_stats(self) -> Dict[str, int]:
        return dict(prepares=0, lookups=0, hits=0, unique_rows=0, unique_hits=0, rows_loaded=0,
                    rows_written_back=0, bytes_loaded=0, bytes_written_back=0, evictions=0,
                    bypasses=0, backing_lookups=0, backing_rows=0, deferred=0)

    def reset_stats(self) -> None:
        self.stats = self._zero_stats()
        self._device_stats.zero_()

    def report(self) -> Dict[str, object]:
        s = dict(self.stats)
        for name, value in zip(("rows_written_back", "bytes_written_back", "backing_lookups"),
                               self._device_stats.tolist()):
            s[name] += value
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else float("nan")
        s["unique_hit_rate"] = s["unique_hits"] / s["unique_rows"] if s["unique_rows"] else float("nan")
        s["resident_rows"] = int((self._slot_row >= 0).sum())
        s["dirty_rows"] = int(self._dirty.sum())
        s["cache_rows"] = {t: C for t, C in zip(self.tables, self.slots)}
        s["direct"] = {t: d for t, d in zip(self.tables, self.direct)}
        s["algorithm"] = self.algorithm
        return s

    # ---- moving rows between the backing store and the slots ----

    def _move(self, buffers, c: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, to_slots: bool,
              staged: Optional[list] = None, per_table: Optional[Sequence[int]] = None) -> None:
        """Copies rows (and their states) of cached tables `c` between backing row `rows` and local
        slot `slots`, in every buffer: `buffers` is [(flat tensor, "element" | "row" | "int8 rows")]
        ("int8 rows": the weights of weights_dtype int8, a byte buffer in which the row of element
        offset o and key k is the D + 8 bytes from o + 8k: codes and qparams move together).
        With `staged` (a list), the sources are gathered now and the writes are appended to it as
        (view, destination rows, gathered rows), for `_write_staged` to issue later. With
        `per_table` (how many of the rows are of each cached table, known to the host), the rows
        of each width are picked without a host wait."""
        if rows.numel() == 0:
            return
        T = self._t
        int8_rows = any(per == "int8 rows" for _, per in buffers)
        for D in self._dims:
            if len(self._dims) == 1:
                sel = None
            elif per_table is not None:
                n = sum(k for k, d in zip(per_table, self.dims) if d == D)
                if n == 0:
                    continue
                sel = self._compact(T["D"][c] == D, n)
            else:
                sel = (T["D"][c] == D).nonzero().squeeze(1)
            cc, rr, ss = (c, rows, slots) if sel is None else (c[sel], rows[sel], slots[sel])
            back = T["back_woff"][cc] + rr * D
            slot = T["slot_woff"][cc] + ss * D
            self._copy_runs(buffers, "element", back, slot, D, self._units[("element", D)], to_slots, staged)
            if int8_rows:
                back_bytes = back + QPARAM_BYTES * (T["back_kbase"][cc] + rr)
                slot_bytes = slot + QPARAM_BYTES * (T["slot_kbase"][cc] + ss)
                self._copy_runs(buffers, "int8 rows", back_bytes, slot_bytes, D + QPARAM_BYTES,
                                self._units[("int8 rows", D)], to_slots, staged)
        back = T["back_kbase"][c] + rows
        slot = T["slot_kbase"][c] + slots
        src, dst = (back, slot) if to_slots else (slot, back)
        for buf, per in buffers:
            if per != "row":
                continue
            if not self._row_copy_blocks:
                _copy_or_stage(buf, dst, buf.index_select(0, src), staged)
                continue
            # (CUDA: the per-row states too move with _copy_rows, as rows of one entry, on the
            # bounded grid: index_select / index_copy_ would hold every SM, and the other
            # direction's copy would wait for them)
            view = buf.view(-1, 1)
            if staged is None:
                self._row_copy_op(view, dst, view, src, self._row_copy_blocks)
            else:
                gathered = torch.empty((src.numel(), 1), dtype=buf.dtype, device=buf.device)
                self._row_copy_op(gathered, None, view, src, self._row_copy_blocks)
                staged.append((view, dst, gathered))

    def _row_units(self) -> Dict[Tuple[str, int], int]:
        """For each layout kind and row width D, the largest unit (in entries) that divides every
        cached table's row starts of that width, in its backing rows and in its slots: the buffers
        are then copied as rows of that many entries (a whole row where the layout allows: one
        row-wise gather and one scatter per move), never entry by entry."""
        h = self._host
        units: Dict[Tuple[str, int], int] = {}
        for D in sorted(set(self.dims)):
            mine = [c for c in range(len(self.tables)) if self.dims[c] == D]
            starts = [h["back_woff"][c] for c in mine] + [h["slot_woff"][c] for c in mine]
            units[("element", D)] = math.gcd(D, *starts)
            byte_starts = ([h["back_woff"][c] + QPARAM_BYTES * h["back_kbase"][c] for c in mine]
                           + [h["slot_woff"][c] + QPARAM_BYTES * h["slot_kbase"][c] for c in mine])
            units[("int8 rows", D)] = math.gcd(D + QPARAM_BYTES, *byte_starts)
        return units

    def _copy_runs(self, buffers, kind: str, back: torch.Tensor, slot: torch.Tensor, width: int, unit: int,
                   to_slots: bool, staged: Optional[list] = None) -> None:
        """In every buffer of layout `kind`, copies the runs of `width` entries starting at `back`
        to those starting at `slot` (or the other way round). Every start is a multiple of `unit`,
        which divides `width`: each buffer is viewed as rows of `unit` entries, and the runs move
        as whole rows of that view (index_select, then index_copy_: row-wide copies, no per-entry
        index), in chunks that bound the temporary copy. The slots never overlap the backing rows,
        and each destination run is written once."""
        targets = [buf for buf, per in buffers if per == kind]
        if not targets:
            return
        src, dst = (back, slot) if to_slots else (slot, back)
        per_run = width // unit
        src, dst = src // unit, dst // unit
        if per_run > 1:
            parts = torch.arange(per_run, device=self.device)
            src = (src[:, None] + parts).reshape(-1)
            dst = (dst[:, None] + parts).reshape(-1)
        step = max(1, _CHUNK_ELEMENTS // unit)
        for buf in targets:
            view = _wide_rows(buf[: buf.numel() // unit * unit].view(-1, unit))
            if staged is None and self._row_copy_blocks:  # (CUDA: from row to row, no temporary copy)
                self._row_copy_op(view, dst, view, src, self._row_copy_blocks)
                continue
            for lo in range(0, src.numel(), step):
                _copy_or_stage(view, dst[lo:lo + step], view.index_select(0, src[lo:lo + step]), staged)

    def _exchange(self, buffers, c: torch.Tensor, slots: torch.Tensor, out_rows: Optional[torch.Tensor],
                  in_rows: torch.Tensor, per_table: Sequence[int]) -> None:
        """The fill's moves in one kernel per buffer (TBEGEN_CACHE_EXCHANGE=1 on CUDA: _exchange_rows,
        row_copy_cuda.cuh): for each victim, local slot `slots[i]` of cached table c[i], its old
        row `out_rows[i]` (a local row of the table; -1 where the slot holds none; `out_rows` None:
        nothing is written back) goes to its backing row and backing row `in_rows[i]` arrives in
        the slot, in every buffer. Each warp then keeps both directions of the host link busy,
        with no staging copy of the evicted rows and no side stream. `per_table`: how many of the
        victims are of each cached table (known to the host: the rows of each width are picked
        without a host wait)."""
        if in_rows.numel() == 0:
            return
        T = self._t
        int8_rows = any(per == "int8 rows" for _, per in buffers)
        for D in self._dims:
            if len(self._dims) == 1:
                sel = None
            else:
                n = sum(k for k, d in zip(per_table, self.dims) if d == D)
                if n == 0:
                    continue
                sel = self._compact(T["D"][c] == D, n)
            cc, ss, ii = (c, slots, in_rows) if sel is None else (c[sel], slots[sel], in_rows[sel])
            oo = out_rows if out_rows is None or sel is None else out_rows[sel]
            slot = T["slot_woff"][cc] + ss * D
            back_in = T["back_woff"][cc] + ii * D
            back_out = None if oo is None else torch.where(oo >= 0, T["back_woff"][cc] + oo * D, -1)
            self._exchange_runs(buffers, "element", slot, back_out, back_in, D, self._units[("element", D)])
            if int8_rows:
                q = QPARAM_BYTES
                slot_bytes = slot + q * (T["slot_kbase"][cc] + ss)
                in_bytes = back_in + q * (T["back_kbase"][cc] + ii)
                out_bytes = None if oo is None else torch.where(
                    oo >= 0, T["back_woff"][cc] + oo * D + q * (T["back_kbase"][cc] + oo), -1)
                self._exchange_runs(buffers, "int8 rows", slot_bytes, out_bytes, in_bytes, D + q,
                                    self._units[("int8 rows", D)])
        row_buffers = [buf for buf, per in buffers if per == "row"]
        if row_buffers:
            slot = T["slot_kbase"][c] + slots
            back_in = T["back_kbase"][c] + in_rows
            back_out = None if out_rows is None else torch.where(out_rows >= 0, T["back_kbase"][c] + out_rows, -1)
            for buf in row_buffers:  # (a per-row state: rows of one entry)
                self._exchange_op(buf.view(-1, 1), slot, back_out, back_in, self._exchange_blocks)

    def _exchange_runs(self, buffers, kind: str, slot: torch.Tensor, back_out: Optional[torch.Tensor],
                       back_in: torch.Tensor, width: int, unit: int) -> None:
        """_exchange for the buffers of layout `kind`: the runs of `width` entries at `slot`,
        `back_out` (-1: none) and `back_in`, each buffer viewed as rows of `unit` entries (as
        _copy_runs views them), a run being `width // unit` of those rows."""
        targets = [buf for buf, per in buffers if per == kind]
        if not targets:
            return
        per_run = width // unit
        parts = torch.arange(per_run, device=self.device) if per_run > 1 else None

        def unit_rows(start: torch.Tensor) -> torch.Tensor:
            first = start // unit
            return first if parts is None else (first[:, None] + parts).reshape(-1)

        s, i = unit_rows(slot), unit_rows(back_in)
        o = None
        if back_out is not None:  # (a run without a row to write back stays -1 in all its parts)
            none = back_out < 0
            o = unit_rows(back_out.clamp(min=0))
            o = torch.where(none if parts is None else none[:, None].expand(-1, per_run).reshape(-1), -1, o)
        for buf in targets:
            view = _wide_rows(buf[: buf.numel() // unit * unit].view(-1, unit))
            self._exchange_op(view, s, o, i, self._exchange_blocks)

    # ---- write-back beside the loads (CUDA) ----

    def _write_staged(self, staged: list) -> None:
        """Issues the staged writes (evicted rows, already gathered out of their slots) on a side
        stream, so that they cross the host link towards the host while the loads cross it
        towards the GPU (the link carries both directions at once). The side stream starts after
        the gathers; `_join_writeback` makes the current stream wait for it."""
        if not staged:
            return
        if self.device.type != "cuda":
            for view, dst, rows in staged:
                self._write_rows(view, dst, rows)
            return
        current = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            for view, dst, rows in staged:
                self._write_rows(view, dst, rows)
                dst.record_stream(self._side)  # (freed by the allocator only after the side stream used them)
                rows.record_stream(self._side)
        self._writeback_pending = True

    def _write_rows(self, view: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
        """view[dst] = rows: with _copy_rows on a grid of half the SMs (beside the loads) where
        it is used (1-D rows, of a per-row state, as rows of one entry), else with index_copy_."""
        if self._row_copy_blocks and rows.dim() == 2:
            self._row_copy_op(view, dst, rows, None, self._row_copy_blocks)
        elif self._row_copy_blocks and rows.dim() == 1:
            self._row_copy_op(view.view(-1, 1), dst, rows.view(-1, 1), None, self._row_copy_blocks)
        else:
            view.index_copy_(0, dst, rows)

    def _join_writeback(self) -> None:
        """The current stream waits for the write-backs issued on the side stream (before anything
        reads or writes the backing rows or the slots again)."""
        if self._writeback_pending:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._writeback_pending = False

    def _per_table(self, tables: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per cached table, how many entries of the ascending `tables` it has (or the sum of
        their `weights`): bincount without atomics (deterministic, as torch's deterministic mode
        wants)."""
        edges = torch.searchsorted(tables, torch.arange(len(self.tables) + 1, device=self.device))
        if weights is None:
            return edges[1:] - edges[:-1]
        sums = torch.cat([torch.zeros(1, dtype=weights.dtype, device=self.device), torch.cumsum(weights, 0)])
        return sums[edges[1:]] - sums[edges[:-1]]

    def _bytes(self, per_table: Sequence[int]) -> int:
        return sum(n * b for n, b in zip(per_table, self.row_bytes))

    def flush(self, buffers, tables: Optional[Sequence[int]] = None) -> int:
        """Writes every dirty slot (of cached tables `tables`, default all) back to its row; the
        rows stay resident (clean). Returns the rows written."""
        self._join_writeback()
        dirty = self._dirty if tables is None else self._dirty & self._of_tables(tables)
        dirty = dirty.nonzero().squeeze(1)
        n = dirty.numel()
        if n:
            c = self._slot_table[dirty]
            self._move(buffers, c, self._slot_row[dirty], dirty - self._t["sbase"][c], to_slots=False)
            self._dirty[dirty] = False
            per_table = self._per_table(c).tolist()  # (slots ascend, so their tables do)
            self.stats["rows_written_back"] += n
            self.stats["bytes_written_back"] += self._bytes(per_table)
        if tables is None:
            self._maybe_dirty = False
        return n

    def _of_tables(self, tables: Sequence[int]) -> torch.Tensor:
        return self._tables_mask(tables)[self._slot_table]

    def _tables_mask(self, tables: Sequence[int]) -> torch.Tensor:
        """Per cached table, whether it is one of `tables`, on the device; made once per set (a
        tensor from a Python list is a blocking host-to-device copy: torch waits for the stream)."""
        key = tuple(sorted(set(tables)))
        mask = self._table_masks.get(key)
        if mask is None:
            mask = torch.tensor([k in key for k in range(len(self.tables))], device=self.device)
            self._table_masks[key] = mask
        return mask

    def drop(self, buffers, tables: Sequence[int], readers_wait: Optional[callable] = None) -> None:
        """Writes back and empties the caches of cached tables `tables` (before a batch reads
        and updates their backing rows directly). Without a host wait: the host knows how many
        rows each table holds (`_occupied`); all of them are written back while some slot may be
        dirty (a clean row's bytes are its backing row's), and the statistics count the dirty ones."""
        self._before_unheld_move(readers_wait, evicting_held=True)  # (`readers_wait`: a prefetch's)
        self._join_writeback()
        occupied = [n if k in tables else 0 for k, n in enumerate(self._occupied)]
        if sum(occupied):
            T = self._t
            slots = self._compact((self._slot_row >= 0) & self._of_tables(tables), sum(occupied))
            c = self._slot_table[slots]  # (slots ascend, so their tables do)
            rows = self._slot_row[slots]
            written = self._dirty[slots]
            self._device_stats[0] += written.sum()  # rows_written_back, bytes_written_back
            self._device_stats[1] += (written * T["row_bytes"][c]).sum()
            if self._maybe_dirty:
                self._move(buffers, c, rows, slots - T["sbase"][c], to_slots=False, per_table=occupied)
            # (index_fill_, not x[slots] = number: on CUDA that number is a CPU tensor which
            # index_put_ copies to the device with a wait; _sync_audit.py)
            self._row_slot.index_fill_(0, T["rbase"][c] + rows, -1)
            self._slot_row.index_fill_(0, slots, -1)
            self._last_used.index_fill_(0, slots, 0)
            self._dirty.index_fill_(0, slots, False)
            self.epoch += 1
            self._release_all()
        for k in tables:
            self._occupied[k] = 0

    def invalidate(self) -> None:
        """Empties the cache without writing anything back (after the backing rows were replaced,
        or after a flush)."""
        self._join_writeback()
        self._row_slot.fill_(-1)
        self._slot_row.fill_(-1)
        self._last_used.zero_()
        self._dirty.zero_()
        self._occupied = [0] * len(self.tables)
        self._maybe_dirty = False
        self.epoch += 1
        self._release_all()

    def mark_dirty(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._dirty.index_fill_(0, slots, True)
            self._maybe_dirty = True

    # ---- batches in flight: their rows stay ----

    _MAX_HELD = 8  # (tickets held longest are let go first: a forward whose backward never came)

    def hold(self, ticket: Ticket) -> None:
        """Keeps `ticket`'s rows in their slots until `release`: later batches (a prefetch of the
        next batch while this one trains, say) evict other rows, so the ticket stays valid and
        its backward needs no second lookup. A hold never costs a batch its admission: when
        holds would leave a batch's missing rows too few slots, every hold is let go (their
        tickets are then prepared again, as without holds)."""
        if ticket.slots.numel() and not ticket.backing:
            self._held.append(ticket)
            if len(self._held) > self._MAX_HELD:
                del self._held[:-self._MAX_HELD]
                self._unheld = True
        elif ticket.backing and ticket.epoch == self.epoch:
            self._in_flight_backing.append(ticket)
            del self._in_flight_backing[:-self._MAX_HELD]

    def _before_unheld_move(self, readers_wait: Optional[callable], evicting_held: bool = False) -> None:
        """Before rows move out of slots that a batch in flight may read: `readers_wait` (a
        prefetch's, which did not wait for the forwards that read held batches on other streams:
        module._CacheStreams.wait_all) is called where holds were let go since the last such
        point, or where this move evicts held slots (`evicting_held`: a drop). Without it, the
        use waited for every other stream already."""
        if readers_wait is not None and (self._unheld or (evicting_held and self._held)):
            readers_wait()
        self._unheld = False

    _aside = False  # (this cache never exchanges on a stream of its own: TBEGEN_CACHE_LOOKUP_STREAM)

    def release(self, ticket: Ticket) -> None:
        self._held = [t for t in self._held if t is not ticket]
        self._in_flight_backing = [t for t in self._in_flight_backing if t is not ticket]

    def _backing_in_flight(self) -> bool:
        """Whether a batch in flight read rows in their backing rows and is still valid (an older
        one is prepared again by its backward whatever happens now)."""
        self._in_flight_backing = [t for t in self._in_flight_backing if t.epoch == self.epoch]
        return bool(self._in_flight_backing)

    def _release_all(self) -> None:
        if self._held:
            self._unheld = True
        self._held = []
        self.hard_epoch += 1

    def valid(self, ticket: Ticket) -> bool:
        """Whether the slot numbers of `ticket` still name its rows."""
        if ticket.epoch == self.epoch:
            return True
        return (not ticket.backing and ticket.hard_epoch == self.hard_epoch
                and any(t is ticket for t in self._held))

    def _held_mask(self) -> Optional[torch.Tensor]:
        """The slots held for batches in flight, with one more entry (False, never read: prepare's
        index fills of "no slot" land there), or None where none is held."""
        if not self._held:
            return None
        mask = torch.zeros(self.num_slots + 1, dtype=torch.bool, device=self.device)
        for t in self._held:
            mask.index_fill_(0, t.slots, True)
        return mask

    def _iota(self, n: int, dtype: torch.dtype = torch.int64, start: int = 0) -> torch.Tensor:
        """start, start + 1, ..., start + n - 1 on the device: a view of one kept tensor (grown
        when a batch needs more), so that a batch's lookup does not write an arange per use.
        (Grown only within a use of the cache, which waited on the device for the latest use on
        every other stream; but kernels queued on this stream since the last host wait may still
        read the tensor it replaces, and the caching allocator hands a block out again on the
        stream that allocated it without waiting for other streams: a prefetch stream's iota,
        dropped by a lookup on the forward's stream, could be overwritten by the prefetch stream's
        next allocation before this stream's kernels read it. So the old one is recorded as used
        by this stream: its memory is reused only once this stream has passed this point.)"""
        have = self._iotas.get(dtype)
        if have is None or have.numel() < start + n:
            if have is not None and have.is_cuda:
                have.record_stream(torch.cuda.current_stream(self.device))
            have = torch.arange(max(start + n, 1024), dtype=dtype, device=self.device)
            self._iotas[dtype] = have
        return have[start:start + n]

    def _feature_mask(self, tables: Sequence[int]) -> torch.Tensor:
        """Per feature (padded as _feature_cached), whether its cached table is one of `tables`."""
        fc = self._feature_cached_t
        return (fc >= 0) & self._tables_mask(tables)[fc.clamp(min=0)]

    # ---- a batch ----

    def prepare(self, indices: torch.Tensor, offsets: torch.Tensor, batch: int, buffers, *,
                bad_index_error: Optional[callable] = None, defer: bool = False,
                readers_wait: Optional[callable] = None, rows_wait: Optional[callable] = None,
                aside: Optional[bool] = None) -> Optional[Ticket]:
        """(`aside`, as the module passes it since TBEGEN_CACHE_PREFETCH_WARM: unused, this cache never
        exchanges on a stream of its own.) Makes every row that `indices` reads of a cached table resident and returns the
        indices the kernels read (see Ticket). `offsets` has F * batch + 1 entries (checked by the
        caller). Out-of-range indices of cached tables stay out of range for the kernels, which
        treat them per bounds_check_mode: those of a direct table become -1 (its features reach
        past its rows, into its slots), those of a compact table stay; with `bad_index_error`, the
        first one is passed to it (which raises) before anything changes.

        Host waits (docs/placements.md, "The host's part"): one per batch, where the host reads
        the batch's summary (per table: distinct rows, missing rows, indices; hits; held slots
        beside the batch's; bad indices): every later size is one of those numbers or the
        number of indices, so the host allocates and launches the rest without waiting for the
        device. A batch with more distinct rows of a compact table than its slots (overflow)
        waits twice (the summary is read again once that table's indices are left out).

        `defer` (a prefetch): where the batch's rows would need slots held for other batches,
        None, with nothing changed (the forward looks the batch up then). `readers_wait` (a
        prefetch's, on CUDA): called before rows move out of slots whose holds were let go
        (_before_unheld_move). `rows_wait`: taken as the module passes it, never called (this
        cache never exchanges on a stream of its own).

        How (each step one pass over the N indices or the distinct rows, few of them; on CUDA
        each operator is a launch the host pays for, benchmarks/cache_prepare_ops.py counts them):
        each index's feature (one searchsorted of the features' first offsets), then its sort key,
        rbase + index for an index looked up, else one of three keys after every row's
        (_SENT_*); one stable sort of the keys; each distinct key's first entry; the running
        counts of distinct and missing keys, read at each table's first key (the summary)."""
        T = self._t
        dev = self.device
        N = indices.numel()
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        if N == 0:
            return Ticket(indices.clone(), empty, self.epoch, indices, offsets, self._features[()])
        nc = len(self.tables)
        nr = self.num_rows
        st = self.stats
        # each index's feature + 1 (0 before every bag, F + 1 after them): the index of its
        # entry in the per-feature tables. (Gathers here are index_select: it takes int32
        # indices as they are, where x[i] converts them to int64 first, a hidden pass.)
        bounds = (offsets[::batch] if batch > 0 else offsets[:1]).contiguous()
        fp = torch.searchsorted(bounds, self._iota(N, bounds.dtype), right=True, out_int32=True)
        # the index's row key where it is valid (int64 with int64 indices; elsewhere any value, the
        # where below takes the index's not-looked-up key there)
        key = self._f_rbase.index_select(0, fp) + indices
        valid = (indices >= 0) & (indices < self._f_rows.index_select(0, fp))
        check_bad = bad_index_error is not None
        # where the kind of index not looked up matters (bad ones counted, or made -1 for a
        # direct table), each feature's own key; else one key for all
        sent = self._f_sent.index_select(0, fp) if check_bad or any(self.direct) else nr + _SENT_KEEP
        keys = torch.where(valid, key, sent).to(self._key_type)
        bypass: Tuple[int, ...] = ()
        ct = torch.int32 if N < 2 ** 31 - 1 else torch.int64  # (running counts)
        ne = nc + 3  # the edges: each table's first key, then the three not-looked-up keys
        while True:  # (twice when a compact table overflows its cache: then without its indices)
            # The batch's distinct rows, without a data-sized output: the keys sorted (those not
            # looked up last), each distinct key's first entry marked.
            sk, perm = torch.sort(keys, stable=True)
            first = torch.cat([self._true1, sk[1:] != sk[:-1]])
            slot_k = self._row_slot_ext.index_select(0, sk)  # (int32; -1 for keys not looked up)
            miss_k = slot_k < 0
            # per table (its keys are contiguous), the running counts of entries (the edges),
            # distinct keys and missing distinct keys at its first key: the host takes differences
            edges = torch.searchsorted(sk, self._edge_keys)
            running = torch.empty((2, N + 1), dtype=ct, device=dev)
            running.select(1, 0).zero_()
            torch.cumsum(first, 0, dtype=ct, out=running[0, 1:])
            torch.cumsum(first & miss_k, 0, dtype=ct, out=running[1, 1:])
            at_edges = running.index_select(1, edges)
            parts = [edges, at_edges.reshape(-1), miss_k.sum().reshape(1)]
            held = self._held_mask()
            if held is not None:  # per table, the held slots other than the batch's hit rows
                table_k = torch.searchsorted(self._table_ends, sk, right=True)
                others = held.clone()
                mine = torch.where(miss_k, self.num_slots, self._slot_bounds.index_select(0, table_k) + slot_k)
                others.index_fill_(0, mine, False)
                held_running = torch.empty(self.num_slots + 1, dtype=torch.int64, device=dev)
                held_running[:1].zero_()
                torch.cumsum(others[:-1], 0, out=held_running[1:])
                parts.append(held_running[self._slot_bounds])
            with span("tbegen.cache.host_wait"):
                summary = torch.cat(parts).tolist()  # (the batch's one host wait)
            e, r, m = summary[:ne], summary[ne:2 * ne], summary[2 * ne:3 * ne]
            looked_h = [e[k + 1] - e[k] for k in range(nc)]
            need_h = [r[k + 1] - r[k] for k in range(nc)]
            miss_h = [m[k + 1] - m[k] for k in range(nc)]
            n_looked = e[nc]
            bad_direct = (e[nc], e[nc + 1])  # (sorted positions of a direct table's out-of-range indices)
            index_hits = N - summary[3 * ne]
            unique_hits = sum(need_h) - sum(miss_h)
            if held is not None:
                o = summary[3 * ne + 1:]
                extra = [o[k + 1] - o[k] for k in range(nc)]
            else:
                extra = [0] * nc
            if check_bad:
                check_bad = False
                if e[nc + 2] - e[nc]:
                    fc = self._feature_cached_t[fp]
                    i = int(((fc >= 0) & ~valid).nonzero()[0, 0])
                    c_i = int(fc[i])
                    bad_index_error(i, int(indices[i]), int(fp[i]) - 1, self.tables[c_i], self.rows[c_i])
            n_unique = sum(need_h)
            if n_unique == 0:
                out = self._kept(indices, perm, bad_direct)
                if not bypass:
                    return Ticket(out, empty, self.epoch, indices, offsets, self._features[()])
                st["prepares"] += 1
                return Ticket(out, empty, self.epoch, indices, offsets, self._features_for(bypass), bypass)
            over = tuple(k for k in range(nc) if need_h[k] > self.slots[k] and not self.direct[k])
            if not over:
                break
            self._overflow(buffers, over, need_h, readers_wait)
            st["bypasses"] += len(over)
            st["backing_lookups"] += sum(looked_h[k] for k in over)
            st["backing_rows"] += sum(need_h[k] for k in over)
            st["lookups"] += sum(looked_h[k] for k in over)
            st["unique_rows"] += sum(need_h[k] for k in over)
            over_f = self._feature_mask(over).index_select(0, fp)
            if self.algorithm == "lfu":  # (each bypassed index counts 1, the others 0)
                bypassed = over_f & (keys < nr)
                self._counts.index_put_((key.clamp(0, nr - 1),), bypassed.to(torch.int64), accumulate=True)
                self._count_bound += sum(looked_h[k] for k in over)
            bypass = over
            keys = torch.where(over_f, nr + _SENT_KEEP, keys)  # (a compact table's indices: as given)
        # the distinct rows U (ascending), their tables, slots, and how often the batch reads them
        n_miss = sum(miss_h)
        # rows to load: every missing one, except where a direct table has more than its slots
        # (then the slots not holding a hit take the batch's most read missing rows; the others
        # are read from the backing store in place)
        admit = [min(mi, C - (n - mi)) for mi, n, C in zip(miss_h, need_h, self.slots)]
        if defer and not bypass and sum(admit) and self._backing_in_flight():
            # A batch in flight read rows in place: moving any row now would make its backward
            # look it up again (and, in TorchRec's order, the prefetched batch after it): deferred.
            st["deferred"] += 1
            return None
        if held is not None and n_miss and any(
                a > C - (n - mi) - x for a, mi, n, C, x in zip(admit, miss_h, need_h, self.slots, extra)):
            # The slots held for other batches are not victims, unless that would cost this batch:
            # then every hold is let go (their backwards look their batches up again). A prefetch
            # (`defer`) instead leaves everything as it was, its batch to be looked up by its own
            # forward once the holds are gone: letting them go from a prefetch between a forward
            # and its backward (TorchRec's pipeline) made that backward look its batch up again and
            # evict the prefetched rows, and the next forward the same, three lookups a batch
            # (landing8: C2 at a 10% cache 32.5 -> 44.6 ms a step, at 5% 39.6 -> 97.0).
            if defer and not bypass:
                st["deferred"] += 1
                return None
            self._release_all()
            held = None
        ranks = running[0, 1:]  # (each sorted entry's distinct key, from 1)
        # sorted positions of each distinct row's first entry, then the end of the looked-up ones
        # (the first entry not looked up, or N)
        at_end = torch.searchsorted(ranks, self._iota(n_unique + 1, ct, 1))
        at = at_end[:-1]
        U = sk.index_select(0, at)
        tU = torch.searchsorted(self._table_ends, U, right=True)
        slot = slot_k.index_select(0, at)  # (int32; -1: missing)
        sbase_u = T["sbase"].index_select(0, tU)
        counts = None
        if self.algorithm == "lfu" or admit != miss_h:
            counts = at_end[1:] - at  # how often the batch reads each distinct row
        self.tick += 1
        tick = self.tick
        if self.algorithm == "lfu":
            self._counts.index_put_((U,), counts, accumulate=True)  # (U distinct: an add)
            self._count_bound += n_looked
        if sum(admit):
            missing_u = slot < 0
            if admit == miss_h:  # every missing row: the sorted positions of the missing firsts
                at_miss = torch.searchsorted(running[1, 1:], self._iota(n_miss, ct, 1))
                mU = sk.index_select(0, at_miss)
                mT = torch.searchsorted(self._table_ends, mU, right=True)
            else:
                missing = self._compact(missing_u, n_miss)
                tm = tU[missing]
                # per table, most read first, then by row: one stable sort of (table, n_looked - count)
                order = torch.argsort(torch.add(n_looked - counts[missing], tm, alpha=n_looked + 1), stable=True)
                missing, tm = missing[order], tm[order]  # (tm ascending)
                # per table, on the device (the summary's running counts at its first key): its
                # distinct and missing rows, the rows it admits, and where its missing rows start
                # per table (the summary's running counts at its first key, on the device): where
                # its missing rows end, less those it cannot admit (its distinct rows past its slots)
                r = at_edges[0, :nc + 1]
                end = at_edges[1, 1:nc + 1] - (r[1:] - r[:-1] - T["C"]).clamp(min=0)
                sel = self._compact(self._iota(n_miss) < end[tm], sum(admit))
                mU, mT = U[missing[sel]], tm[sel]
            mRow = mU - T["rbase"].index_select(0, mT)
            # the batch's own slots (its hit rows'; the others point at the extra entry)
            protect = torch.where(missing_u, self.num_slots, sbase_u + slot)
            with span("tbegen.cache.fill"):
                self._fill(buffers, mU, mT, mRow, protect, admit, held, readers_wait)
        n_backing = [n - a - (n - mi) for n, a, mi in zip(need_h, admit, miss_h)]  # (direct tables only)
        slot = self._row_slot.index_select(0, U)
        out_type = indices.dtype
        if sum(n_backing):
            resident = slot >= 0
            # a row read in its backing row keeps its index (its row in the table)
            value = torch.where(resident, slot + T["index_base"][tU], U - T["rbase"][tU])
            slots = (sbase_u + slot)[self._compact(resident, n_unique - sum(n_backing))]
            st["backing_rows"] += sum(n_backing)
            self._device_stats[2:].add_((counts * ~resident).sum())  # backing_lookups (read in report)
        else:
            value = slot + T["index_base"].index_select(0, tU)
            slots = sbase_u + slot
        self._last_used.index_fill_(0, slots, tick)  # (the batch's hit rows and the rows it loaded)
        # each index's value: that of its distinct row (by its sorted entry's rank), for the
        # indices looked up; the others as given (-1 for a direct table's out-of-range ones)
        by_rank = torch.nn.functional.pad(value.to(out_type), (1, 0))  # (entry 0 never read)
        out = self._kept(indices, perm, bad_direct)
        out.index_put_((perm[:n_looked],), by_rank.index_select(0, ranks[:n_looked]))
        st["prepares"] += 1
        st["lookups"] += sum(looked_h)
        st["hits"] += index_hits
        st["unique_rows"] += n_unique
        st["unique_hits"] += unique_hits
        return Ticket(out, slots, self.epoch, indices, offsets,
                      self._features_for(bypass), bypass, self.hard_epoch, bool(bypass) or sum(n_backing) > 0)

    def _kept(self, indices: torch.Tensor, perm: torch.Tensor, bad_direct: Tuple[int, int]) -> torch.Tensor:
        """A copy of the indices, where out-of-range ones of direct tables (the sorted entries
        bad_direct[0]..bad_direct[1]-1) are -1: their features reach past the table's rows, into
        its slots, and -1 is out of range for the kernels, which skip or report it per
        bounds_check_mode. Out-of-range indices of compact tables stay."""
        out = indices.clone()
        lo, hi = bad_direct
        if hi > lo:
            out.index_fill_(0, perm[lo:hi], -1)
        return out

    def _compact(self, mask: torch.Tensor, k: int) -> torch.Tensor:
        """The positions of the `k` True entries of `mask`, ascending, where the caller knows `k`
        (nonzero would make the host wait for the count): the i-th is the first position where
        the running count of True entries reaches i + 1."""
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.searchsorted(torch.cumsum(mask, 0), self._iota(k, start=1))

    def _overflow(self, buffers, over: Tuple[int, ...], need: Sequence[int], readers_wait=None) -> None:
        """Cached tables `over` have more distinct rows in the batch than cache slots: the batch
        reads and updates their backing rows directly (see the module docstring)."""
        for k in over:
            if k not in self._warned:
                self._warned.add(k)
                warnings.warn(
                    f"tbegen: a batch reads {need[k]} distinct rows of table {self.tables[k]} (placement "
                    f"'managed_caching'), more than its cache's {self.slots[k]} rows: such batches read and "
                    f"update that table in managed memory directly, bypassing its cache (correct, but "
                    f"without the cache's benefit; cache_stats() counts them). A larger cache (cache_rows, "
                    f"cache_load_factor) or smaller batches avoid it. (Warned once per table.)",
                    RuntimeWarning, stacklevel=5,
                )
        with span("tbegen.cache.drop"):
            self.drop(buffers, over, readers_wait)

    def _victim_order(self, protected: torch.Tensor) -> torch.Tensor:
        """All slots, grouped by table (each table's C slots at its sbase) and, within a table,
        coldest first: empty slots, then by last use (LRU) or by access count, then last use
        (LFU); ties by slot number. Protected slots (rows of the batch) come last. (An empty
        slot's last use is 0, an occupied one's its batch's tick, from 1: drop, invalidate and
        prepare keep it so.)"""
        if self.algorithm == "lru" and self.tick < _TICK_LIMIT:
            # one sort: table in the high bits, then empty (0) < last use (the last tick, at most
            # tick) < protected (2 + tick); the key in 32 bits while it fits (the radix sort
            # then makes half the passes of a 64-bit key: the same order, ties by slot number)
            top = self.tick + 2
            key = torch.add(torch.where(protected, top, self._last_used), self._slot_table, alpha=top + 1)
            if len(self.tables) * (top + 1) < 2 ** 31:
                key = key.to(torch.int32)
            return torch.argsort(key, stable=True)
        recency = torch.where(protected, _NEVER, self._last_used)
        order = torch.argsort(recency, stable=True)
        if self.algorithm == "lfu":
            occupied = self._slot_row >= 0
            rows = self._t["rbase"][self._slot_table] + self._slot_row.clamp(min=0)
            top = self._count_bound + 2  # (above every access count: protected)
            if len(self.tables) * (top + 1) < 2 ** 62:
                # one sort of (table, count) after the sort by last use: table in the high bits,
                # then empty (0) < access count + 1 < protected (top); 32 bits while it fits
                freq = torch.where(occupied, self._counts[rows] + 1, 0)
                key = torch.add(torch.where(protected, top, freq), self._slot_table, alpha=top + 1)
                if len(self.tables) * (top + 1) < 2 ** 31:
                    key = key.to(torch.int32)
                return order[torch.argsort(key[order], stable=True)]
            freq = torch.where(occupied, self._counts[rows], -1)
            freq = torch.where(protected, _NEVER, freq)
            order = order[torch.argsort(freq[order], stable=True)]
        return order[torch.argsort(self._slot_table[order], stable=True)]

    def _fill(self, buffers, mU, mT, mRow, protect, count_h, held: Optional[torch.Tensor] = None,
              readers_wait: Optional[callable] = None) -> None:
        """Loads rows (cached keys mU of tables mT, grouped by table: count_h[c] of table c) into
        the coldest slots of their tables (the j-th row of a table into its j-th coldest slot),
        never into the batch's own slots (`protect`: slot numbers, num_slots for none) or those
        `held` for other batches (num_slots + 1 entries). The caller marks the slots used.

        Without a host wait: a table's coldest slots are its empty ones first, so the host knows
        how many of its victims hold a row (evicted: `_occupied`, which it keeps). Every evicted
        row is written back (a clean one's slot holds its backing row's bits, so that write
        changes nothing), unless no slot can be dirty; the statistics count the dirty ones."""
        self._before_unheld_move(readers_wait)  # (holds let go since: their forwards may still read)
        T = self._t
        dev = self.device
        S = self.num_slots
        protected = torch.zeros(S + 1, dtype=torch.bool, device=dev) if held is None else held
        protected.index_fill_(0, protect, True)
        order = self._victim_order(protected[:S])
        first = torch.searchsorted(mT, self._iota(len(self.tables)))  # (mT ascends)
        sb = T["sbase"][mT]
        # the j-th row of its table takes that table's j-th coldest slot (never a protected one)
        victims = order[self._iota(mU.numel()) + (T["sbase"] - first)[mT]]
        local_slot = victims - sb
        old = self._slot_row[victims]
        evicted_h = [max(0, a - (C - n)) for a, C, n in zip(count_h, self.slots, self._occupied)]
        evicted = sum(evicted_h)
        # every victim holds a row where no table of the rows has an empty slot (a full cache)
        full = evicted == mU.numel()
        written = self._dirty[victims] if full else (old >= 0) & self._dirty[victims]
        # rows_written_back, bytes_written_back (read in report)
        if len(set(self.row_bytes)) == 1:
            self._device_stats[:2].add_(written.sum() * self._row_and_bytes)
        else:
            self._device_stats[:2].add_(torch.stack([written.sum(), (written * T["row_bytes"][mT]).sum()]))
        # By default the evicted rows are gathered out of their slots (GPU memory to GPU memory),
        # then written to their backing rows on a side stream while the new rows load on this one:
        # the two cross the host link in opposite directions at once, and touch different backing
        # rows (an evicted row is resident, a loaded one is not). This stream waits for both. With
        # TBEGEN_CACHE_EXCHANGE=1 one kernel per buffer does both for each victim (_exchange; `old`
        # is -1 for an empty slot: nothing written back for it).
        exchange = self._exchange_blocks > 0
        staged: list = []
        if full:
            te, oe, le = mT, old, local_slot
        elif evicted:  # (the victims that hold a row, grouped by table: a table's empty slots come first)
            e = self._compact(old >= 0, evicted)
            te, oe, le = mT[e], old[e], local_slot[e]
        if exchange:
            self._join_writeback()  # (a flush's or a drop's write-back, if one is in flight)
            with span("tbegen.cache.exchange"):
                self._exchange(buffers, mT, local_slot, old if evicted and self._maybe_dirty else None, mRow, count_h)
        else:
            with span("tbegen.cache.writeback"):
                if evicted and self._maybe_dirty:
                    self._move(buffers, te, oe, le, to_slots=False, staged=staged, per_table=evicted_h)
                self._write_staged(staged)
        if evicted:
            self._row_slot.index_fill_(0, T["rbase"][te] + oe, -1)
        # Some row's slot number is no longer valid, or a row that an earlier batch of a direct
        # table read in its backing row is now cached: batches prepared before are prepared again.
        self.epoch += 1
        if not exchange:
            with span("tbegen.cache.load"):
                self._move(buffers, mT, mRow, local_slot, to_slots=True, per_table=count_h)
            self._join_writeback()
        self._row_slot[mU] = local_slot.to(torch.int32)
        self._slot_row[victims] = mRow
        self._dirty.index_fill_(0, victims, False)
        self._occupied = [min(C, n + a) for C, n, a in zip(self.slots, self._occupied, count_h)]
        st = self.stats
        st["rows_loaded"] += mU.numel()
        st["bytes_loaded"] += self._bytes(count_h)
        st["evictions"] += evicted
