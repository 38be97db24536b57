"""FROZEN REFERENCE (tests only): tbegen/cache.py as of commit aaefd1c (before issue 27 took the
host waits out of its per-step path), kept verbatim so that tests/test_cache_syncs.py can run the
old algorithm beside the new one and require the same cache state, statistics and weights bitwise.
Do not edit it; it is not imported by tbegen.

The row cache of placement "managed_caching": host-resident tables behind a cache of hot rows.

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
CI exercises it).

A batch whose distinct rows of a table outnumber that table's cache slots ("overflow") is not
refused: for that batch the table *bypasses* its cache. Its cached rows are written back and its
cache emptied, and the batch's feature table points that table's features at its backing rows
(as for placement "managed"), so the kernels read and update them in managed memory directly, with
the indices as given. The module warns once per table; `cache_stats()` counts the bypasses.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from tbegen.int8 import QPARAM_BYTES

__all__ = ["CACHE_ALGORITHMS", "cache_sizes", "RowCache", "Ticket"]

CACHE_ALGORITHMS = ("lru", "lfu")

# Moved rows are copied in chunks of at most this many elements (bounds the index tensors).
_CHUNK_ELEMENTS = 1 << 24
_NEVER = torch.iinfo(torch.int64).max  # the score of a slot that may not be evicted
_TICK_LIMIT = 1 << 40  # LRU sorts (table, last use) as one int64 while fewer batches were seen


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
                 element_sizes: Sequence[int], row_sizes: Sequence[int], device: torch.device):
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
        )
        cached_of_table = {t: c for c, t in enumerate(self.tables)}
        # per feature, its cached table (or -1); padded with -1 at both ends (see prepare)
        self._feature_cached = [-1] + [cached_of_table.get(t, -1) for t in layout.feature_table_map] + [-1]
        self.epoch = 0
        self.hard_epoch = 0
        self._held: List[Ticket] = []
        self.tick = 0
        self._warned = set()
        self.stats = self._zero_stats()
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
        self._row_slot = torch.full((self.num_rows,), -1, dtype=torch.int32, device=device)  # local slot of a row
        self._slot_row = torch.full((self.num_slots,), -1, dtype=torch.int64, device=device)  # local row in a slot
        self._last_used = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self._dirty = torch.zeros(self.num_slots, dtype=torch.bool, device=device)
        if self.algorithm == "lfu":
            old = getattr(self, "_counts", None)
            self._counts = (old.to(device) if old is not None else
                            torch.zeros(self.num_rows, dtype=torch.int64, device=device))
        self._dims = sorted(set(self.dims))
        self._units = self._row_units()
        self._side = None  # the write-back stream (CUDA), made on first use
        self._writeback_pending = False

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
                    bypasses=0, backing_lookups=0, backing_rows=0)

    def reset_stats(self) -> None:
        self.stats = self._zero_stats()

    def report(self) -> Dict[str, object]:
        s = dict(self.stats)
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
              staged: Optional[list] = None) -> None:
        """Copies rows (and their states) of cached tables `c` between backing row `rows` and local
        slot `slots`, in every buffer: `buffers` is [(flat tensor, "element" | "row" | "int8 rows")]
        ("int8 rows": the weights of weights_dtype int8, a byte buffer in which the row of element
        offset o and key k is the D + 8 bytes from o + 8k: codes and qparams move together).
        With `staged` (a list), the sources are gathered now and the writes are appended to it as
        (view, destination rows, gathered rows), for `_write_staged` to issue later."""
        if rows.numel() == 0:
            return
        T = self._t
        int8_rows = any(per == "int8 rows" for _, per in buffers)
        for D in self._dims:
            sel = None if len(self._dims) == 1 else (T["D"][c] == D).nonzero().squeeze(1)
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
            if per == "row":
                _copy_or_stage(buf, dst, buf.index_select(0, src), staged)

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
            for lo in range(0, src.numel(), step):
                _copy_or_stage(view, dst[lo:lo + step], view.index_select(0, src[lo:lo + step]), staged)

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
                view.index_copy_(0, dst, rows)
            return
        current = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            for view, dst, rows in staged:
                view.index_copy_(0, dst, rows)
                dst.record_stream(self._side)  # (freed by the allocator only after the side stream used them)
                rows.record_stream(self._side)
        self._writeback_pending = True

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
        return n

    def _of_tables(self, tables: Sequence[int]) -> torch.Tensor:
        return torch.isin(self._slot_table, torch.tensor(list(tables), dtype=torch.int64, device=self.device))

    def drop(self, buffers, tables: Sequence[int]) -> None:
        """Writes back and empties the caches of cached tables `tables` (before a batch reads
        and updates their backing rows directly)."""
        self.flush(buffers, tables)
        slots = ((self._slot_row >= 0) & self._of_tables(tables)).nonzero().squeeze(1)
        if slots.numel():
            c = self._slot_table[slots]
            self._row_slot[self._t["rbase"][c] + self._slot_row[slots]] = -1
            self._slot_row[slots] = -1
            self._last_used[slots] = 0
            self.epoch += 1
            self._release_all()

    def invalidate(self) -> None:
        """Empties the cache without writing anything back (after the backing rows were replaced,
        or after a flush)."""
        self._join_writeback()
        self._row_slot.fill_(-1)
        self._slot_row.fill_(-1)
        self._last_used.zero_()
        self._dirty.zero_()
        self.epoch += 1
        self._release_all()

    def mark_dirty(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._dirty[slots] = True

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
            del self._held[:-self._MAX_HELD]

    def release(self, ticket: Ticket) -> None:
        self._held = [t for t in self._held if t is not ticket]

    _aside = False  # (this cache never exchanges on a stream of its own: TBEGEN_CACHE_LOOKUP_STREAM)

    def _release_all(self) -> None:
        self._held = []
        self.hard_epoch += 1

    def valid(self, ticket: Ticket) -> bool:
        """Whether the slot numbers of `ticket` still name its rows."""
        if ticket.epoch == self.epoch:
            return True
        return (not ticket.backing and ticket.hard_epoch == self.hard_epoch
                and any(t is ticket for t in self._held))

    def _held_mask(self) -> Optional[torch.Tensor]:
        if not self._held:
            return None
        mask = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
        for t in self._held:
            mask[t.slots] = True
        return mask

    # ---- a batch ----

    def prepare(self, indices: torch.Tensor, offsets: torch.Tensor, batch: int, buffers, *,
                bad_index_error: Optional[callable] = None) -> Ticket:
        """Makes every row that `indices` reads of a cached table resident and returns the
        indices the kernels read (see Ticket). `offsets` has F * batch + 1 entries (checked by the
        caller). Out-of-range indices of cached tables stay out of range for the kernels, which
        treat them per bounds_check_mode (see _skip_bad); with `bad_index_error`, the first one
        is passed to it (which raises) before anything changes."""
        T = self._t
        dev = self.device
        N = indices.numel()
        idx = indices.to(torch.int64)
        # each index's feature (-1 / F outside every bag), then its cached table (or -1)
        bounds = (offsets[::batch] if batch > 0 else offsets[:1]).to(torch.int64).contiguous()
        feature = torch.searchsorted(bounds, torch.arange(N, device=dev), right=True) - 1
        c = self._feature_cached_t[(feature + 1).clamp(0, len(self._feature_cached) - 1)]
        cached = c >= 0
        c0 = c.clamp(min=0)
        valid = cached & (idx >= 0) & (idx < T["E"][c0])
        if bad_index_error is not None:
            bad = (cached & ~valid).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                bad_index_error(i, int(idx[i]), int(feature[i]), self.tables[int(c[i])], self.rows[int(c[i])])
        pos = valid.nonzero().squeeze(1)
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        if pos.numel() == 0:
            return Ticket(self._skip_bad(indices, c, valid), empty, self.epoch, indices, offsets, self._features[()])
        nc = len(self.tables)
        st = self.stats
        bypass: Tuple[int, ...] = ()
        while True:  # (twice when a compact table overflows its cache: then without its indices)
            cv = c[pos]
            keys = T["rbase"][cv] + idx[pos]
            if self.num_rows < 2 ** 31:  # (32-bit keys sort in half the passes)
                keys = keys.to(torch.int32)
            U, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)
            U = U.to(torch.int64)
            tU = torch.searchsorted(T["rbase"], U, right=True) - 1  # cached table of each distinct row
            local_row = U - T["rbase"][tU]
            slot = self._row_slot[U].to(torch.int64)
            hit = slot >= 0
            need = self._per_table(tU)  # (U ascends, so its tables do)
            miss = self._per_table(tU[~hit])
            looked = self._per_table(tU, counts)
            summary = torch.cat([need, miss, looked, torch.stack([hit.sum(), counts[hit].sum()])]).tolist()
            need_h, miss_h, looked_h = summary[:nc], summary[nc:2 * nc], summary[2 * nc:3 * nc]
            unique_hits, index_hits = summary[3 * nc:]
            over = tuple(k for k in range(nc) if need_h[k] > self.slots[k] and not self.direct[k])
            if not over:
                break
            self._overflow(buffers, over, need_h)
            st["bypasses"] += len(over)
            st["backing_lookups"] += sum(looked_h[k] for k in over)
            st["backing_rows"] += sum(need_h[k] for k in over)
            st["lookups"] += sum(looked_h[k] for k in over)
            st["unique_rows"] += sum(need_h[k] for k in over)
            if self.algorithm == "lfu":
                bypassed = torch.isin(tU, torch.tensor(over, device=dev))
                self._counts[U[bypassed]] += counts[bypassed]
            bypass = over
            pos = pos[~torch.isin(cv, torch.tensor(over, device=dev))]
            if pos.numel() == 0:
                st["prepares"] += 1
                return Ticket(self._skip_bad(indices, c, valid), empty, self.epoch, indices, offsets,
                              self._features_for(bypass), bypass)
        self.tick += 1
        tick = self.tick
        hit_slots = T["sbase"][tU[hit]] + slot[hit]
        self._last_used[hit_slots] = tick
        if self.algorithm == "lfu":
            self._counts[U] += counts
        # rows to load: every missing one, except where a direct table has more than its slots
        # (then the slots not holding a hit take the batch's most read missing rows; the others
        # are read from the backing store in place)
        admit = [min(m, C - (n - m)) for m, n, C in zip(miss_h, need_h, self.slots)]
        held = self._held_mask()
        if held is not None and sum(miss_h):
            # the slots held for other batches are not victims, unless that would cost this batch
            held[hit_slots] = False
            extra = self._per_table(self._slot_table[held.nonzero().squeeze(1)]).tolist()
            if any(a > C - (n - m) - x for a, m, n, C, x in zip(admit, miss_h, need_h, self.slots, extra)):
                self._release_all()
                held = None
        if sum(admit):
            missing = (~hit).nonzero().squeeze(1)
            if admit != miss_h:
                order = torch.argsort(-counts[missing], stable=True)  # most read first, then by row
                order = order[torch.argsort(tU[missing][order], stable=True)]
                missing = missing[order]
                first = torch.tensor([sum(miss_h[:k]) for k in range(nc)], dtype=torch.int64, device=dev)
                cap = torch.tensor(admit, dtype=torch.int64, device=dev)
                mt = tU[missing]
                missing = missing[torch.arange(missing.numel(), device=dev) - first[mt] < cap[mt]]
            self._fill(buffers, U[missing], tU[missing], local_row[missing], hit_slots, admit, tick, held)
        slot = self._row_slot[U].to(torch.int64)
        resident = slot >= 0
        n_backing = [n - a - (n - m) for n, a, m in zip(need_h, admit, miss_h)]  # (direct tables only)
        out = self._skip_bad(indices, c, valid)
        at = resident[inverse]
        out[pos[at]] = (slot + T["index_base"][tU])[inverse[at]].to(indices.dtype)
        st["prepares"] += 1
        st["lookups"] += sum(looked_h)
        st["hits"] += index_hits
        st["unique_rows"] += len(U)
        st["unique_hits"] += unique_hits
        if sum(n_backing):
            st["backing_rows"] += sum(n_backing)
            st["backing_lookups"] += int(counts[~resident].sum())
        return Ticket(out, (T["sbase"][tU] + slot)[resident], self.epoch, indices, offsets,
                      self._features_for(bypass), bypass, self.hard_epoch, bool(bypass) or sum(n_backing) > 0)

    def _skip_bad(self, indices: torch.Tensor, c: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A copy of the indices, where out-of-range ones of direct tables are -1 (their features
        reach past the table's rows, into its slots: -1 is out of range for the kernels, which
        skip or report it per bounds_check_mode). Out-of-range indices of compact tables stay."""
        if any(self.direct):
            bad = (c >= 0) & ~valid & (self._t["direct"][c.clamp(min=0)] > 0)
            return torch.where(bad, torch.full_like(indices, -1), indices)
        return indices.clone()

    def _overflow(self, buffers, over: Tuple[int, ...], need: Sequence[int]) -> None:
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
        self.drop(buffers, over)

    def _victim_order(self, protected: torch.Tensor) -> torch.Tensor:
        """All slots, grouped by table (each table's C slots at its sbase) and, within a table,
        coldest first: empty slots, then by last use (LRU) or by access count, then last use
        (LFU); ties by slot number. Protected slots (rows of the batch) come last."""
        occupied = self._slot_row >= 0
        if self.algorithm == "lru" and self.tick < _TICK_LIMIT:
            # one sort: table in the high bits, then empty (0) < last use (1 + tick) < protected
            score = torch.where(occupied, self._last_used + 1, torch.zeros_like(self._last_used))
            score = torch.where(protected, torch.full_like(score, _TICK_LIMIT + 1), score)
            return torch.argsort(self._slot_table * (_TICK_LIMIT + 2) + score, stable=True)
        recency = torch.where(occupied, self._last_used, torch.full_like(self._last_used, -1))
        recency = torch.where(protected, torch.full_like(recency, _NEVER), recency)
        order = torch.argsort(recency, stable=True)
        if self.algorithm == "lfu":
            rows = self._t["rbase"][self._slot_table] + self._slot_row.clamp(min=0)
            freq = torch.where(occupied, self._counts[rows], torch.full_like(recency, -1))
            freq = torch.where(protected, torch.full_like(freq, _NEVER), freq)
            order = order[torch.argsort(freq[order], stable=True)]
        return order[torch.argsort(self._slot_table[order], stable=True)]

    def _fill(self, buffers, mU, mT, mRow, hit_slots, count_h, tick, held: Optional[torch.Tensor] = None) -> None:
        """Loads rows (cached keys mU of tables mT, grouped by table: count_h[c] of table c) into
        the coldest slots of their tables (the j-th row of a table into its j-th coldest slot),
        never into the batch's own slots (`hit_slots`) or those `held` for other batches."""
        T = self._t
        dev = self.device
        protected = torch.zeros(self.num_slots, dtype=torch.bool, device=dev) if held is None else held
        protected[hit_slots] = True
        order = self._victim_order(protected)
        miss_t = torch.tensor(count_h, dtype=torch.int64, device=dev)
        first = torch.cumsum(miss_t, 0) - miss_t
        rank = torch.arange(mU.numel(), device=dev) - first[mT]  # j-th row of its table
        victims = order[T["sbase"][mT] + rank]  # its j-th coldest slot (never a protected one)
        local_slot = victims - T["sbase"][mT]
        old = self._slot_row[victims]
        had = old >= 0
        write = had & self._dirty[victims]
        nc = len(self.tables)
        counts = torch.cat([self._per_table(mT[write]), had.sum().reshape(1)]).tolist()  # (mT ascends)
        written, evicted = counts[:nc], counts[nc]
        # The evicted dirty rows are gathered out of their slots (GPU memory to GPU memory), then
        # written to their backing rows on a side stream while the new rows load on this one: the
        # two cross the host link in opposite directions at once, and touch different backing
        # rows (an evicted row is resident, a loaded one is not). This stream waits for both.
        staged: list = []
        if sum(written):
            w = write.nonzero().squeeze(1)
            self._move(buffers, mT[w], old[w], local_slot[w], to_slots=False, staged=staged)
        self._write_staged(staged)
        if evicted:
            e = had.nonzero().squeeze(1)
            self._row_slot[T["rbase"][mT[e]] + old[e]] = -1
        # Some row's slot number is no longer valid, or a row that an earlier batch of a direct
        # table read in its backing row is now cached: batches prepared before are prepared again.
        self.epoch += 1
        self._move(buffers, mT, mRow, local_slot, to_slots=True)
        self._join_writeback()
        self._row_slot[mU] = local_slot.to(torch.int32)
        self._slot_row[victims] = mRow
        self._last_used[victims] = tick
        self._dirty[victims] = False
        st = self.stats
        st["rows_loaded"] += mU.numel()
        st["bytes_loaded"] += self._bytes(count_h)
        st["rows_written_back"] += sum(written)
        st["bytes_written_back"] += self._bytes(written)
        st["evictions"] += evicted
