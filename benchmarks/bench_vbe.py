#!/usr/bin/env python3
"""Variable batch size per feature (VBE): tbegen's VBE training step beside tbegen's fixed-batch
step on the same lookups padded to the largest batch, and FBGEMM's padded step where fbgemm_gpu
imports (the referee bundle leaves out FBGEMM's VBE library, so FBGEMM runs the padded batch).

A step is what a user runs: the module's forward and `out.backward(grad)` (the fused update
included), timed with CUDA events over `--iters` steps after `--warmup`, each step on the next of
`--nsets` pre-drawn batches (the same batches for every system). Goal (issue 25): tbegen's VBE
step at most its padded fixed-batch step, and faster than FBGEMM's padded step.

tbegen's VBE step is timed twice: with a new plan every step (the module's kept plans dropped
before each step, as when every batch has new batch sizes: TorchRec's case; `tbegen_vbe_ms`), and
with the plans kept (the `--nsets` batches' sizes repeat; `tbegen_vbe_cached_ms`), so that the
plan's own cost is the difference. Each timing also gives the host's time per step (`*_host_ms`:
from the first step's start until the last step is issued, before waiting for the GPU; a step
whose host time is its whole time waits for the host), and the forward alone (no_grad, plans
kept) is timed for VBE and padded (`*_fwd_ms`), to tell the forward's share from the backward's.
With --rounds N the systems are timed in N alternating rounds: `*_ms` is the median round,
`*_best_ms` the best (printed last).

Cases: T features of dimension D, R ranks, per-rank batch up to B; each (feature, rank) batch is
drawn from [frac * B, B] with frac per case ("mild" 0.5, "skewed": a third of the features at
0.05-0.2 of the others'), pooling factor L per bag drawn from [1, 2L-1], uniform rows; sum
pooling without per-sample weights unless --cases names one of POOLED (a case with weights or
mean pooling: e.g. --cases mild-large-weighted,narrow-skewed-mean).

On a GPU machine (fbgemm from the referee's bundle, see ../shared/tools/fbgemm-anchor/README.md):
    python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site
    CUDA_MODULE_LOADING=LAZY PYTHONPATH=/tmp/fbg_site:$PWD python3 benchmarks/bench_vbe.py --out $OUT/vbe
On the CPU (a quick smoke run of the script itself): python3 benchmarks/bench_vbe.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tbegen import TableBatchedEmbeddingBags  # noqa: E402

CASES = {
    # name: (T, rows, D, R, B per rank, L, skew)
    "mild": (16, 1_000_000, 128, 8, 512, 20, False),
    "skewed": (16, 1_000_000, 128, 8, 512, 20, True),
    "narrow-skewed": (32, 500_000, 32, 16, 256, 10, True),
    # a production-sized rank's batch (TorchRec's table-wise sharding hands each rank every rank's
    # bags): ~8 M lookups a step, so the kernels, not the host, are the step's time
    "mild-large": (16, 1_000_000, 128, 8, 4096, 20, False),
}
SMALL = {
    "mild": (4, 1000, 16, 2, 16, 4, False),
    "skewed": (4, 1000, 16, 3, 16, 4, True),
}
# Cases timed only where --cases names them (not in the default table): a case above with
# per-sample weights or mean pooling, whose backward sorts positions and gathers each occurrence's
# bag and scale after the sort (the batches TBEGEN_VBE_FUSED_GATHER changes). FBGEMM is not timed
# for them. name: (case, weighted, pooling)
POOLED = {
    "narrow-skewed-weighted": ("narrow-skewed", True, "sum"),
    "narrow-skewed-mean": ("narrow-skewed", False, "mean"),
    "mild-large-weighted": ("mild-large", True, "sum"),
    "mild-large-mean": ("mild-large", False, "mean"),
    "mild-weighted": ("mild", True, "sum"),  # (--small's)
}
OPTIMIZERS = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}


def draw_batch(T, rows, R, B, L, skew, gen):
    """(indices, VBE offsets, batch_size_per_feature_per_rank, padded offsets, max_B)."""
    lo = torch.full((T,), 0.5)
    if skew:
        lo[: T // 3] = 0.05
    bsfr = []
    for f in range(T):
        hi_f = 0.2 if skew and f < T // 3 else 1.0
        sizes = (torch.rand(R, generator=gen) * (hi_f - lo[f]) + lo[f]) * B
        bsfr.append([max(1, int(s)) for s in sizes])
    B_f = [sum(b) for b in bsfr]
    total = sum(B_f)
    lengths = torch.randint(1, 2 * L, (total,), generator=gen)
    indices = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    offsets = torch.zeros(total + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    max_B = max(B_f)
    pad, start = [], 0
    for f in range(T):
        for b in range(max_B):
            pad.append(start + min(b, B_f[f]))
        start += B_f[f]
    pad.append(total)
    return indices, offsets, bsfr, offsets[torch.tensor(pad)], max_B


def timed(step, sets, warmup, iters, device):
    """(ms per step, the host's ms per step until the last step is issued)."""
    for i in range(warmup):
        step(sets[i % len(sets)])
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for i in range(iters):
            step(sets[(warmup + i) % len(sets)])
        host = (time.perf_counter() - t0) * 1e3 / iters
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters, host
    t0 = time.perf_counter()
    for i in range(iters):
        step(sets[(warmup + i) % len(sets)])
    ms = (time.perf_counter() - t0) * 1e3 / iters
    return ms, ms


def count_syncs(step, s):
    """How often one step makes the host wait for the GPU (synchronizing calls torch can see)."""
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_step(title, step, sets, device, n=5):
    """torch.profiler's table of n steps (after one untimed): where a step's host and GPU time go."""
    from torch.profiler import ProfilerActivity, profile
    step(sets[0])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(n):
            step(sets[i % len(sets)])
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    print(f"== profile: {title} ({n} steps)")
    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)


def fbgemm_module(T, rows, D, optimizer, device):
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    except Exception as e:  # noqa: BLE001
        return None, f"fbgemm_gpu not importable ({type(e).__name__}: {e})"
    loc, cd = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if device == "cuda"
               else (EmbeddingLocation.HOST, ComputeDevice.CPU))
    kw = dict(learning_rate=0.01)
    if optimizer != "sgd":
        kw["eps"] = 1e-8
    m = SplitTableBatchedEmbeddingBagsCodegen([(rows, D, loc, cd)] * T, optimizer=getattr(EmbOptimType, OPTIMIZERS[optimizer]),
                                              **kw)
    return m, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--cases", default=None, help="comma-separated case names")
    ap.add_argument("--optimizers", default="sgd,rowwise_adagrad")
    ap.add_argument("--nsets", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--no-fbgemm", action="store_true")
    ap.add_argument("--gathered", action="store_true",
                    help="also time the VBE step through the gathered fallback (the padded output copied into "
                         "the 1-D one: the design before bag_output_offsets), in the same rounds")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time VBE and padded in this many alternating rounds and report the medians (a shared "
                         "machine's load moves between rounds; both systems see it)")
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--profile", action="store_true", default=os.environ.get("BENCH_VBE_PROFILE") == "1",
                    help="print torch.profiler's table of the VBE (new plan, kept plan) and padded steps of the "
                         "first case and optimizer (default from BENCH_VBE_PROFILE=1)")
    args = ap.parse_args()
    cases = SMALL if args.small else CASES
    names = args.cases.split(",") if args.cases else list(cases)
    dev = args.device
    results = []
    profiled = False
    for name in names:
        base, weighted, pooling = POOLED.get(name, (name, False, "sum"))
        if base not in cases:
            sys.exit(f"bench_vbe: no case {name!r} (cases: {', '.join(list(cases) + list(POOLED))})")
        T, rows, D, R, B, L, skew = cases[base]
        gen = torch.Generator().manual_seed(1)
        sets = []
        for _ in range(args.nsets):
            ind, off, bsfr, poff, max_B = draw_batch(T, rows, R, B, L, skew, gen)
            # (the padded batch has the same indices: the same weights serve both)
            psw = (torch.rand(ind.numel(), generator=gen) + 0.5).to(dev) if weighted else None
            sets.append(dict(ind=ind.to(dev), off=off.to(dev), poff=poff.to(dev), psw=psw, bsfr=bsfr, max_B=max_B,
                             lookups=ind.numel(), bags=off.numel() - 1, padded_bags=poff.numel() - 1))
        for s in sets:
            n = sum(b * D for per_rank in s["bsfr"] for b in per_rank)
            s["grad"] = torch.randn(n, generator=gen).to(dev)
            s["pgrad"] = torch.randn(s["max_B"], T * D, generator=gen).to(dev)
        for opt in args.optimizers.split(","):
            hyper = dict(learning_rate=0.01) if opt == "sgd" else dict(learning_rate=0.01, eps=1e-8)
            emb = TableBatchedEmbeddingBags([(rows, D)] * T, optimizer=opt, device=dev, pooling=pooling, **hyper)
            # check: the VBE output is the padded output's real rows (bitwise), before timing
            s = sets[0]
            with torch.no_grad():
                a = emb(s["ind"], s["off"], s["psw"], batch_size_per_feature_per_rank=s["bsfr"])
                b = emb(s["ind"], s["poff"], s["psw"])
            # (rank-major gather of b, written out here)
            parts, start = [], [0] * T
            prefix = [[sum(s["bsfr"][f][:r]) for r in range(R)] for f in range(T)]
            for r in range(R):
                for f in range(T):
                    n = s["bsfr"][f][r]
                    parts.append(b[prefix[f][r]:prefix[f][r] + n, f * D:(f + 1) * D].reshape(-1))
            check = bool(torch.equal(a, torch.cat(parts)))
            row = dict(case=name, optimizer=opt, T=T, rows=rows, D=D, R=R, B=B, L=L, skew=skew, weighted=weighted,
                       pooling=pooling, device=dev,
                       lookups=sum(x["lookups"] for x in sets) / len(sets),
                       bags=sum(x["bags"] for x in sets) / len(sets),
                       padded_bags=sum(x["padded_bags"] for x in sets) / len(sets), vbe_equals_padded=check)

            def cached_step(s, emb=emb):
                emb(s["ind"], s["off"], s["psw"], batch_size_per_feature_per_rank=s["bsfr"]).backward(s["grad"])

            def vbe_step(s, emb=emb):
                emb.__dict__.get("_vbe_plans", {}).clear()  # (new batch sizes: a new plan)
                cached_step(s)

            def padded_step(s, emb=emb):
                emb(s["ind"], s["poff"], s["psw"]).backward(s["pgrad"])

            gathered_plans = {}

            def gathered_step(s, emb=emb):
                # (an instance attribute: the module's gathered fallback, with plans of its own,
                # since a plan records which way its batches run)
                emb._vbe_direct = lambda: False
                direct_plans = emb.__dict__.get("_vbe_plans")
                emb.__dict__["_vbe_plans"] = gathered_plans
                try:
                    cached_step(s)
                finally:
                    del emb._vbe_direct
                    emb.__dict__["_vbe_plans"] = direct_plans

            def vbe_forward(s, emb=emb):
                with torch.no_grad():
                    emb(s["ind"], s["off"], s["psw"], batch_size_per_feature_per_rank=s["bsfr"])

            def padded_forward(s, emb=emb):
                with torch.no_grad():
                    emb(s["ind"], s["poff"], s["psw"])

            steps = dict(vbe=vbe_step, vbe_cached=cached_step, padded=padded_step, vbe_fwd=vbe_forward,
                         padded_fwd=padded_forward)
            if args.gathered:
                steps["vbe_gathered"] = gathered_step
            times = {k: [] for k in steps}
            for _ in range(args.rounds):
                for k, step in steps.items():
                    times[k].append(timed(step, sets, args.warmup, args.iters, dev))
            for k, ts in times.items():
                ms = sorted(t for t, _ in ts)
                host = sorted(h for _, h in ts)
                row[f"tbegen_{k}_ms"] = ms[len(ms) // 2]
                row[f"tbegen_{k}_host_ms"] = host[len(host) // 2]
                # (the best round: a shared host's load only ever adds time)
                row[f"tbegen_{k}_best_ms"] = ms[0]
                row[f"tbegen_{k}_best_host_ms"] = host[0]
                if args.rounds > 1:
                    row[f"rounds_{k}_ms"] = [t for t, _ in ts]
            if dev == "cuda":
                # the host's waits for the GPU in one step (torch's sync debug mode, warnings counted)
                for k in ("vbe", "vbe_cached", "padded"):
                    row[f"tbegen_{k}_syncs"] = count_syncs(steps[k], sets[0])
            if args.profile and not profiled:
                profiled = True
                for k in ("vbe", "vbe_cached", "padded"):
                    profile_step(f"{name} {opt} {k}", steps[k], sets, dev)
            del emb
            if name in POOLED:
                row["fbgemm_note"] = "not timed for per-sample weights or mean pooling"
            elif not args.no_fbgemm:
                fb, why = fbgemm_module(T, rows, D, opt, dev)
                if fb is None:
                    row["fbgemm_note"] = why
                else:
                    def fbgemm_step(s, fb=fb):
                        fb(s["ind"], s["poff"]).backward(s["pgrad"])

                    row["fbgemm_padded_ms"], row["fbgemm_padded_host_ms"] = timed(fbgemm_step, sets, args.warmup,
                                                                                   args.iters, dev)
                    del fb
            if dev == "cuda":
                torch.cuda.empty_cache()
            results.append(row)
            print(json.dumps(row), flush=True)
    hdr = (f"{'case':<14} {'optimizer':<16} {'bags':>8} {'padded':>8} {'VBE ms':>8} {'cached':>8} {'padded ms':>10} "
           f"{'FBGEMM pad ms':>14} {'VBE/pad':>8} {'VBE/FBGEMM':>11} check")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        fbm = r.get("fbgemm_padded_ms")
        print(f"{r['case']:<14} {r['optimizer']:<16} {r['bags']:>8.0f} {r['padded_bags']:>8.0f} {r['tbegen_vbe_ms']:>8.3f} "
              f"{r['tbegen_vbe_cached_ms']:>8.3f} {r['tbegen_padded_ms']:>10.3f} {fbm if fbm is not None else float('nan'):>14.3f} "
              f"{r['tbegen_vbe_ms'] / r['tbegen_padded_ms']:>8.3f} "
              f"{(r['tbegen_vbe_ms'] / fbm) if fbm else float('nan'):>11.3f} {'ok' if r['vbe_equals_padded'] else 'MISMATCH'}"
              + (f"  gathered {r['tbegen_vbe_gathered_ms']:.3f} ms ({r['tbegen_vbe_gathered_ms'] / r['tbegen_padded_ms']:.3f}x pad)"
                 if "tbegen_vbe_gathered_ms" in r else ""))
    print("host ms per step (until issued) | forward alone ms (no_grad):")
    for r in results:
        fbh = r.get("fbgemm_padded_host_ms")
        print(f"{r['case']:<14} {r['optimizer']:<16} host: VBE {r['tbegen_vbe_host_ms']:.3f} cached "
              f"{r['tbegen_vbe_cached_host_ms']:.3f} padded {r['tbegen_padded_host_ms']:.3f} FBGEMM "
              f"{fbh if fbh is not None else float('nan'):.3f} | forward: VBE {r['tbegen_vbe_fwd_ms']:.3f} "
              f"(host {r['tbegen_vbe_fwd_host_ms']:.3f}) padded {r['tbegen_padded_fwd_ms']:.3f} "
              f"(host {r['tbegen_padded_fwd_host_ms']:.3f})")
    if args.rounds > 1:
        print(f"best of {args.rounds} rounds, ms per step (host ms until issued):")
        for r in results:
            fbm = r.get("fbgemm_padded_ms")
            print(f"{r['case']:<14} {r['optimizer']:<16} " + "  ".join(
                f"{k} {r[f'tbegen_{k}_best_ms']:.3f} ({r[f'tbegen_{k}_best_host_ms']:.3f})"
                for k in ("vbe", "vbe_cached", "padded", "vbe_fwd", "padded_fwd"))
                + f"  VBE/pad {r['tbegen_vbe_best_ms'] / r['tbegen_padded_best_ms']:.3f} cached/pad "
                  f"{r['tbegen_vbe_cached_best_ms'] / r['tbegen_padded_best_ms']:.3f}"
                + (f" VBE/FBGEMM {r['tbegen_vbe_best_ms'] / fbm:.3f}" if fbm else ""))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                    warmup=args.warmup, iters=args.iters, nsets=args.nsets)
        (out / "results.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        print(f"wrote {out / 'results.json'}")
    if not all(r["vbe_equals_padded"] for r in results):
        sys.exit("bench_vbe: the VBE output differs from the padded batch's rows")


if __name__ == "__main__":
    main()
