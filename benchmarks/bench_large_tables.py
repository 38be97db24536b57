#!/usr/bin/env python3
"""Tables larger than the GPU memory the process may use: trained with placement managed_caching
under a memory cap, checked bit for bit against the same training with every table on the device.

    python3 benchmarks/bench_large_tables.py --out DIR          # 64 tables x 1M x 256 fp32 = 64 GiB, 24 GiB cap
    python3 benchmarks/bench_large_tables.py --device cpu --tables 4 --rows 20000 --dim 16 --out DIR   # a CPU check

Two processes, one after the other, on the same batches (Zipf-distributed indices, one fixed seed):
1. "device": every table in GPU memory (needs the whole size free: the H200 has 139 GiB);
2. "cached": every table `managed_caching` (host-resident rows behind a GPU cache of --cache of
   each table's rows), in a process whose CUDA allocations are capped at --cap-gb
   (torch.cuda.set_per_process_memory_fraction): the tables are larger than the cap.
After --steps training steps (rowwise_adagrad, float32, so no random rounding), each process
writes a fingerprint of every table's weights and optimizer state (per table: the int64 sum of the
float32 bit patterns, exact and independent of order, plus the float64 sum). The two must be
equal: the cached training is bitwise the device training (docs/placements.md). Writes
large_tables.json (sizes, cap, step times, hit rate, fingerprints, equal or not) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def batches(args, torch, device, count):
    """`count` batches of --tables x --batch bags of --pooling Zipf(1.1) indices (fixed seed)."""
    T, E, B, L = args.tables, args.rows, args.batch, args.pooling
    g = torch.Generator(device=device).manual_seed(1234)
    cdf = torch.cumsum(torch.arange(1, E + 1, device=device, dtype=torch.float64).pow(-1.1), 0)
    cdf /= cdf[-1].clone()
    perm = torch.stack([torch.randperm(E, device=device, generator=g) for _ in range(T)])
    offsets = torch.arange(T * B + 1, device=device, dtype=torch.int64) * L
    out = []
    for _ in range(count):
        u = torch.rand((T, B * L), device=device, dtype=torch.float64, generator=g)
        rows = torch.gather(perm, 1, torch.searchsorted(cdf, u).clamp_(max=E - 1))
        out.append((rows.reshape(-1).contiguous(), offsets))
    return out


def fingerprint(torch, tensor, chunk=1 << 26):
    """(int64 sum of the float32 bit patterns, float64 sum) of a float32 tensor, in chunks."""
    flat = tensor.reshape(-1)
    bits, total = 0, 0.0
    for lo in range(0, flat.numel(), chunk):
        part = flat[lo:lo + chunk]
        bits += int(part.view(torch.int32).to(torch.int64).sum())
        total += float(part.to(torch.float64).sum())
    return [bits, total]


def train(args) -> dict:
    """One process's half: build, train, fingerprint (args.placement: device or cached)."""
    import torch

    import tbegen

    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if args.placement == "cached" and dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 2**30 / total), dev)
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05, eps=1e-8, device=dev, weights_dtype=torch.float32)
    if args.placement == "cached":
        kw.update(placements="managed_caching", cache_load_factor=args.cache)
    t0 = time.perf_counter()
    emb = tbegen.TableBatchedEmbeddingBags([(args.rows, args.dim)] * args.tables, **kw)
    construct_s = time.perf_counter() - t0
    data = batches(args, torch, dev, args.steps)
    grad = torch.randn(args.batch, args.tables * args.dim, device=dev, generator=torch.Generator(dev).manual_seed(5))
    ms = []
    for indices, offsets in data:
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        emb(indices, offsets).backward(grad)
        if dev.type == "cuda":
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            ms.append((time.perf_counter() - t) * 1e3)
    emb.check_errors()
    stats = emb.cache_stats()
    weights = emb.split_embedding_weights()  # (flushed: the tables hold every row)
    states = emb.split_optimizer_states()
    out = dict(placement=args.placement, construct_s=construct_s,
               step_ms_median=statistics.median(ms[args.warmup:] or ms), step_ms=ms,
               weights=[fingerprint(torch, w) for w in weights],
               states=[fingerprint(torch, s["momentum"]) for s in states],
               hit_rate=stats.get("hit_rate"), unique_hit_rate=stats.get("unique_hit_rate"),
               rows_loaded=stats.get("rows_loaded"))
    if dev.type == "cuda":
        out["peak_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "large-tables-out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tables", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--pooling", type=int, default=20)
    ap.add_argument("--cache", type=float, default=0.05, help="cache slots, as a fraction of each table's rows")
    ap.add_argument("--cap-gb", type=float, default=24.0, help="the cached process's CUDA allocation cap, GiB")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    ap.add_argument("--placement", choices=["device", "cached"], help=argparse.SUPPRESS)  # (a child process)
    args = ap.parse_args(argv)
    if args.placement:
        print(json.dumps(train(args)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table_gib = args.tables * args.rows * args.dim * 4 / 2**30
    runs = {}
    for placement in ("device", "cached"):
        cmd = [sys.executable, __file__, "--placement", placement] + [a for a in (argv if argv is not None else sys.argv[1:])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
        if proc.returncode != 0:
            runs[placement] = dict(error=proc.stderr[-3000:])
        else:
            runs[placement] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(placement, json.dumps({k: v for k, v in runs[placement].items() if k not in ("weights", "states", "step_ms")}), flush=True)
    d, c = runs["device"], runs["cached"]
    equal = "error" not in d and "error" not in c and d["weights"] == c["weights"] and d["states"] == c["states"]
    result = dict(tables=args.tables, rows=args.rows, dim=args.dim, table_gib=table_gib, cap_gib=args.cap_gb,
                  cache=args.cache, batch=args.batch, pooling=args.pooling, steps=args.steps, bitwise_equal=equal,
                  device=d, cached=c)
    (out / "large_tables.json").write_text(json.dumps(result, indent=1))
    print(f"{table_gib:.1f} GiB of tables, cached under a {args.cap_gb:g} GiB cap: "
          f"{'bitwise equal to' if equal else 'NOT equal to'} the all-device training; step ms cached "
          f"{c.get('step_ms_median', float('nan')):.1f}, device {d.get('step_ms_median', float('nan')):.1f}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
