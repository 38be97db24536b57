#!/usr/bin/env python3
"""The row cache's lookup (RowCache.prepare) and fill, counted on the CPU: operators dispatched,
bytes of the tensors they make, and the host time of a prepare (issue 27).

    python3 benchmarks/cache_prepare_ops.py                          # 8 x 100k x 16, B 2048, L 20
    python3 benchmarks/cache_prepare_ops.py --cache 0.2 --algorithm lru --steps 3 --json out.json
    python3 benchmarks/cache_prepare_ops.py --pipelined    # the prefetch beside a held batch

A C2-like shape scaled down (C2: 32 tables x 1M rows x 128 fp32, B 16384, L 20, Zipf 1.1,
rowwise_adagrad): every table "managed_caching" with a cache of each --cache fraction of its
rows, LRU and LFU. The batches are bench_cache.py's (Zipf(alpha) ranks, a random permutation of
rows per table). Each batch is looked up as a training step does (the module's own bad-index
check, then its slots marked dirty as the backward marks them), after --warmup batches that fill
the cache, so the counted batches evict. With --pipelined, in TorchRec's order: each batch's
prefetch (prepare with defer) is counted while the previous batch is held (its forward ran), and
that batch's backward follows (a deferred prefetch's batch is looked up by its forward, uncounted;
the deferred column counts them, "early" those deferred before their lookup). The last column counts
every lookup (a sort of a batch's keys) and host wait (the summary's read) a step, of forwards,
prefetches and backwards alike, over the batches after the warm-up (--steps + --time-steps), and
the deferrals a step; --no-early-deferral looks every prefetch up (RowCache._too_short off), the
A/B of issue 27's prediction (C2 at a 10% cache: every prefetch deferred, two lookups a step).
--warm makes the cache with TBEGEN_CACHE_PREFETCH_WARM=1 (a prefetch the held rule would defer loads
the part of its missing rows that fits: RowCache._warm_part); the "rows loaded a step" column splits
the rows loaded over those batches by who loaded them: prefetches (warms included) / forwards /
backwards (a second lookup), and the rows the warms loaded ("warmed"). Without --warm the warm is
off with either algorithm (as TBEGEN_CACHE_PREFETCH_WARM=0; the module's default warms with LRU).

Per prepare, split at the batch's host wait (the span "tbegen.cache.host_wait"; on CUDA the host
dispatches everything "before" and then waits for the device to run it; "after" is what it
dispatches once it has read the summary, the fill excluded (of those, "gap": the ones before the
fill's first, the host's part between the wait and the fill; "to move": the gap and the fill's
operators before its first row move, which on CUDA the device waits for before the exchange
kernel, the step's largest, can start), and "fill" the fill's operators, row copies included):
  ops      aten operators dispatched (views included: each is a host-side dispatch on CUDA too;
           on CUDA most of the others are a kernel launch at 5-10 us of host time each), and the
           int32 index tensors that advanced indexing (x[i], x[i] = v) converts to int64 below the
           dispatcher, a hidden kernel each
  views    of those, views (no kernel, no bytes)
  MB       bytes of the tensors they make (outputs other than views and in-place results: the
           proxy for device time, each written once and most read again)
  full     of those tensors, those of at least N / 2 entries or of one per cache slot (+1): full-size
           passes over the batch's N indices or over the cache's slots
and the host time of one prepare (median of --time-steps batches, no dispatch mode, one thread):
a proxy only (the CPU runs the kernels too, so this is host dispatch plus CPU kernel time, not the
GPU's host overhead).

At the defaults, 20%, the fill: 105 ops (LRU) / 115 (LFU) before issue 27's rework, 79 / 92 with
the rework's lookup (one sort of every slot for the victims, LFU two; _move ~44 ops), 62 / 68 now
(b1b516d and after: each table's coldest slots by torch.topk of one unique key per slot; _move's
positions from one gather and one addcmul per direction for every layout kind): benchmarks/NOTES-gpu.md, "Cache:
the fill's victims without a sort of every slot". (torch.topk's and the old sort's internal passes
are not in MB: only the tensors an operator returns are.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tbegen.cache as cache_mod  # noqa: E402
from tbegen import TableBatchedEmbeddingBags  # noqa: E402

PHASES = ("before", "after", "fill")


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while active, per phase (set from outside), with the bytes
    and sizes of their non-view outputs."""

    def __init__(self, n_indices: int, n_slots: int):
        super().__init__()
        self.n_indices, self.n_slots = n_indices, n_slots
        self.phase = "before"
        self.gap = 0  # ops after the host wait and before the fill (in "after")
        self.filled = False
        self.to_move = 0  # the fill's ops before its first row move (exchange, write-back or load)
        self.moved = False
        self.ops = {p: collections.Counter() for p in PHASES}
        self.views = collections.Counter()
        self.bytes = collections.Counter()
        self.full = collections.Counter()
        self.full_ops = {p: collections.Counter() for p in PHASES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).replace("aten.", "")
        self.ops[self.phase][name] += 1
        if name in ("index", "index_put_", "index_put", "_index_put_impl_"):
            # advanced indexing converts int32 index tensors to int64 first (make_info, below the
            # dispatcher, unseen by this mode): a kernel and a pass over the index, counted here
            for index in args[1]:
                if isinstance(index, torch.Tensor) and index.dtype == torch.int32:
                    self.ops[self.phase]["(int32 index to int64)"] += 1
        if self.phase == "after" and not self.filled:
            self.gap += 1
        if self.phase == "fill" and not self.moved:
            self.to_move += 1
        if func.is_view:
            self.views[self.phase] += 1
            return out
        if func._schema.is_mutable:  # (in place: writes into a tensor it did not make)
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.bytes[self.phase] += t.numel() * t.element_size()
                if 2 * t.numel() >= self.n_indices or self.n_slots <= t.numel() <= self.n_slots + 1:
                    self.full[self.phase] += 1
                    self.full_ops[self.phase][name] += 1
        return out


@contextlib.contextmanager
def phases(counter: OpCounter, module=cache_mod):
    """Moves the counter's phase at the cache's named ranges (those of `module`, the cache's):
    after the host wait ("after"), into the fill ("fill") and back."""
    real = module.span

    @contextlib.contextmanager
    def span(name):
        if counter is None:
            with real(name):
                yield
            return
        if name == "tbegen.cache.host_wait":
            with real(name):
                yield
            counter.phase = "after"
        elif name == "tbegen.cache.fill":
            counter.phase = "fill"
            counter.filled = True
            with real(name):
                yield
            counter.phase = "after"
        elif name in ("tbegen.cache.writeback", "tbegen.cache.load"):  # (the exchange: its first kernel)
            counter.moved = True
            with real(name):
                yield
        else:
            with real(name):
                yield

    module.span = span
    try:
        yield
    finally:
        module.span = real


def zipf_batches(T, E, B, L, alpha, count, seed):
    """bench_cache.py's batches (table-major, T*B bags of L), on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, E + 1, dtype=torch.float64).pow(-alpha)
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].item()
    rank_to_row = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)])
    offsets = torch.arange(T * B + 1, dtype=torch.int64) * L
    out = []
    for _ in range(count):
        u = torch.rand((T, B * L), dtype=torch.float64, generator=gen)
        ranks = torch.searchsorted(cdf, u).clamp_(max=E - 1)
        rows = torch.gather(rank_to_row, 1, ranks)
        out.append((rows.reshape(-1).contiguous(), offsets))
    return out


def measure(args, fraction: float, algorithm: str) -> dict:
    T, E, D, B, L = args.tables, args.rows, args.dim, args.batch, args.pooling_factor
    emb = TableBatchedEmbeddingBags([(E, D)] * T, optimizer=args.optimizer, device="cpu", seed=args.seed,
                                    placements="managed_caching", cache_load_factor=fraction,
                                    cache_algorithm=algorithm)
    cache = emb._cache
    if args.exchange:
        # CUDA's fill path (one _exchange_rows launch per buffer), counted on the CPU: the operator
        # is CUDA's, so a stand-in that moves nothing takes its place (the cache's bookkeeping never
        # reads the rows; the weights trained here are not looked at)
        def first_kernel(rows, slot_rows, out_rows, in_rows, max_blocks):
            if counted:  # ('to move' ends at the first exchange kernel, its index arithmetic included)
                counted[-1].moved = True

        cache._exchange_op = first_kernel
        cache._row_copy_blocks = cache._exchange_blocks = 2
    counted = []  # (the counter of the prepare being counted, for the stand-in)
    # (--warm: what TBEGEN_CACHE_PREFETCH_WARM=1 sets when the cache is made, RowCache._prefetch_warm_on)
    cache._warm = args.warm
    if args.no_early_deferral:  # (the A/B of issue 27's prediction: every prefetch looked up, _too_short)
        cache._too_short = lambda n: False
    # every lookup (a sort of the batch's keys) and every host wait (the summary's read), from the
    # first batch after the warm-up on: the forwards', prefetches' and backwards' alike
    seen = collections.Counter()
    sort = cache._sort_keys

    def counted_sort(keys):
        seen["lookups"] += 1
        return sort(keys)

    cache._sort_keys = counted_sort
    module = sys.modules[type(cache).__module__]
    real_span = module.span

    def counted_span(name):
        seen["waits"] += name == "tbegen.cache.host_wait"
        return real_span(name)

    module.span = counted_span
    bad = emb._bad_cached_index if emb._errors.mode == "raise" else None
    batches = zipf_batches(T, E, B, L, args.alpha, args.warmup + args.steps + args.time_steps, args.seed)

    # (--pipelined) the batches prefetched and not yet through their backward, oldest first:
    # [ticket, or None where its prefetch was deferred; indices; offsets]
    flight = []

    def forward():
        """(--pipelined, not counted) The batch in flight's forward: its own lookup where its
        prefetch was deferred, then its hold."""
        if flight and flight[-1][0] is None:
            flight[-1][0] = cache.prepare(flight[-1][1], flight[-1][2], B, emb._cache_buffers(), bad_index_error=bad)
        if flight:
            cache.hold(flight[-1][0])

    def prepare(indices, offsets):
        """The counted lookup: in-step, a batch's (then its backward's dirty marks); with
        --pipelined, the prefetch of this batch while the previous one is held (TorchRec's order)."""
        if not args.pipelined:
            ticket = cache.prepare(indices, offsets, B, emb._cache_buffers(), bad_index_error=bad)
            cache.mark_dirty(ticket.slots)  # (as the batch's backward does)
            return ticket
        ticket = cache.prepare(indices, offsets, B, emb._cache_buffers(), bad_index_error=bad, defer=True)
        flight.append([ticket, indices, offsets])
        return ticket

    def backward():
        """(--pipelined, not counted) The backward of the batch before the one just prefetched."""
        if len(flight) > 1:
            previous = flight.pop(0)[0]
            valid = cache.valid(previous)
            cache.release(previous)
            if not valid:  # (its backward looks it up again)
                previous = cache.prepare(previous.original, previous.offsets, B, emb._cache_buffers())
            cache.mark_dirty(previous.slots)

    # rows loaded after the warm-up, by who loaded them (the prefetches' with --pipelined, warms included)
    loads = collections.Counter()

    @contextlib.contextmanager
    def loading(who):
        before = cache.stats["rows_loaded"]
        yield
        loads[who] += cache.stats["rows_loaded"] - before

    for indices, offsets in batches[:args.warmup]:
        forward()
        prepare(indices, offsets)
        backward()
    loads.clear()
    warmed = cache.stats["rows_warmed"]
    N = T * B * L
    evictions = cache.stats["evictions"]
    seen.clear()
    deferred = cache.stats["deferred"], cache.stats["deferred_early"]
    counters = []
    for indices, offsets in batches[args.warmup:args.warmup + args.steps]:
        with loading("forward"):
            forward()
        counter = OpCounter(N, cache.num_slots)
        counted.append(counter)
        with loading("prefetch"), phases(counter, sys.modules[type(cache).__module__]), counter:
            prepare(indices, offsets)
        with loading("backward"):
            backward()
        counters.append(counter)
    counted_evictions = cache.stats["evictions"] - evictions
    times = []
    for indices, offsets in batches[args.warmup + args.steps:]:
        with loading("forward"):
            forward()
        t0 = time.perf_counter()
        with loading("prefetch"):
            prepare(indices, offsets)
        times.append(time.perf_counter() - t0)
        with loading("backward"):
            backward()
    module.span = real_span
    k = len(counters)
    steps = args.steps + args.time_steps
    row = dict(cache=fraction, algorithm=algorithm, N=N, slots=cache.num_slots, pipelined=args.pipelined,
               deferred=cache.stats["deferred"], deferred_early=cache.stats["deferred_early"],
               lookups_per_step=seen["lookups"] / steps, waits_per_step=seen["waits"] / steps,
               deferred_per_step=(cache.stats["deferred"] - deferred[0]) / steps,
               deferred_early_per_step=(cache.stats["deferred_early"] - deferred[1]) / steps,
               warm=args.warm, rows_prefetch_per_step=loads["prefetch"] / steps,
               rows_forward_per_step=loads["forward"] / steps, rows_backward_per_step=loads["backward"] / steps,
               rows_warmed_per_step=(cache.stats["rows_warmed"] - warmed) / steps,
               prepare_ms=statistics.median(times) * 1e3 if times else None)
    for p in PHASES:
        row[f"ops_{p}"] = sum(sum(c.ops[p].values()) for c in counters) / k
        row[f"views_{p}"] = sum(c.views[p] for c in counters) / k
        row[f"mb_{p}"] = sum(c.bytes[p] for c in counters) / k / 1e6
        row[f"full_{p}"] = sum(c.full[p] for c in counters) / k
    merged = {p: collections.Counter() for p in PHASES}
    full_ops = {p: collections.Counter() for p in PHASES}
    for c in counters:
        for p in PHASES:
            merged[p].update(c.ops[p])
            full_ops[p].update(c.full_ops[p])
    row["ops_gap"] = sum(c.gap for c in counters) / k
    # (what the host dispatches between reading the summary and the first row move: on CUDA the
    # device waits for these before the exchange kernel, the step's largest, can start)
    row["ops_to_move"] = row["ops_gap"] + sum(c.to_move for c in counters) / k
    row["op_names"] = {p: {n: v / k for n, v in merged[p].most_common()} for p in PHASES}
    row["full_op_names"] = {p: {n: v / k for n, v in full_ops[p].most_common()} for p in PHASES}
    s = cache.report()
    row.update(evictions=s["evictions"], bypasses=s["bypasses"], backing_rows=s["backing_rows"],
               counted_evictions=counted_evictions)
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling-factor", type=int, default=20)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--cache", default="0.05,0.1,0.2", help="cache fractions, comma-separated")
    ap.add_argument("--algorithm", default="lru,lfu", help="lru, lfu or both, comma-separated")
    ap.add_argument("--warmup", type=int, default=4, help="batches before the counted ones")
    ap.add_argument("--steps", type=int, default=2, help="batches counted (averaged)")
    ap.add_argument("--time-steps", type=int, default=5, help="batches timed (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipelined", action="store_true",
                    help="count the prefetch of each batch while the previous one is held (TorchRec's order)")
    ap.add_argument("--ops", action="store_true", help="also list each phase's operators by count")
    ap.add_argument("--exchange", action="store_true",
                    help="the fill as on CUDA (its rows through _exchange_rows, here a stand-in that moves nothing): "
                         "'to move' then counts what the device waits for before the exchange kernel")
    ap.add_argument("--no-early-deferral", action="store_true",
                    help="(--pipelined) look every prefetch up, as before issue 27's prediction (RowCache._too_short): "
                         "the A/B of its lookups and host waits")
    ap.add_argument("--warm", action="store_true",
                    help="(--pipelined) make the cache with TBEGEN_CACHE_PREFETCH_WARM=1: a prefetch the held rule would "
                         "defer warms the cache with the part of its rows that fits (RowCache._warm_part); without "
                         "it the warm is off whatever --algorithm (TBEGEN_CACHE_PREFETCH_WARM=0, the deferral; the "
                         "module's default warms with LRU)")
    ap.add_argument("--json", help="write the rows here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"# {args.tables} tables x {args.rows} rows x {args.dim}, B {args.batch}, L {args.pooling_factor}, "
          f"Zipf {args.alpha}, {args.optimizer}; per {'prefetch beside a held batch' if args.pipelined else 'prepare'}, "
          f"averaged over {args.steps} evicting batches{'; TBEGEN_CACHE_PREFETCH_WARM=1' if args.warm else ''}")
    print("| cache | alg | ops before / after / fill (views) | gap | to move | MB before / after / fill "
          "| full-size before / after / fill | prepare ms (CPU, proxy) | deferred (early) "
          "| lookups / waits / deferred (early) a step | rows loaded a step: prefetch / forward / backward (warmed) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for fraction in [float(x) for x in args.cache.split(",")]:
        for algorithm in args.algorithm.split(","):
            r = measure(args, fraction, algorithm)
            rows.append(r)
            ops = " / ".join(f"{r[f'ops_{p}']:.0f}" for p in PHASES)
            views = " / ".join(f"{r[f'views_{p}']:.0f}" for p in PHASES)
            mb = " / ".join(f"{r[f'mb_{p}']:.1f}" for p in PHASES)
            full = " / ".join(f"{r[f'full_{p}']:.0f}" for p in PHASES)
            print(f"| {fraction:g} | {algorithm} | {ops} ({views}) | {r['ops_gap']:.0f} | {r['ops_to_move']:.0f} | {mb} | {full} "
                  f"| {'-' if r['prepare_ms'] is None else format(r['prepare_ms'], '.1f')} "
                  f"| {r['deferred']} ({r['deferred_early']}) | {r['lookups_per_step']:.2f} / {r['waits_per_step']:.2f} / "
                  f"{r['deferred_per_step']:.2f} ({r['deferred_early_per_step']:.2f}) "
                  f"| {r['rows_prefetch_per_step']:.0f} / {r['rows_forward_per_step']:.0f} / "
                  f"{r['rows_backward_per_step']:.0f} ({r['rows_warmed_per_step']:.0f}) |",
                  flush=True)
            if args.ops:
                for p in PHASES:
                    print(f"    {p}: " + ", ".join(f"{n} {v:g}" for n, v in r["op_names"][p].items()))
                    print(f"    {p} full-size: " + ", ".join(f"{n} {v:g}" for n, v in r["full_op_names"][p].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
