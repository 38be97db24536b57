"""How many of the backward's output-gradient row reads can hit in L2: a model, for choosing the
long runs' segment length (TBEGEN_SEGMENT_LENGTH; issue 29, wide rows). CPU only, no GPU.

The update kernels walk the batch sorted by (table, row). Each occurrence reads its bag's
output-gradient row (D floats); a bag's row is read once per index in the bag (L times), by
whichever warps sum the rows that bag holds. The sorted order keeps one table's occurrences
together, so a table's gradient rows (B x D x 4 bytes: 32 MB at B = 8192, D = 1024) are read
again and again while the warps are within that table, and L2 (50 MB on the H100 and H200) can
serve the repeats, if the band of occurrences being summed at once is narrow. That band is the
resident warps times what each warp sums before taking the next piece of work: a long run's
segment (256 occurrences by default) or a short run.

The model: the batch drawn as the sweep draws it (Zipf ranks over a random permutation of each
table's rows, or uniform), sorted; runs of at least `--threshold` occurrences cut into segments,
the others single work items; `--warps` warps take items in order, each reading one occurrence's
gradient row per tick (round robin over the warps); a fully associative LRU of `--l2-mb` holds
rows of D x `--grad-bytes` bytes; each item's end also passes one row through L2 (the weights
read and written, or a partial sum). The segment kernel and the short runs' kernel are modelled
one after the other (on the GPU they share the machine; the short runs' band is narrow either
way). Printed: hit rate and the gradient bytes read from DRAM per kernel, per segment length.

    python3 benchmarks/tools/l2_model.py --D 1024 --E 16384 --B 8192 --lengths 256,128,64,32
    python3 benchmarks/tools/l2_model.py --D 2048 --E 8192 --B 8192 --lengths 256,64,32   # fp16 rows, fp32 gradients

A model, not a measurement, and an optimistic one: real L2 is set-associative, hashed, split in
two partitions (which may each keep a copy of a line that SMs on both sides read), and shared with
the weights, states and partial sums at their own rates. Calibration: for C2 (T=32 E=1M D=128
B=16384, Zipf 1.1; --warps 3168 --concurrent) it gives the segment kernel a hit rate of 0.885 at
50 MB, where ncu measured 0.36-0.39 (benchmarks/NOTES-gpu.md, runs Y and Z); at 12 MB and two row
lines per item it gives 0.53. So read its hit rates as an upper bound and its differences between
segment lengths as a direction; ncu's L2 hit rate of the segment kernel (benchmarks/run_gpu_ab.sh
NCU_ONLY) is the check.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import numpy as np


def draw_sorted_batch(T, E, B, L, alpha, seed):
    """Keys (table * E + row) sorted, and each occurrence's bag (table * B + b), in sorted order."""
    rng = np.random.default_rng(seed)
    idx = np.empty((T, B * L), np.int64)
    if alpha > 0:
        p = np.arange(1, E + 1, dtype=np.float64) ** -alpha
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
    for t in range(T):
        if alpha > 0:
            idx[t] = rng.permutation(E)[np.minimum(np.searchsorted(cdf, rng.random(B * L)), E - 1)]
        else:
            idx[t] = rng.integers(0, E, B * L)
    key = (idx + np.arange(T)[:, None] * E).reshape(-1)
    bag = (np.arange(T)[:, None] * B + np.arange(B * L)[None, :] // L).reshape(-1)
    order = np.argsort(key, kind="stable")
    return key[order], bag[order]


def work_items(key, threshold, length):
    """(short runs, segments of long runs): each a list of (begin, end) sorted positions."""
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ends = np.r_[starts[1:], len(key)]
    short, segments = [], []
    for s, e in zip(starts.tolist(), ends.tolist()):
        if e - s < threshold:
            short.append((s, e))
        else:
            segments.extend((b, min(b + length, e)) for b in range(s, e, length))
    return short, segments


def simulate(kernels, bag, capacity_rows, row_lines=1):
    """Hits and misses of the gradient-row reads, per kernel, of kernels running at once and
    sharing L2: `kernels` is a list of (items, warps); each kernel's warps take its items in order,
    every warp reading one occurrence's row per tick. Each item also passes `row_lines` rows through
    L2 when it ends (its weights and element states; 0 models them as evict-first: they take no
    room from the gradient rows)."""
    cache = OrderedDict()
    stats = [[0, 0] for _ in kernels]
    nxt = [0] * len(kernels)
    active = [[] for _ in kernels]
    for k, (items, warps) in enumerate(kernels):
        while nxt[k] < len(items) and len(active[k]) < warps:
            active[k].append(list(items[nxt[k]]))
            nxt[k] += 1
    passing = -1  # rows that only pass through L2 (weights, partial sums): keys no bag has
    while any(active):
        for k, (items, _) in enumerate(kernels):
            still = []
            for item in active[k]:
                b = int(bag[item[0]])
                if b in cache:
                    cache.move_to_end(b)
                    stats[k][0] += 1
                else:
                    cache[b] = None
                    stats[k][1] += 1
                    if len(cache) > capacity_rows:
                        cache.popitem(last=False)
                item[0] += 1
                if item[0] < item[1]:
                    still.append(item)
                    continue
                for _ in range(row_lines):
                    cache[passing] = None
                    passing -= 1
                    if len(cache) > capacity_rows:
                        cache.popitem(last=False)
                if nxt[k] < len(items):
                    still.append(list(items[nxt[k]]))
                    nxt[k] += 1
            active[k] = still
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--E", type=int, default=16384)
    ap.add_argument("--D", type=int, default=1024)
    ap.add_argument("--B", type=int, default=8192)
    ap.add_argument("--L", type=int, default=20)
    ap.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent; 0 for uniform indices")
    ap.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element (fp32: 4)")
    ap.add_argument("--l2-mb", type=float, default=50.0)
    ap.add_argument("--warps", type=int, default=2112,
                    help="resident warps of the segment kernel (132 SMs x 2 blocks x 8 warps: the any-width "
                         "prefetch kernels; the 4-wide kernels run 3 blocks: 3168)")
    ap.add_argument("--threshold", type=int, default=32, help="max_segment_length_per_warp")
    ap.add_argument("--row-lines", type=int, default=1,
                    help="row-sized lines each work item passes through L2 (weights; + 1 per element state: "
                         "adagrad 2, adam 3); 0: rows read and written evict-first")
    ap.add_argument("--lengths", default="256,128,64,32", help="segment lengths to model")
    ap.add_argument("--concurrent", action="store_true",
                    help="the short runs' kernel beside the segment kernel (as on the GPU: two streams), "
                         "each with half the warps, sharing L2; default one after the other, each with all")
    ap.add_argument("--unified", action="store_true",
                    help="also model one kernel taking short runs and segments in one list, in key order, "
                         "with all the warps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    key, bag = draw_sorted_batch(args.T, args.E, args.B, args.L, args.alpha, args.seed)
    row_bytes = args.D * args.grad_bytes
    capacity = int(args.l2_mb * 2**20 / row_bytes)
    print(f"T={args.T} E={args.E} D={args.D} B={args.B} L={args.L} alpha={args.alpha}: {len(key)} occurrences, "
          f"gradient rows {row_bytes} B, one table's {args.B * row_bytes / 2**20:.0f} MB; L2 {args.l2_mb} MB "
          f"({capacity} rows), {args.warps} warps, {args.row_lines} row line(s) per item")
    short, _ = work_items(key, args.threshold, 256)
    if not args.concurrent:
        (h, m), = simulate([(short, args.warps)], bag, capacity, args.row_lines)
        print(f"short runs ({len(short)} items, {h + m} occurrences): hit rate {h / max(h + m, 1):.3f}, "
              f"{m * row_bytes / 1e9:.2f} GB from DRAM")
    print("| segment length | segments | occurrences in flight | hit rate | gradient GB from DRAM | partial sums GB (written + read) |"
          + (" short runs' hit rate (beside) |" if args.concurrent else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.concurrent else ""))
    for length in (int(x) for x in args.lengths.split(",")):
        _, segments = work_items(key, args.threshold, length)
        if args.concurrent:
            (h, m), (hs, ms) = simulate([(segments, args.warps // 2), (short, args.warps // 2)], bag, capacity,
                                        args.row_lines)
        else:
            (h, m), = simulate([(segments, args.warps)], bag, capacity, args.row_lines)
        # runs of several segments write one partial sum per segment and read it back
        starts = {}
        for s, e in segments:
            starts.setdefault(int(key[s]), []).append(e - s)
        partials = sum(len(v) for v in starts.values() if len(v) > 1)
        n = sum(e - s for s, e in segments)
        print(f"| {length} | {len(segments)} | {min(args.warps * length, n)} | {h / max(h + m, 1):.3f} | "
              f"{m * row_bytes / 1e9:.2f} | {2 * partials * args.D * 4 / 1e9:.2f} |"
              + (f" {hs / max(hs + ms, 1):.3f} |" if args.concurrent else ""))
    if args.unified:
        print("one kernel, short runs and segments in key order:")
        for length in (int(x) for x in args.lengths.split(",")):
            _, segments = work_items(key, args.threshold, length)
            merged = sorted(short + segments)
            (h, m), = simulate([(merged, args.warps)], bag, capacity, args.row_lines)
            print(f"  segment length {length}: hit rate {h / max(h + m, 1):.3f}, {m * row_bytes / 1e9:.2f} GB of "
                  f"gradient rows from DRAM (all occurrences)")


if __name__ == "__main__":
    main()
