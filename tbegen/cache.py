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
(ties broken by slot number: deterministic; each table's coldest by a selection over one unique
key per slot, _coldest, not a sort of every slot). Everything is
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

from ._env import env_flag
from ._ranges import span
from .int8 import QPARAM_BYTES

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


def _hand_off(tensors, stream) -> None:
    """Records the CUDA tensors among `tensors` as used by `stream` (the exchange stream's kernels
    read them, RowCache._launch_aside): the caching allocator then hands their memory out again
    only once that stream has passed this point, though the stream that made them drops them now."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def _launch(launches: Optional[list], op, *args) -> None:
    """op(*args) now, or, with `launches` (a list), appended to it for later (RowCache._launch_aside)."""
    if launches is None:
        op(*args)
    else:
        launches.append((op, args))


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
    # per cached table, its distinct rows the batch reads in slots (host-known: its lookup's
    # summary), for a later prefetch to tell how many slots this batch holds (RowCache._too_short)
    rows_per_table: Tuple[int, ...] = ()


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
                 row_copy=None, row_exchange=None, key_sort=None, row_exchange_states=None):
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
        self._all_direct = all(direct)  # (no table is ever bypassed: prepare's early deferral)
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
        # (the prediction that defers a prefetch before its lookup where the held slots left it too
        # few, _too_short): consecutive looked-up prefetches deferred with a large shortfall, the
        # prefetches still to defer unlooked, and what the last of them saw (_note_short)
        self._short_run = 0
        self._short_skips = 0
        self._short_seen: Optional[Tuple[int, Tuple[Tuple[int, int, int, int], ...]]] = None
        self.tick = 0
        # whether the last batch had a direct table with more distinct rows than its slots (the
        # next one's admitted rows are then planned before its host wait: prepare, _admit_plan)
        self._admit_ahead = False
        self._warned = set()
        self.stats = self._zero_stats()
        # The CUDA extension's _copy_rows operator (managed_memory.h), or None: the rows then move
        # with torch's index kernels. Used on CUDA unless TBEGEN_CACHE_ROW_COPY=0 (see _copy_blocks).
        self._row_copy_op = row_copy
        # Its _exchange_rows operator, or None: on CUDA (unless TBEGEN_CACHE_EXCHANGE=0) a fill writes
        # each victim's old row back and loads the new one in one kernel per buffer (_exchange_grid).
        self._exchange_op = row_exchange
        # Its _exchange_rows_with_states operator, or None: with TBEGEN_CACHE_EXCHANGE_STATES=1 the
        # exchange moves each victim's per-row states in the warp that moves its row (_exchange_states_on).
        self._exchange_states_op = row_exchange_states
        # Its _sort_keys operator (cache_sort_cuda.cuh), or None: prepare's sort of the batch's keys
        # then is torch.sort (see _key_sort_bits).
        self._key_sort_op = key_sort
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
        self._t["table"] = torch.arange(len(self.tables), device=device)  # (0, 1, ...: the fill's)
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
        # TBEGEN_CACHE_LOOKUP_STREAM on (_exchange_aside_on): a prefetch's exchange kernels run on
        # the exchange stream (made on first use), the latest of them followed by `_aside_done`
        # ((stream, event), waited for by every other move: _join_aside); `_aside_new`: the same,
        # set by the prefetch that launched them, for the module to take (take_aside)
        self._aside_stream = None
        self._aside_done = None
        self._aside_new = None
        self._row_copy_blocks = self._copy_blocks(device)
        self._exchange_blocks = self._exchange_grid(device)
        self._exchange_states = self._exchange_states_on()
        self._aside = self._exchange_aside_on()
        self._key_sort_bits = self._key_sort_width(device)
        self._warm = self._prefetch_warm_on()

    def _copy_blocks(self, device: torch.device) -> int:
        """The grid bound of each row copy on CUDA (_copy_rows), or 0 where the rows move with
        torch's index kernels (the CPU, and CUDA with TBEGEN_CACHE_ROW_COPY=0, the way back). Half
        the SMs: the loads of missed rows and the write-back of evicted ones then run at the same
        time, one towards the GPU and one towards the host, and each keeps ~1 MB of rows in flight
        (8 warps a block, 4 rows a warp), well above what one direction of the host link needs to
        stay busy. Measured on the H200 (docs/gpu-runs/2026-12-05-landing8, C2 rowwise_adagrad):
        the cached step 39.6 -> 35.3 ms at a 5% cache, 32.5 -> 27.7 at 10%, 25.6 -> 22.3 at 20%."""
        on = env_flag("TBEGEN_CACHE_ROW_COPY", True)
        if device.type != "cuda" or self._row_copy_op is None or not on:
            return 0
        return max(1, torch.cuda.get_device_properties(device).multi_processor_count // 2)

    def _exchange_grid(self, device: torch.device) -> int:
        """The grid bound of the fill's exchange (_exchange_rows, row_copy_cuda.cuh), or 0 where the
        fill makes two copies, the write-back on a side stream beside the loads. On CUDA with the
        row copy on, the exchange is the default: each victim slot's old row and the row that
        replaces it move in the same warp, one kernel per buffer, on the SMs that the two copies
        shared (half each). Measured (docs/gpu-runs/2026-12-05-landing9, H100, C2 rowwise_adagrad,
        the same run): the cached step 36.17 -> 31.62 ms in-step at 5% (FBGEMM 37.84), 21.62 ->
        19.23 at 20% (FBGEMM 28.23); pipelined 37.67 -> 35.27 and 21.09 -> 19.42.
        TBEGEN_CACHE_EXCHANGE=0 takes the two copies (the way back); unset, empty or "1": the
        exchange; anything else is refused. The same rows move either way, bit for bit.
        The grid, in a forward's fill (in series with the step's kernels) and in a prefetch's exchange
        on the exchange stream alike: one block per 8 SMs (16 on an H100 or H200), a quarter of the
        row copy's bound. Its 128 warps keep ~0.25 MB of rows in flight, above what the host link
        needs (its bandwidth times its latency, ~0.1-0.2 MB a direction), and leave the other SMs to
        the kernels beside it. Measured on the H100 against the grid before (one block per SM in a
        fill, a quarter of that on the exchange stream; C2 rowwise_adagrad, bench_cache --variant,
        one process; docs/gpu-runs/2026-12-05-landing14/cache): the small grids faster in-step. In-step
        22.42 / 28.81 / 40.68 ms a step at a 20 / 10 / 5% cache at 16 blocks, 23.78 / 30.72 / 41.33
        with the fill at one block per SM, and 22.32 / 29.49 / 39.72 for the warm's variant
        (TBEGEN_CACHE_PREFETCH_WARM=1, whose forwards' fills exchanged on the exchange stream at
        the quarter grid, 33 blocks: module._lookup_beside). Pipelined, 28.87 against 30.87 at 10%
        and 39.47 against 40.98 at 5%; at 20% the median 17.25 against 16.86 (19.45 for the warm,
        there the default's code: the run's drift), the wall clock 16.00 against 18.07 ms a
        step. Landing13 (a faster host link), pipelined: 12.66 / 21.91 / 29.23 against 12.79 /
        22.40 / 29.35. TBEGEN_CACHE_EXCHANGE_BLOCKS=n (1 to 65535; for an A/B, read when the cache
        is made) sets the grid to n blocks. Same rows, same bits at any grid."""
        on = env_flag("TBEGEN_CACHE_EXCHANGE", True)
        blocks = os.environ.get("TBEGEN_CACHE_EXCHANGE_BLOCKS", "")
        if blocks and not (blocks.isdigit() and 1 <= int(blocks) <= 65535):
            raise ValueError("tbegen: TBEGEN_CACHE_EXCHANGE_BLOCKS must be a block count from 1 to 65535 (or unset), "
                             f"got {blocks!r}")
        if not on or not self._row_copy_blocks or self._exchange_op is None:
            return 0
        return int(blocks) if blocks else max(1, self._row_copy_blocks // 4)

    def _exchange_states_on(self) -> bool:
        """Whether the fill's exchange moves the per-row states with their rows (_exchange_rows_with_states,
        row_copy_cuda.cuh): one launch per width for the weights and the per-row states together,
        the warp that moves victim i's row also moving victim i's states, so that the states'
        small host reads are in flight with the row's loads instead of in kernels of their own
        after every row (rowwise_adagrad's momentum: ~1.6 M scattered 4-byte host reads a step at
        a 5% cache of C2, 2.0-3.1 ms of its forward over sgd's on the H200, issue 27). Opt-in
        while it is measured: TBEGEN_CACHE_EXCHANGE_STATES=1 (and the exchange on); unset, empty
        or "0": a kernel per buffer (the way it was); anything else is refused. Only where the
        buffers are of the "element" and "row" layouts (not int8 rows: _exchange). The same rows
        and states move either way, bit for bit."""
        return env_flag("TBEGEN_CACHE_EXCHANGE_STATES", False) and self._exchange_blocks > 0 and self._exchange_states_op is not None

    def _exchange_aside_on(self) -> bool:
        """Whether a prefetch's exchange kernels run on a stream of the cache's own, so that the
        next prefetch's lookup, on the prefetch stream, runs beside them (issue 27; docs/placements.md,
        "Prefetching on another stream"). The default where the fill exchanges (CUDA, the exchange
        on): unset, empty or "1"; TBEGEN_CACHE_LOOKUP_STREAM=0: the exchange on the prefetch's
        stream (the way back); anything else is refused. The same rows move, bit for bit. Measured
        with a quarter grid on it (landing12, H100, C2 rowwise_adagrad pipelined at a 20%
        cache: 18.27 -> 13.90 ms a step); on the exchange stream at the whole grid it gained
        nothing there (18.29), the backward beside it held off the SMs.

        Why: TorchRec's order queues the prefetch of batch i + 1 on the stream that holds batch i's
        exchange kernels (queued by the prefetch of batch i), so its lookup, and its one host wait
        (the summary), waited for the rest of that exchange: exchange(i), lookup(i + 1), host wait,
        exchange(i + 1) in series (H100, C2 at a 20% cache: 20.1 ms a step, the exchange ~12.3 ms of
        it, landing11). The lookup reads only the bookkeeping (which row is in which slot, scores,
        dirty flags, holds), never the rows the exchange moves, so it need not wait for them.

        Which stream moves: the exchange, not the lookup. The lookup stays on the caller's stream
        because its inputs (the indices and offsets) are ready on that stream (TorchRec's prefetch
        stream waits there for its data-dist stream): a lookup on a stream of its own would have to
        wait for the caller's stream, exchange(i) included. The ordering (_launch_aside): the
        exchange stream waits for an event recorded on the prefetch's stream after the fill's
        bookkeeping and index arithmetic, and for the end of the backward before (the prefetch's
        lookup waited only for that backward's dirty flags, module._CacheStreams.mark: its kernels
        update rows this exchange may write back; `rows_wait`); its own order keeps exchange(i + 1)
        after exchange(i) (a row evicted by one and loaded by the next goes host-ward, then back);
        every other move of rows (flush, drop, a fill on another stream, the way back) first waits
        for the exchange stream's latest event (_join_aside); the forward that takes the
        prefetched batch waits for the exchange stream's latest event then (module.prefetch /
        _CacheStreams.wait_for), and every use that waits for all other streams (a forward's own
        lookup, a backward's second lookup, flush, the statistics) for it too (_CacheStreams.moved)."""
        return env_flag("TBEGEN_CACHE_LOOKUP_STREAM", True) and self._exchange_blocks > 0

    def _prefetch_warm_on(self) -> bool:
        """Whether a prefetch that the held rule would defer for want of slots warms the cache
        instead (issue 27). The default with LRU (self.algorithm, set before this is read); with LFU
        the prefetch is deferred whole, the early deferral skipping lookups (_too_short).
        TBEGEN_CACHE_PREFETCH_WARM overrides either: "1" warms, "0" defers (the way back); unset or
        empty: the algorithm's default; anything else is refused; read when the cache is made.
        Measured on the H100 (docs/gpu-runs/2026-12-05-landing14/cache, bench_cache C2
        rowwise_adagrad, LRU, TorchRec's order, one process): at a 10% cache 30.87 -> 26.71 ms a
        step (the hit rate of distinct rows 0.431 -> 0.976, 1.06 M rows warmed a step; two host
        waits a step instead of one, the warm needing the prefetch's lookup). Elsewhere it changes
        nothing, the rows differing by the run's drift only: at 5% (40.98 -> 40.25) every batch
        reads rows in place, so each prefetch beside it is still deferred before its lookup; at 20%
        (median 16.86 -> 19.45, wall clock 18.07 -> 17.98) no prefetch is deferred. In-step on CUDA
        each forward's own lookup takes the warm's path (module._lookup_beside): 22.32 / 29.49 /
        39.72 ms at 20 / 10 / 5% against 23.78 / 30.72 / 41.33 (the deferral, run first). With LFU, on the CPU
        (benchmarks/cache_prepare_ops.py --pipelined --warm, C2's table shape at 10%) the rows
        loaded in all grew by 12%: the warm picks its victims while the held batch's recent but
        rarely read rows are protected and evicts more often read ones, so LFU keeps the deferral.
        Where the cache is too small for two batches (C2 at a 10% cache: ~1.4k of a prefetch's
        ~40.8k rows to load a table do not fit beside the held batch's) a deferred prefetch changes
        nothing, so pipelining gains nothing there (landing13, H100: 22.40 ms a step pipelined,
        22.46 in-step, against 17.80 -> 12.79 at 20%, where the prefetch's exchange runs beside the
        backward before). Warming loads the part of the batch's missing rows that fits (prepare,
        _warm): per table its first missing rows in key order, as many as the slots that neither
        the batch's hits nor a held batch use, into the coldest of those slots; no prepared batch
        is recorded (its forward looks the batch up as after a deferral, finds the warmed rows
        resident and loads only the rest). It replaces the early deferral (_too_short: the warm
        needs the lookup); a batch in flight that read rows in place still defers the prefetch
        (nothing moves then). Slots of held batches are never victims, so their tickets stay valid.
        The same numbers either way in fp32 (a row's slot does not change its bits; fp16 with
        stochastic rounding is keyed by slot)."""
        return env_flag("TBEGEN_CACHE_PREFETCH_WARM", self.algorithm == "lru")

    def _key_sort_width(self, device: torch.device) -> int:
        """The key bits prepare's sort reads with the runtime's _sort_keys (on CUDA: the bits of the
        largest key, nr + _SENT_KEEP; C2's 32 M rows: 25 bits, three radix passes instead of
        torch.sort's four of a 32-bit key, and int32 positions instead of int64), or 0 where it
        sorts with torch.sort (the CPU, a build without the operator, TBEGEN_CACHE_KEY_SORT=0: the
        way back). Either way the same stable order: the same sorted keys and permutation."""
        on = env_flag("TBEGEN_CACHE_KEY_SORT", True)
        if device.type != "cuda" or self._key_sort_op is None or not on:
            return 0
        return (self.num_rows + _SENT_KEEP).bit_length()

    def _sort_keys(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """`keys` sorted stably, and each sorted key's position (int64, or int32 from _sort_keys)."""
        if self._key_sort_bits and keys.numel() < 2 ** 31 - 1:
            return self._key_sort_op(keys, self._key_sort_bits)
        return torch.sort(keys, stable=True)

    def to(self, device: torch.device) -> None:
        """Moves the cache's bookkeeping to `device`, empty (flush first: the slots' contents are
        not carried). The LFU access counts are kept."""
        self._join_writeback()
        self._join_aside()
        self._allocate(device)
        self.epoch += 1
        self._release_all()

    def _zero_stats(self) -> Dict[str, int]:
        return dict(prepares=0, lookups=0, hits=0, unique_rows=0, unique_hits=0, rows_loaded=0,
                    rows_written_back=0, bytes_loaded=0, bytes_written_back=0, evictions=0,
                    bypasses=0, backing_lookups=0, backing_rows=0, deferred=0, deferred_early=0,
                    warmed=0, rows_warmed=0)

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

    _KINDS = ("element", "int8 rows", "row")  # (a buffer's layout: see _move)

    _move_shared: Optional[dict] = None  # (set by _fill around its two moves: see _move)

    def _move(self, buffers, c: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, to_slots: bool,
              staged: Optional[list] = None, per_table: Optional[Sequence[int]] = None) -> None:
        """Copies rows (and their states) of cached tables `c` between backing row `rows` and local
        slot `slots`, in every buffer: `buffers` is [(flat tensor, "element" | "row" | "int8 rows")]
        ("int8 rows": the weights of weights_dtype int8, a byte buffer in which the row of element
        offset o and key k is the D + 8 bytes from o + 8k: codes and qparams move together).
        With `staged` (a list), the sources are gathered now and the writes are appended to it as
        (view, destination rows, gathered rows), for `_write_staged` to issue later. With
        `per_table` (how many of the rows are of each cached table, known to the host), the rows
        of each width are picked without a host wait. `_move_shared` (a dict that _fill sets
        around two moves of the same `c`, `slots` and `per_table`, its write-back and its loads
        where the cache is full; None elsewhere): the rows of each width, their tables' bases and
        the slots' positions made by the first, reused by the second.

        The positions, per width D: for every layout kind present at once, in that kind's units
        (the rows of `unit` entries each buffer is viewed as: _copy_runs), one gather of each
        table's first units (backing rows and slots) and one multiply-add each way, base + row *
        (units a row): a [kinds, rows] tensor each way (the per-row states are rows of one entry: base = key
        base, one unit a row)."""
        if rows.numel() == 0:
            return
        T = self._t
        shared = self._move_shared
        if shared is not None:  # (only for the very tensors it was made for)
            of = shared.setdefault("of", (c, slots, list(per_table or ())))
            if not (of[0] is c and of[1] is slots and of[2] == list(per_table or ())):
                shared = None
        kinds = tuple(k for k in self._KINDS if any(per == k for _, per in buffers))
        for D in self._dims:
            sel = None
            if len(self._dims) > 1:
                sel = None if shared is None else shared.get(("sel", D))
                if sel is None:
                    if per_table is not None:
                        n = sum(k for k, d in zip(per_table, self.dims) if d == D)
                        sel = self._compact(T["D"][c] == D, n) if n else False
                    else:
                        sel = (T["D"][c] == D).nonzero().squeeze(1)
                    if shared is not None:
                        shared[("sel", D)] = sel
                if sel is False:  # (no row of this width)
                    continue
            bases, per_row, units = self._run_tables(kinds, D)
            cc = c if sel is None else c.index_select(0, sel)
            rr = rows if sel is None else rows.index_select(0, sel)
            # each row's table's first units, backing rows' then slots': one gather for both
            got = None if shared is None else shared.get(("bases", D))
            if got is None:
                got = bases.index_select(1, cc).split(len(kinds))
                if shared is not None:
                    shared[("bases", D)] = got
            back = torch.addcmul(got[0], per_row, rr).unbind(0)
            slot = None if shared is None else shared.get(("slot", D))
            if slot is None:
                ss = slots if sel is None else slots.index_select(0, sel)
                slot = torch.addcmul(got[1], per_row, ss).unbind(0)
                if shared is not None:
                    shared[("slot", D)] = slot
            for j, kind in enumerate(kinds):
                self._copy_runs(buffers, kind, back[j], slot[j], units[j][1], units[j][0], to_slots, staged)

    def _run_tables(self, kinds: Tuple[str, ...], D: int):
        """For _move, the rows of width D of layout kinds `kinds`, on the cache's device (made once
        per set, without a host copy): each table's first unit in its backing rows, then in its
        slots ([2 x kinds, tables], int64; a table of another width has values never read), the
        units a row spans ([kinds, 1]), and per kind (unit, units a row)."""
        tables = getattr(self, "_runs", None)
        if tables is None or tables[0] != self.device:
            tables = self._runs = (self.device, {})
        got = tables[1].get((kinds, D))
        if got is None:
            T = self._t
            back, slot, units = [], [], []
            for kind in kinds:
                if kind == "element":
                    unit = self._units[("element", D)]
                    back.append(T["back_woff"] // unit)
                    slot.append(T["slot_woff"] // unit)
                    units.append((unit, D // unit))
                elif kind == "int8 rows":
                    unit = self._units[("int8 rows", D)]
                    back.append((T["back_woff"] + QPARAM_BYTES * T["back_kbase"]) // unit)
                    slot.append((T["slot_woff"] + QPARAM_BYTES * T["slot_kbase"]) // unit)
                    units.append((unit, (D + QPARAM_BYTES) // unit))
                else:  # (a per-row state: one entry per row key)
                    back.append(T["back_kbase"])
                    slot.append(T["slot_kbase"])
                    units.append((1, 1))
            per_row = torch.stack([torch.full((1,), n, dtype=torch.int64, device=self.device) for _, n in units])
            got = (torch.stack(back + slot), per_row, units)
            tables[1][(kinds, D)] = got
        return got

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

    def _copy_runs(self, buffers, kind: str, back: torch.Tensor, slot: torch.Tensor, per_run: int, unit: int,
                   to_slots: bool, staged: Optional[list] = None) -> None:
        """In every buffer of layout `kind`, copies the runs of `per_run` units starting at unit
        `back` to those starting at unit `slot` (or the other way round): each buffer is viewed
        as rows of `unit` entries, and the runs move as whole rows of that view (index_select,
        then index_copy_: row-wide copies, no per-entry index), in chunks that bound the
        temporary copy (one where it fits). A run of several units is expanded into its units
        once for all the kind's buffers. The slots never overlap the backing rows, and each
        destination run is written once. On CUDA the rows move with _copy_rows on its bounded
        grid (a per-row state's staged gather too)."""
        targets = [buf for buf, per in buffers if per == kind]
        if not targets:
            return
        src, dst = (back, slot) if to_slots else (slot, back)
        if per_run > 1:
            parts = self._parts(per_run)
            src = torch.add(src.unsqueeze(1), parts).view(-1)
            dst = torch.add(dst.unsqueeze(1), parts).view(-1)
        step = max(1, _CHUNK_ELEMENTS // unit)
        for buf in targets:
            n = buf.numel()
            view = _wide_rows((buf if n % unit == 0 else buf[: n // unit * unit]).view(-1, unit))
            if self._row_copy_blocks and staged is None:  # (CUDA: from row to row, no temporary copy)
                self._row_copy_op(view, dst, view, src, self._row_copy_blocks)
                continue
            if self._row_copy_blocks and kind == "row":
                # (CUDA: a per-row state's evicted rows gathered on the bounded grid too:
                # index_select would hold every SM, and the loads would wait for it)
                gathered = torch.empty((src.numel(), 1), dtype=buf.dtype, device=buf.device)
                self._row_copy_op(gathered, None, view, src, self._row_copy_blocks)
                staged.append((view, dst, gathered))
                continue
            if src.numel() <= step:
                _copy_or_stage(view, dst, view.index_select(0, src), staged)
                continue
            for lo in range(0, src.numel(), step):
                _copy_or_stage(view, dst[lo:lo + step], view.index_select(0, src[lo:lo + step]), staged)

    def _parts(self, per_run: int) -> torch.Tensor:
        """0, 1, ..., per_run - 1 on the device (kept: a run's units, _copy_runs)."""
        parts = getattr(self, "_run_parts", {})
        got = parts.get(per_run)
        if got is None or got.device != self.device:
            got = parts[per_run] = torch.arange(per_run, device=self.device)
            self._run_parts = parts
        return got

    def _exchange(self, buffers, c: torch.Tensor, slots: torch.Tensor, out_rows: Optional[torch.Tensor],
                  in_rows: torch.Tensor, per_table: Sequence[int], launches: Optional[list] = None) -> None:
        """The fill's moves in one kernel per buffer (the default on CUDA: _exchange_rows,
        row_copy_cuda.cuh): for each victim, local slot `slots[i]` of cached table c[i], its old
        row `out_rows[i]` (a local row of the table; -1 where the slot holds none; `out_rows` None:
        nothing is written back) goes to its backing row and backing row `in_rows[i]` arrives in
        the slot, in every buffer. Each warp then keeps both directions of the host link busy,
        with no staging copy of the evicted rows and no side stream. `per_table`: how many of the
        victims are of each cached table (known to the host: the rows of each width are picked
        without a host wait). `launches` (a list, TBEGEN_CACHE_LOOKUP_STREAM on): the index
        arithmetic runs now, on this stream, and each kernel launch is appended to it as
        (operator, arguments) for _launch_aside to issue on the exchange stream."""
        if in_rows.numel() == 0:
            return
        T = self._t
        kinds = tuple(k for k in self._KINDS if any(per == k for _, per in buffers))
        for D in self._dims:
            sel = None
            if len(self._dims) > 1:
                n = sum(k for k, d in zip(per_table, self.dims) if d == D)
                if n == 0:
                    continue
                sel = self._compact(T["D"][c] == D, n)
            cc, ss, ii = (c, slots, in_rows) if sel is None else (c[sel], slots[sel], in_rows[sel])
            oo = out_rows if out_rows is None or sel is None else out_rows[sel]
            # each row's first unit in every layout kind's units, as _move places them (_run_tables)
            bases, per_row, units = self._run_tables(kinds, D)
            got = bases.index_select(1, cc).split(len(kinds))
            slot = torch.addcmul(got[1], per_row, ss).unbind(0)
            back_in = torch.addcmul(got[0], per_row, ii).unbind(0)
            # (a slot without a row to write back: -1 in every kind; its addcmul is discarded)
            back_out = ((None,) * len(kinds) if oo is None else
                        torch.addcmul(got[0], per_row, oo).masked_fill_(oo < 0, -1).unbind(0))
            if self._exchange_states and kinds == ("element", "row") and self._exchange_with_states(
                    buffers, slot, back_out, back_in, units[0], launches):
                continue
            for j, kind in enumerate(kinds):
                self._exchange_runs(buffers, kind, slot[j], back_out[j], back_in[j], units[j][1], units[j][0],
                                    launches)

    def _exchange_with_states(self, buffers, slot, back_out, back_in, unit_run,
                              launches: Optional[list] = None) -> bool:
        """_exchange's moves of one width where the buffers are of the "element" and "row" layouts
        (TBEGEN_CACHE_EXCHANGE_STATES=1): one _exchange_rows_with_states launch per element buffer,
        the first ones carrying the per-row state buffers (up to 4 each), so that victim i's states
        move in the warp that moves its row. `slot`, `back_out`, `back_in`: the victims' first
        units (element kind, then row kind: _run_tables); `unit_run`: the element kind's (unit,
        units a row). Each element buffer is viewed as rows of a whole row (D entries) starting
        at every unit (rows `unit` entries apart, overlapping where a row spans several units),
        so that one entry is one victim's row. False (nothing moved) where the states outnumber
        what the element buffers carry."""
        per_launch = 4  # (the operator's kMaxStates)
        elements = [buf for buf, per in buffers if per == "element"]
        states = [buf for buf, per in buffers if per == "row"]
        if not elements or len(states) > per_launch * len(elements):
            return False
        unit, per_run = unit_run
        width = unit * per_run
        for k, buf in enumerate(elements):
            count = (buf.numel() - width) // unit + 1 if buf.numel() >= width else 0
            view = buf.as_strided((count, width), (unit, 1))
            mine = states[k * per_launch:(k + 1) * per_launch]
            _launch(launches, self._exchange_states_op, view, slot[0], back_out[0], back_in[0], mine, slot[1],
                    back_out[1], back_in[1], self._exchange_blocks)
        return True

    def _exchange_runs(self, buffers, kind: str, slot: torch.Tensor, back_out: Optional[torch.Tensor],
                       back_in: torch.Tensor, per_run: int, unit: int, launches: Optional[list] = None) -> None:
        """_exchange for the buffers of layout `kind`, each viewed as rows of `unit` entries (as
        _copy_runs views them): the runs of `per_run` such rows from the first rows `slot`,
        `back_out` (-1: none) and `back_in`."""
        targets = [buf for buf, per in buffers if per == kind]
        if not targets:
            return
        parts = torch.arange(per_run, device=self.device) if per_run > 1 else None

        def unit_rows(first: torch.Tensor) -> torch.Tensor:
            return first if parts is None else (first[:, None] + parts).reshape(-1)

        s, i = unit_rows(slot), unit_rows(back_in)
        o = back_out  # (-1 or a row: one unit row per row as it is)
        if back_out is not None and parts is not None:  # (a run without a row to write back stays -1 in all its parts)
            o = torch.where(back_out[:, None] < 0, -1, back_out[:, None] + parts).reshape(-1)
        for buf in targets:
            view = _wide_rows(buf[: buf.numel() // unit * unit].view(-1, unit))
            _launch(launches, self._exchange_op, view, s, o, i, self._exchange_blocks)

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

    def _launch_aside(self, launches: list, rows_wait: Optional[callable] = None) -> None:
        """Issues a prefetch's exchange kernels (`launches`: (operator, arguments), _exchange) on the
        exchange stream (TBEGEN_CACHE_LOOKUP_STREAM on, _exchange_aside_on), so that the next
        prefetch's lookup on this stream does not queue behind them. Who reads and writes what:
        - the exchange kernels read their index tensors (made on this stream by the fill's index
          arithmetic, just queued) and read and write the buffers' victim slots and the backing
          rows of the victims' old and new rows; they touch no bookkeeping tensor;
        - the lookup of the next batch (this stream) reads and writes the bookkeeping only (row to
          slot, slot to row, last use, dirty flags, counts, holds), which this fill wrote on this
          stream before the event below: that batch sees this fill's slot map without waiting
          for the rows to arrive.
        So the exchange stream waits for an event recorded here, after this fill's bookkeeping and
        index arithmetic (everything its kernels read), and, through `rows_wait` (the module's
        _CacheStreams.wait_rows), for the end of the other streams' latest uses: the backward
        before, whose kernels update rows this exchange may write back (this stream waited only
        for that backward's dirty flags); its own order keeps each exchange after the one before.
        The index tensors are recorded as used by the exchange stream (_hand_off: this
        stream drops them on return). The event after the kernels (`_aside_done`, also handed to
        the module through `_aside_new`) is what the forward of the batch, and every other move of
        rows, waits for."""
        current = torch.cuda.current_stream(self.device)
        if self._aside_stream is None:
            self._aside_stream = torch.cuda.Stream(self.device)
        side = self._aside_stream
        ready = torch.cuda.Event()
        ready.record(current)
        side.wait_event(ready)
        if rows_wait is not None:  # (what the prefetch's lookup did not wait for: module._CacheStreams.mark)
            rows_wait(side)
        with torch.cuda.stream(side):
            for op, args in launches:
                _hand_off([a for a in args if isinstance(a, torch.Tensor)], side)
                op(*args)
        done = torch.cuda.Event()
        done.record(side)
        self._aside_done = self._aside_new = (side, done)

    def _join_aside(self, rows_wait: Optional[callable] = None) -> None:
        """The current stream waits for the exchange stream's latest kernels (before it moves rows
        itself: a row they write back may be loaded again, a slot they load may be evicted), and,
        with `rows_wait` (prepare's), for what its lookup did not wait for."""
        if self._aside_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._aside_done[1])
        if rows_wait is not None:
            rows_wait(torch.cuda.current_stream(self.device))

    def take_aside(self):
        """(stream, event) after the exchange kernels the latest prepare issued on the exchange
        stream, once (None where it issued none): for the module's stream order."""
        got, self._aside_new = self._aside_new, None
        return got

    def __getstate__(self):
        # (streams and events are not copied: a copy starts with none, its moves on its own streams)
        state = dict(self.__dict__)
        state.update(_side=None, _writeback_pending=False, _aside_stream=None, _aside_done=None, _aside_new=None)
        return state

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
        self._join_aside()
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

    def drop(self, buffers, tables: Sequence[int], readers_wait: Optional[callable] = None,
             rows_wait: Optional[callable] = None) -> None:
        """Writes back and empties the caches of cached tables `tables` (before a batch reads
        and updates their backing rows directly). Without a host wait: the host knows how many
        rows each table holds (`_occupied`); all of them are written back while some slot may be
        dirty (a clean row's bytes are its backing row's), and the statistics count the dirty ones."""
        self._before_unheld_move(readers_wait, evicting_held=True)  # (`readers_wait`: a prefetch's)
        self._join_writeback()
        self._join_aside(rows_wait)  # (`rows_wait`: a prefetch's, prepare)
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
        self._join_aside()
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

    def release(self, ticket: Ticket) -> None:
        self._held = [t for t in self._held if t is not ticket]
        self._in_flight_backing = [t for t in self._in_flight_backing if t is not ticket]

    def _backing_in_flight(self) -> bool:
        """Whether a batch in flight read rows in their backing rows and is still valid (an older
        one is prepared again by its backward whatever happens now)."""
        self._in_flight_backing = [t for t in self._in_flight_backing if t.epoch == self.epoch]
        return bool(self._in_flight_backing)

    # A prefetch that the held rule defers (prepare: its rows would need slots held for the batch
    # in flight) is deferred after its whole lookup: the sort, the host wait for the summary, and
    # then nothing, its forward looking the batch up again. Where the cache is too small for two
    # batches (C2 at a 10% cache: ~60.6k distinct rows a batch a table beside a held batch's
    # ~60.6k, ~19.8k of them shared: ~101.4k rows for 100k slots) that is every prefetch: two
    # lookups and two host waits a batch (landing12, H100: pipelined 25.90 ms a step against 23.81
    # in-step). The prediction below defers such prefetches before their lookup, from host-known
    # numbers only (no clock, no device read: deterministic). Deferral is neutral for the numbers
    # (a deferred prefetch changed nothing; the forward looks its batch up), so a wrong guess costs
    # time, never bits (and a skipped prefetch's bad index, bounds_check_mode "raise", is named by
    # its forward, as where a batch read in place defers it).
    # - It learns from a looked-up prefetch that the held rule deferred: per table, its shortfall
    #   s (the rows it would admit less the slots neither its hits nor held for other batches:
    #   its rows and the held ones, less the slots), the held batches' distinct rows (their
    #   tickets' rows_per_table), its own distinct rows, and its number of indices (_note_short).
    # - A shortfall is "large" where s * s >= 8 * (C + s), C the table's slots: at least twice the
    #   standard deviation of the difference between two prefetches' counts of rows (C + s, the
    #   held rows and the batch's together); for batches drawn independently that count is a sum
    #   of row indicators whose variance is at most its mean, the difference's at most twice it.
    #   C2 at 10% (C = 100k): s = 1449 on average (the count's true deviation 254), large from
    #   899 (0.9% of the slots). A fixed fraction of the slots would not do: 1/8 of them never
    #   comes at C2's 10%, where every prefetch is deferred, and a few slots of a tiny table do.
    # - One deferral alone teaches nothing (the held rule also defers now and then where batches
    #   vary; TorchRec's pipeline test on tables of 10-16 slots must still take most prefetches):
    #   the 2nd, 3rd, 4th, 5th... consecutive large-shortfall deferral of a looked-up prefetch
    #   skips the next 1, 2, 4, 8, 8... prefetches' lookups. The backoff leaves a probe (a lookup)
    #   every 9th prefetch at least, so that a shrinking batch, or hits that grow, are noticed.
    # - A skip only while the shortfall so predicted stays large in some table: the last one, less
    #   what the held batches' distinct rows fell by since (host-known), less what a prefetched
    #   batch with fewer indices loses (its distinct rows in proportion at most: they grow less
    #   than linearly with the indices). Else the prefetch is looked up (an early probe).
    # - A looked-up prefetch that fits, or is short by little, ends the run.
    # So where prefetches fit (a 20% cache) nothing changes: no held deferral, no skip. Skips count
    # in `deferred` (they are deferrals) and `deferred_early` (prefetches deferred before their
    # lookup, with those beside a batch read in place).
    _SHORT_SKIPS_MAX = 8

    def _large_short(self, k: int, s: int) -> bool:
        """Whether table k's shortfall of `s` slots is large (see above)."""
        return s > 0 and s * s >= 8 * (self.slots[k] + s)

    def _note_short(self, short: Sequence[int], need: Sequence[int], n: int) -> None:
        """A looked-up prefetch was deferred by the held rule, short of `short[k]` slots in table k
        (its distinct rows `need`, `n` indices): the run of large shortfalls goes on, or ends."""
        big = tuple((k, s, h, need[k]) for k, (s, h) in enumerate(zip(short, self._held_rows()))
                    if self._large_short(k, s))
        if not big:
            self._short_ends()
            return
        # (the run's count stops where the skips reach their bound, 2 + ceil(log2) of it: a run that
        # never ends, every prefetch short for the whole training, costs no more per probe with its length)
        self._short_run = min(self._short_run + 1, 2 + (self._SHORT_SKIPS_MAX - 1).bit_length())
        self._short_skips = 0 if self._short_run < 2 else min(1 << (self._short_run - 2), self._SHORT_SKIPS_MAX)
        self._short_seen = (n, big)

    def _too_short(self, n: int) -> bool:
        """Whether a prefetch of `n` indices is deferred before its lookup: a skip left, and some
        table's shortfall predicted large still (see above)."""
        if self._short_skips <= 0 or self._short_seen is None:
            return False
        n0, big = self._short_seen
        held = self._held_rows()
        for k, s, h, need in big:
            fewer = -(-need * (n0 - n) // n0) if n < n0 else 0  # (ceil: a smaller batch's rows at most)
            if self._large_short(k, s - max(0, h - held[k]) - fewer):
                self._short_skips -= 1
                return True
        return False

    def _held_rows(self) -> List[int]:
        """Per cached table, the distinct rows of the batches held (host-known, their tickets')."""
        rows = [0] * len(self.tables)
        for t in self._held:
            for k, r in enumerate(t.rows_per_table):
                rows[k] += r
        return rows

    def _short_ends(self) -> None:
        """A looked-up prefetch was not deferred by the held rule: no skip until it defers again."""
        self._short_run = self._short_skips = 0
        self._short_seen = None

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
        """Makes every row that `indices` reads of a cached table resident and returns the
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
        (_before_unheld_move). `rows_wait` (a prefetch's with TBEGEN_CACHE_LOOKUP_STREAM on, whose
        lookup waited only for the bookkeeping of other streams' uses, module._CacheStreams.mark):
        rows_wait(stream) makes `stream` wait for the rest of them (the kernels of the backward
        before, which update rows a fill may evict), before rows move: on the exchange stream
        (_launch_aside) or on this one (a drop: _join_aside). `aside`: whether the fill's exchange
        goes on the exchange stream (with TBEGEN_CACHE_LOOKUP_STREAM on); None: where `defer` (a
        prefetch's); True for a forward's own lookup that waits as a prefetch's does
        (module._lookup_beside, with the warm: LRU's default, _prefetch_warm_on).

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
        if defer and self._all_direct and self._backing_in_flight():
            # A batch in flight read rows in place (more distinct rows of a direct table than its
            # slots), so this prefetch would be deferred anyway once its lookup found a row to move
            # (below; with every table direct none is bypassed): deferred now, without that lookup,
            # its host wait and its device work, and the forward looks the batch up itself
            # (landing11, H100, C2 at a 5% cache: every prefetch deferred after its lookup, two
            # lookups a batch; the pipelined step 34.90 ms against 32.90 in-step).
            st["deferred"] += 1
            st["deferred_early"] += 1
            return None
        if defer and not self._warm and self._too_short(N):
            # The held rule deferred the prefetches before this one for want of many slots, and
            # the batches held now are about as large: deferred before its lookup (_too_short)
            st["deferred"] += 1
            st["deferred_early"] += 1
            return None
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
            sk, perm = self._sort_keys(keys)
            first = torch.cat([self._true1, sk[1:] != sk[:-1]])
            slot_k = self._row_slot_ext.index_select(0, sk)  # (int32; -1 for keys not looked up)
            miss_k = slot_k < 0
            # per table (its keys are contiguous), the running counts of entries (the edges),
            # distinct keys and missing distinct keys at its first key: the host takes differences
            edges = torch.searchsorted(sk, self._edge_keys)
            running = torch.empty((2, N + 1), dtype=ct, device=dev)
            running.select(1, 0).zero_()
            # (each sorted entry's distinct key, from 1; its missing distinct key, from 1)
            ranks, miss_ranks = running[0, 1:], running[1, 1:]
            torch.cumsum(first, 0, dtype=ct, out=ranks)
            torch.cumsum(first & miss_k, 0, dtype=ct, out=miss_ranks)
            at_edges = running.index_select(1, edges)
            # (views made while the device is behind, for the fill: each table's first missing row
            # among them all, where every missing row is loaded)
            miss_first = at_edges[1, :nc]
            parts = [edges, at_edges.reshape(-1), miss_k.sum().reshape(1)]
            # (where the last batch had a direct table with more distinct rows than its slots, this
            # one likely has too: the rows it admits are planned now, while the device is behind;
            # not by a prefetch that such a batch defers)
            plan = None
            if self._admit_ahead and not (defer and self._backing_in_flight()):
                plan = self._admit_plan(at_edges)
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
            self._overflow(buffers, over, need_h, readers_wait, rows_wait)
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
        self._admit_ahead = admit != miss_h
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
                if self._warm:
                    # (the warm: LRU's default, _prefetch_warm_on) the part of its missing rows that fits beside the
                    # held slots is loaded now (_warm); the batch is still left to its forward
                    self._warm_part(buffers, sk, miss_ranks, at_edges, held, mine, held_running, admit, miss_h,
                                    need_h, extra, readers_wait, rows_wait)
                    return None
                self._note_short([a - (C - (n - mi) - x) for a, mi, n, C, x
                                  in zip(admit, miss_h, need_h, self.slots, extra)], need_h, N)
                return None
            self._release_all()
            held = None
        elif defer:
            self._short_ends()
        # sorted positions of each distinct row's first entry, then the end of the looked-up ones
        # (the first entry not looked up, or N)
        at_end = torch.searchsorted(ranks, self._iota(n_unique + 1, ct, 1))
        at = at_end[:-1]
        U = sk.index_select(0, at)
        tU = torch.searchsorted(self._table_ends, U, right=True)
        slot = slot_k.index_select(0, at)  # (int32; -1: missing)
        sbase_u = T["sbase"].index_select(0, tU)
        self.tick += 1
        tick = self.tick
        if sum(admit):
            missing_u = slot < 0
            if admit == miss_h:  # every missing row: the sorted positions of the missing firsts
                at_miss = torch.searchsorted(miss_ranks, self._iota(n_miss, ct, 1))
                mU = sk.index_select(0, at_miss)
                mT = torch.searchsorted(self._table_ends, mU, right=True)
            else:
                # per table, its most read missing rows (then by row), as many as it admits: one
                # stable sort of the distinct rows by (table, a missing row's count, most first;
                # hits last), then each table's first admit[k] (those it plans: _admit_plan)
                if plan is None:
                    plan = self._admit_plan(at_edges)
                miss_first, shift = plan
                minus = (at - at_end[1:]) * missing_u  # (minus a missing row's count; a hit 0)
                order = torch.argsort(torch.add(minus, tU, alpha=n_looked + 1), stable=True)
                j = self._iota(sum(admit))
                mT = torch.searchsorted(miss_first[1:], j, right=True)
                mU = U.index_select(0, order.index_select(0, j + shift.index_select(0, mT)))
            mRow = mU - T["rbase"].index_select(0, mT)
            # the batch's own slots (its hit rows'; the others point at the extra entry)
            protect = (sbase_u + slot).masked_fill_(missing_u, self.num_slots)
            with span("tbegen.cache.fill"):
                self._fill(buffers, mU, mT, mRow, protect, admit, held, readers_wait,
                           aside=self._aside and (defer if aside is None else aside),
                           rows_wait=rows_wait, first=miss_first)
        counts = None
        if self.algorithm == "lfu" or admit != miss_h:
            counts = at_end[1:] - at  # how often the batch reads each distinct row
        if self.algorithm == "lfu":
            # (after the fill, whose exchange is then queued sooner: the counts of the batch's
            # rows order no victim, those in slots being protected, nor does a higher bound)
            self._counts.index_put_((U,), counts, accumulate=True)  # (U distinct: an add)
            self._count_bound += n_looked
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
                      self._features_for(bypass), bypass, self.hard_epoch, bool(bypass) or sum(n_backing) > 0,
                      tuple(need_h))

    def _admit_plan(self, at_edges: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Where a direct table has more distinct rows in the batch than slots (it admits only
        admit[k] = missing - (distinct - slots) of its missing rows), prepare's plan of the admitted
        rows, from the summary's running counts at each table's first key (`at_edges`, on the
        device, so that it needs no host-known size and is issued before the host wait): per
        table, the first of its admitted rows among all of them (a cumulative sum of admit), and
        `shift`, where its first admitted row is in the distinct rows sorted by (table, missing
        before hit) less that: the j-th admitted row (of table t) is that order's j + shift[t]."""
        nc = len(self.tables)
        a = at_edges[:, :nc + 1]
        per = a[:, 1:] - a[:, :-1]  # per table: distinct rows, missing rows
        admit = per[1] - (per[0] - self._t["C"]).clamp_(min=0)
        first = torch.cumsum(admit, 0).sub_(admit)
        return first, a[0, :nc] - first

    def _warm_part(self, buffers, sk, miss_ranks, at_edges, held, mine, held_running, admit, miss_h, need_h,
                   extra, readers_wait, rows_wait) -> None:
        """(the warm: LRU's default, TBEGEN_CACHE_PREFETCH_WARM; _prefetch_warm_on) A prefetch that the held rule defers warms
        the cache with the part of its missing rows that fits: per table, its first warm[k] missing
        rows in key order, warm[k] = min(the rows it would admit, the slots that neither its hits nor
        a held batch use), loaded into the coldest of those slots (never a held or hit slot: _fill's
        protection) and marked used now (a new tick: a later fill before its forward takes other
        victims first). No ticket and no access counts: its forward looks the batch up (finding the
        warmed rows resident, hits) and counts them. Without a host wait: the rows are picked from
        the lookup's sorted keys (`sk`, `miss_ranks`: each sorted entry's missing distinct key, from
        1), the summary's running counts at the tables' first keys (`at_edges`) and the held slots'
        running count (`held_running`), as the host computes warm[k] from the summary (`admit`,
        `miss_h`, `need_h`, `extra`); `mine`: the batch's hit slots (per sorted entry; num_slots
        for a missing one)."""
        C = self.slots
        warm_h = [max(0, min(a, c - (n - mi) - x)) for a, mi, n, c, x in zip(admit, miss_h, need_h, C, extra)]
        W = sum(warm_h)
        if W == 0:  # (every free-able slot is held: nothing fits, a plain deferral)
            return
        T = self._t
        nc = len(self.tables)
        # the same per table on the device: distinct rows n, missing rows mi, held slots x
        a = at_edges[:, :nc + 1]
        n, mi = (a[:, 1:] - a[:, :-1]).unbind(0)
        hr = held_running.index_select(0, self._slot_bounds)
        x = hr[1:] - hr[:-1]
        room = T["C"] - (n - mi) - x
        warm = torch.minimum(mi - (n - T["C"]).clamp(min=0), room).clamp_(min=0)
        ends = torch.cumsum(warm, 0)
        first = ends - warm  # (each table's first warmed row among them all)
        j = self._iota(W)
        mT = torch.searchsorted(ends, j, right=True)
        # the j-th warmed row (of table t): t's missing row of rank (from 1) j - first[t] + a[1, t] + 1
        rank = (j - first.index_select(0, mT) + a[1, :nc].index_select(0, mT) + 1).to(miss_ranks.dtype)
        mU = sk.index_select(0, torch.searchsorted(miss_ranks, rank))
        mRow = mU - T["rbase"].index_select(0, mT)
        with span("tbegen.cache.warm"), span("tbegen.cache.fill"):  # (a fill, within a warm)
            self._fill(buffers, mU, mT, mRow, mine, warm_h, held, readers_wait, aside=self._aside,
                       rows_wait=rows_wait, first=first)
        self.tick += 1
        self._last_used.index_fill_(0, T["sbase"].index_select(0, mT) + self._row_slot.index_select(0, mU), self.tick)
        self.stats["warmed"] += 1
        self.stats["rows_warmed"] += W

    def _kept(self, indices: torch.Tensor, perm: torch.Tensor, bad_direct: Tuple[int, int]) -> torch.Tensor:
        """A copy of the indices, where out-of-range ones of direct tables (the sorted entries
        bad_direct[0]..bad_direct[1]-1) are -1: their features reach past the table's rows, into
        its slots, and -1 is out of range for the kernels, which skip or report it per
        bounds_check_mode. Out-of-range indices of compact tables stay."""
        out = indices.clone()
        lo, hi = bad_direct
        if hi > lo:
            out.index_fill_(0, perm[lo:hi].to(torch.int64), -1)  # (index_fill_ takes int64 only)
        return out

    def _compact(self, mask: torch.Tensor, k: int) -> torch.Tensor:
        """The positions of the `k` True entries of `mask`, ascending, where the caller knows `k`
        (nonzero would make the host wait for the count): the i-th is the first position where
        the running count of True entries reaches i + 1."""
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.searchsorted(torch.cumsum(mask, 0), self._iota(k, start=1))

    def _overflow(self, buffers, over: Tuple[int, ...], need: Sequence[int], readers_wait=None,
                  rows_wait=None) -> None:
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
            self.drop(buffers, over, readers_wait, rows_wait)

    def _cold_geometry(self) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """For _coldest, made on first use on the cache's device: each slot's local number, where
        each slot goes in a [tables, most slots] grid (None where every table has as many slots:
        the slots are that grid), and (LFU) each slot's table's first row key. None where that grid
        would be more than twice the slots (tables of very different sizes: the sort then)."""
        g = getattr(self, "_cold", None)
        if g is not None and g[0] == self.device:
            return g[1]
        nt, width, S = len(self.tables), max(self.slots), self.num_slots
        out = None
        if nt * width <= 2 * S:
            local = torch.arange(S, device=self.device) - self._t["sbase"][self._slot_table]
            pad = None if nt * width == S else self._slot_table * width + local
            if width < 2 ** 31:  # (read by every fill: 4 bytes a slot; the key's add widens it)
                local = local.to(torch.int32)
            rbase = self._t["rbase"][self._slot_table] if self.algorithm == "lfu" else None
            out = (local, pad, rbase)
        self._cold = (self.device, out)
        return out

    def _coldest(self, protected: torch.Tensor, k: int) -> Optional[torch.Tensor]:
        """Per cached table, its `k` first slots in the victim order (see _victim_order: empty
        slots, then by last use (LRU) or by access count, then last use (LFU); ties by slot
        number; protected slots last), as local slot numbers, a [tables, k] tensor (a table of
        fewer than k slots: its row past them is padding, never used): without sorting every
        slot. Each slot's place in that order is one unique key per table (its score, then its
        local slot number), so a table's k smallest keys, in order, are its first k slots:
        torch.topk over each table's row of keys (a selection, then a sort of the k it keeps).
        None where the key would not fit 63 bits, or the grid of tables would cost more than
        twice the slots: then the caller sorts (_victim_order)."""
        geometry = self._cold_geometry()
        if geometry is None:
            return None
        local, pad, rbase = geometry
        width = max(self.slots)
        if self.algorithm == "lru":
            if self.tick >= _TICK_LIMIT:
                return None
            top = self.tick + 2  # empty (0) < last use (the last tick, at most tick) < protected
            score = torch.where(protected, top, self._last_used)
            span_ = (top + 1) * width
        else:
            # access count + 1 (empty: 0; protected: top, above every count), then last use
            top = self._count_bound + 2
            span_ = (top + 1) * (self.tick + 1) * width
            if span_ >= 2 ** 63:
                return None
            rows = torch.add(rbase, self._slot_row.clamp(min=0))
            freq = (self._counts.index_select(0, rows) + 1) * (self._slot_row >= 0)
            score = torch.where(protected, top * (self.tick + 1), torch.add(self._last_used, freq, alpha=self.tick + 1))
        key = torch.add(local, score, alpha=width)  # (score, then local slot: unique within a table)
        if span_ < 2 ** 31:  # (32 bits while it fits: the radix selection makes half the passes)
            key = key.to(torch.int32)
        if pad is not None:  # (the grid's cells past a table's slots: above every key)
            key = torch.full((len(self.tables) * width,), span_, dtype=key.dtype,
                             device=self.device).index_copy_(0, pad, key)
        return torch.topk(key.view(len(self.tables), width), k, dim=1, largest=False, sorted=True).indices

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
        if self.algorithm == "lfu":
            top = self._count_bound + 2  # (above every access count: protected)
            span_ = (top + 1) * (self.tick + 1)
            if len(self.tables) * span_ < 2 ** 63:
                # one sort: table in the high bits, then (empty 0 < access count + 1 < protected
                # top) then last use (at most tick): where _coldest's key, which adds the local
                # slot, would not fit, this one still does for long (the order of the two sorts
                # below, ties by slot number)
                rows = self._t["rbase"][self._slot_table] + self._slot_row.clamp(min=0)
                freq = (self._counts.index_select(0, rows) + 1) * (self._slot_row >= 0)
                score = torch.where(protected, top * (self.tick + 1),
                                    torch.add(self._last_used, freq, alpha=self.tick + 1))
                key = torch.add(score, self._slot_table, alpha=span_)
                if len(self.tables) * span_ < 2 ** 31:
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
              readers_wait: Optional[callable] = None, aside: bool = False,
              rows_wait: Optional[callable] = None, first: Optional[torch.Tensor] = None) -> None:
        """Loads rows (cached keys mU of tables mT, grouped by table: count_h[c] of table c) into
        the coldest slots of their tables (the j-th row of a table into its j-th coldest slot),
        never into the batch's own slots (`protect`: slot numbers, num_slots for none) or those
        `held` for other batches (num_slots + 1 entries). The caller marks the slots used.

        Without a host wait: a table's coldest slots are its empty ones first, so the host knows
        how many of its victims hold a row (evicted: `_occupied`, which it keeps). Every evicted
        row is written back (a clean one's slot holds its backing row's bits, so that write
        changes nothing), unless no slot can be dirty; the statistics count the dirty ones.

        `aside` (a prefetch's fill with TBEGEN_CACHE_LOOKUP_STREAM on): the exchange kernels are
        issued on the exchange stream after this fill's bookkeeping (_launch_aside); otherwise the
        rows move on this stream, after the exchange stream's latest kernels. `first` (prepare's,
        made before its host wait): each table's first row in mU; None: found here."""
        self._before_unheld_move(readers_wait)  # (holds let go since: their forwards may still read)
        if not aside:
            self._join_aside()
        T = self._t
        dev = self.device
        S = self.num_slots
        protected = torch.zeros(S + 1, dtype=torch.bool, device=dev) if held is None else held
        protected.index_fill_(0, protect, True)
        nt, M = len(self.tables), mU.numel()
        if first is None:  # (each table's first row in mT: given by prepare, or found, mT ascending)
            first = torch.searchsorted(mT, self._iota(nt))
        # the j-th row of its table takes that table's j-th coldest slot (never a protected one)
        k = max(count_h)
        coldest = self._coldest(protected[:S], k)
        if coldest is not None:  # (table t's j-th: entry t * k + j of its k coldest)
            # (T["table"]: 0, 1, ..., kept, so that no view of the iota is dispatched)
            at = torch.sub(first, T["table"], alpha=k).index_select(0, mT)
            local_slot = coldest.view(-1).index_select(0, self._iota(M) - at)
            width = max(self.slots)
            if nt * width == S:  # (every table has as many slots: table t's first slot is t * width)
                victims = torch.add(local_slot, mT, alpha=width)
            else:
                victims = T["sbase"].index_select(0, mT) + local_slot
        else:
            sb = T["sbase"][mT]
            order = self._victim_order(protected[:S])
            victims = order[self._iota(M) + (T["sbase"] - first)[mT]]
            local_slot = victims - sb
        old = self._slot_row[victims]
        evicted_h = [max(0, a - (C - n)) for a, C, n in zip(count_h, self.slots, self._occupied)]
        evicted = sum(evicted_h)
        # every victim holds a row where no table of the rows has an empty slot (a full cache)
        full = evicted == mU.numel()
        # On CUDA, by default, one kernel per buffer writes each victim's old row back and loads
        # its new row (_exchange; `old` is -1 for an empty slot: nothing written back for it).
        # Otherwise (the CPU, TBEGEN_CACHE_EXCHANGE=0) two copies: the evicted rows are gathered
        # out of their slots, then written to their backing rows on a side stream while the new
        # rows load on this one (opposite directions of the host link, different backing rows: an
        # evicted row is resident, a loaded one is not); this stream waits for both.
        exchange = self._exchange_blocks > 0
        launches = [] if aside and exchange else None
        staged: list = []
        # (where the cache is full, the write-back and the loads are of the same tables and slots:
        # the second move reuses the slots' positions the first made, _move)
        self._move_shared = {} if full else None
        if exchange:
            # (queued first: the device waits for every operator the host dispatches between the
            # batch's host wait and this, the step's largest kernel; the statistics and the
            # evicted rows' compaction below only read `old`, `victims` and the dirty flags, which
            # the exchange leaves alone, so the host dispatches them while it runs)
            self._join_writeback()  # (a flush's or a drop's write-back, if one is in flight)
            with span("tbegen.cache.exchange"):
                self._exchange(buffers, mT, local_slot, old if evicted and self._maybe_dirty else None, mRow, count_h,
                               launches)
        written = self._dirty[victims] if full else (old >= 0) & self._dirty[victims]
        # rows_written_back, bytes_written_back (read in report)
        if len(set(self.row_bytes)) == 1:
            self._device_stats[:2].add_(written.sum() * self._row_and_bytes)
        else:
            self._device_stats[:2].add_(torch.stack([written.sum(), (written * T["row_bytes"][mT]).sum()]))
        if full:
            te, oe, le = mT, old, local_slot
        elif evicted:  # (the victims that hold a row, grouped by table: a table's empty slots come first)
            e = self._compact(old >= 0, evicted)
            te, oe, le = mT[e], old[e], local_slot[e]
        if not exchange:
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
        self._move_shared = None
        self._row_slot[mU] = local_slot.to(torch.int32)
        self._slot_row[victims] = mRow
        self._dirty.index_fill_(0, victims, False)
        if launches:
            with span("tbegen.cache.exchange"):
                self._launch_aside(launches, rows_wait)
        self._occupied = [min(C, n + a) for C, n, a in zip(self.slots, self._occupied, count_h)]
        st = self.stats
        st["rows_loaded"] += mU.numel()
        st["bytes_loaded"] += self._bytes(count_h)
        st["evictions"] += evicted
