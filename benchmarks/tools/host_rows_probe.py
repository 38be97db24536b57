"""How fast the GPU moves scattered rows across the host link, by kind of host memory (issue 27).

The row cache's fill (tbegen/cache.py) gathers missed rows from the backing store in host memory
into their slots and writes evicted rows back, with the `_copy_rows` operator (one warp per few
rows, a bounded grid per direction). On the H200 the fill of C2 at 20% (812 MB a step, ~406 MB
each way) took ~17 ms: ~48 GB/s in all, where pinned 2 GiB copies reach ~55 GB/s each way and
~100 both at once (../shared/tools/fbgemm-anchor/host_link.py). One suspect is address
translation: rows of 512 bytes picked at random from a table of many GB touch a new 4 KB host page
almost every time, and the GPU's MMU walks its page tables for host memory mapped in small pages.
This probe times the same row copies, random and in order, for each kind of host memory tbegen
could back a table with:

- `managed`: cudaMallocManaged, preferred location host, accessed by the GPU (the backing store of
  placements "managed" and "managed_caching" today: tbegen's managed_empty + managed_advise);
- `managed-thp`: the same, its host range advised MADV_HUGEPAGE before the first touch (whether
  the GPU then maps it in large pages is what this measures);
- `host`: cudaHostAlloc, mapped (tbegen's host_empty: placement "host");
- `host-thp`: an anonymous mapping advised MADV_HUGEPAGE before its first touch, touched, then
  cudaHostRegister'ed, mapped (tbegen's host_empty_huge: placement "host" with
  TBEGEN_CACHE_BACKING=host-huge);
- `split-host`: page-locked host memory from CUDA's virtual memory API (cuMemCreate on the GPU's
  host NUMA node, mapped in chunks of >= 2 MB: tbegen's split_empty with no device range; the
  backing store of managed_caching tables with TBEGEN_CACHE_BACKING=host-huge).

After the table, a line per kind: what memory_kind says it is, and the share of its host mappings
that Linux backs with transparent huge pages (AnonHugePages / Size in /proc/self/smaps; "n/a"
where the driver maps the memory for itself and smaps cannot tell). If host-thp reads 100% huge
and its random rows reach the in-order figures where managed and host do not, address translation
was the limit.

For each: H2D gather (host rows -> a device buffer), D2H scatter (device buffer -> host rows),
both at once on two streams with half the SMs each (as the cache runs them by default), for the
kinds that can hold the cache's slots after the table in GPU memory (managed, managed-thp,
split-host) the exchange (`_exchange_rows` on the whole grid: each slot's row written back to one
host row and loaded from another by the same warp, as the fill with TBEGEN_CACHE_EXCHANGE=1), and
the same with the rows in order (the translation-friendly bound). Prints GB/s per case (both
directions summed for "both" and "exchange") and writes --json.

    python3 benchmarks/tools/host_rows_probe.py --gb 8 --rows 1000000 --json $OUT/host_rows.json

Needs a CUDA GPU (and builds tbegen's sgd extension for the operators, ~1 min the first time).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tbegen.module import TableBatchedEmbeddingBags  # noqa: E402
from tbegen.placement import huge_page_share  # noqa: E402

MADV_HUGEPAGE = 14
HUGE = 2 << 20


def advise_huge(ptr: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) on the 2 MB-aligned part of [ptr, ptr + nbytes); whether it took."""
    start = (ptr + HUGE - 1) // HUGE * HUGE
    end = (ptr + nbytes) // HUGE * HUGE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


# kinds whose tensor can end in GPU memory (the cache's layout: backing rows, then the slots)
WITH_SLOTS = ("managed", "managed-thp", "split-host")


def host_table(ops, kind: str, rows: int, cols: int, slots: int = 0) -> torch.Tensor:
    """A (rows, cols) float32 table in host memory of `kind`, as a CUDA tensor the kernels can read;
    with `slots` (kinds WITH_SLOTS only), that many more rows after it in GPU memory, as the
    cache's slots follow its backing rows in one buffer."""
    numel = rows * cols
    total = numel + slots * cols
    if kind == "host":
        flat = ops.host_empty(numel, torch.float32, torch.device("cuda"))
    elif kind == "host-thp":
        flat = ops.host_empty_huge(numel, torch.float32, torch.device("cuda"))
    elif kind == "split-host":
        flat = ops.split_empty(total, torch.float32, torch.device("cuda"), [numel, slots * cols] if slots else [])
    elif kind in ("managed", "managed-thp"):
        flat = ops.managed_empty(total, torch.float32, torch.device("cuda"))
        if kind == "managed-thp" and not advise_huge(flat.data_ptr(), numel * 4):
            print("managed-thp: madvise(MADV_HUGEPAGE) refused; timing it anyway", file=sys.stderr)
        ops.managed_advise(flat, 0, numel, "host")
        if slots:
            ops.managed_advise(flat, numel, slots * cols, "device")
    else:
        raise ValueError(f"unknown kind {kind!r}: managed, managed-thp, host, host-thp or split-host")
    assert slots == 0 or kind in WITH_SLOTS
    flat.fill_(1.0)  # (touches every page: host pages for managed memory preferred on the host)
    torch.cuda.synchronize()
    return flat.view(rows + slots, cols)


def timed(fn, reps: int) -> float:
    """Best of `reps` runs of fn, ms (CUDA events; fn may use several streams, joined in it)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1))
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=8.0, help="host table size, GB (rows spread over all of it)")
    ap.add_argument("--row-bytes", type=int, default=512, help="row size (C2: 128 fp32 = 512)")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows copied each way per timing")
    ap.add_argument("--kinds", default="managed,managed-thp,host,host-thp,split-host")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("host_rows_probe: needs a CUDA GPU")
    ops = TableBatchedEmbeddingBags([(4, 4)], optimizer="sgd", device="cuda")._ops
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cols = args.row_bytes // 4
    table_rows = int(args.gb * 1e9) // args.row_bytes
    n = min(args.rows, table_rows)
    gbytes = n * args.row_bytes / 1e9
    g = torch.Generator(device="cuda").manual_seed(0)
    random_rows = torch.randperm(table_rows, device="cuda", generator=g)[:n].contiguous()
    ordered_rows = torch.arange(n, device="cuda")
    dev_a = torch.zeros(n, cols, device="cuda")
    dev_b = torch.ones(n, cols, device="cuda")
    s_load, s_back = torch.cuda.Stream(), torch.cuda.Stream()
    half = max(1, sms // 2)
    results = {"gpu": torch.cuda.get_device_name(0), "rows": n, "row_bytes": args.row_bytes, "table_gb": args.gb,
               "thp_enabled": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
               if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() else "?", "cases": []}
    print(f"{results['gpu']}: {n} rows of {args.row_bytes} B ({gbytes:.2f} GB) each way, host table {args.gb} GB; "
          f"THP: {results['thp_enabled']}")
    print("| host memory | rows | H2D gather GB/s | D2H scatter GB/s | both at once GB/s (sum) | exchange GB/s (sum) |")
    print("|---|---|---|---|---|---|")
    pages = []
    for kind in args.kinds.split(","):
        try:
            table = host_table(ops, kind, table_rows, cols, n if kind in WITH_SLOTS else 0)
        except RuntimeError as e:
            print(f"| {kind} | - | could not allocate: {str(e).splitlines()[0]} |")
            continue
        share = huge_page_share(table.data_ptr(), table.numel() * table.element_size())
        results.setdefault("memory", {})[kind] = {"memory_kind": ops.memory_kind(table), "huge_page_share": share}
        pages.append(f"{kind}: memory_kind {ops.memory_kind(table)}, huge pages "
                     + ("n/a" if share is None else f"{100 * share:.0f}%"))
        for order, rows in (("random", random_rows), ("in order", ordered_rows)):
            h2d = timed(lambda: ops._copy_rows(dev_a, None, table, rows, 0), args.reps)
            d2h = timed(lambda: ops._copy_rows(table, rows, dev_b, None, 0), args.reps)
            # (the cache's way: two streams, half the SMs each; the two touch different host rows)
            if order == "random":
                other = torch.randperm(table_rows, device="cuda", generator=g)[:n].contiguous()
            else:
                other = torch.arange(n, 2 * n, device="cuda") % table_rows

            def both():
                cur = torch.cuda.current_stream()
                s_load.wait_stream(cur)
                s_back.wait_stream(cur)
                with torch.cuda.stream(s_load):
                    ops._copy_rows(dev_a, None, table, rows, half)
                with torch.cuda.stream(s_back):
                    ops._copy_rows(table, other, dev_b, None, half)
                cur.wait_stream(s_load)
                cur.wait_stream(s_back)
            t_both = timed(both, args.reps)
            case = {"kind": kind, "order": order, "h2d_GBps": gbytes / (h2d / 1e3), "d2h_GBps": gbytes / (d2h / 1e3),
                    "both_GBps": 2 * gbytes / (t_both / 1e3)}
            exchange = "-"
            if kind in WITH_SLOTS and 2 * n > table_rows:
                # (its out and in rows must be disjoint, n each, as the cache's are)
                exchange = "n/a: --rows over half the table's rows"
            elif kind in WITH_SLOTS:
                # (the fill with TBEGEN_CACHE_EXCHANGE=1: each of n slots, after the table in GPU
                # memory, written back to one host row and loaded from another, by one kernel on
                # the whole grid; out and in rows disjoint, as the cache's are)
                slot_rows = torch.arange(table_rows, table_rows + n, device="cuda")
                if order == "random":
                    pair = torch.randperm(table_rows, device="cuda", generator=g)[:2 * n]
                    in_rows, out_rows = pair[:n].contiguous(), pair[n:].contiguous()
                else:
                    in_rows, out_rows = ordered_rows, (torch.arange(n, 2 * n, device="cuda") % table_rows)
                t_x = timed(lambda: ops._exchange_rows(table, slot_rows, out_rows, in_rows, 2 * half), args.reps)
                case["exchange_GBps"] = 2 * gbytes / (t_x / 1e3)
                exchange = f"{case['exchange_GBps']:.1f}"
            results["cases"].append(case)
            print(f"| {kind} | {order} | {case['h2d_GBps']:.1f} | {case['d2h_GBps']:.1f} | {case['both_GBps']:.1f} "
                  f"| {exchange} |")
        del table
        torch.cuda.synchronize()
    print("host pages (AnonHugePages / Size of the mappings, /proc/self/smaps): " + "; ".join(pages))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
