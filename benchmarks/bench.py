#!/usr/bin/env python3
"""tbegen forward / fused backward timings on the standard configurations (brief §8).

    python benchmarks/bench.py --out DIR [--configs C1,C2,C3] [--opts sgd,rowwise_adagrad,...]
                               [--placements device,managed]

C1: T=32, E=1e6, D=128, B=16384, L=20, uniform, fp32, sum.   C2: C1 with Zipf(1.1) indices
(rank k drawn with probability ~ (k+1)^-1.1, mapped through a fixed random permutation per table).
C3: T=16, D cycling 32/64/128/256, fp16 weights, per-sample weights, uniform.
C4 (not run by default): C1 with D = 127, the any-width kernels; `--configs C1,C4` measures them
beside the 4-wide kernels on the same batch shape. C5 (not run by default): C1 with D = 32, narrow
tables only (the backward's lane-group kernel; TBEGEN_LANE_GROUPS=0 times the whole-warp kernel).

Medians of CUDA-event timings over `--iters` iterations after `--warmup`, rotating over `--nsets`
input sets so that the L2 cache does not hold the batch. Ideal bytes = grad_output and the pooled
output once + indices/offsets (and per-sample weights) once + each unique row's weights and
states read and written once; effective bandwidth = ideal bytes / time, compared with a measured
device-to-device copy. Writes results.jsonl and prints a table.

--placements: each configuration is timed once per placement, every table placed alike: "device"
(GPU memory) or "managed" (weights and states in CUDA managed memory preferred on the host and
read by the GPU in place; docs/placements.md). For managed placement the "% of copy BW" column
still compares with the device-to-device copy, so it shows how far the interconnect falls short.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tbegen import build  # noqa: E402
from tbegen import placement as placement_  # noqa: E402
from tbegen.layout import make_layout  # noqa: E402
from tbegen.spec import find_spec, load_spec  # noqa: E402

CONFIGS = {
    "C1": dict(T=32, Ds=[128] * 32, B=16384, L=20, dist="uniform", dtype=torch.float32, weighted=False),
    "C2": dict(T=32, Ds=[128] * 32, B=16384, L=20, dist="zipf", dtype=torch.float32, weighted=False),
    "C3": dict(T=16, Ds=[32, 64, 128, 256] * 4, B=16384, L=20, dist="uniform", dtype=torch.float16, weighted=True),
    "C4": dict(T=32, Ds=[127] * 32, B=16384, L=20, dist="uniform", dtype=torch.float32, weighted=False),
    "C5": dict(T=32, Ds=[32] * 32, B=16384, L=20, dist="uniform", dtype=torch.float32, weighted=False),
}
HYPER = {
    "sgd": dict(learning_rate=0.01),
    "rowwise_adagrad": dict(learning_rate=0.01, eps=1e-8),
    "adagrad": dict(learning_rate=0.01, eps=1e-8),
    "adam": dict(learning_rate=0.01, eps=1e-8),
}


def copy_bandwidth() -> float:
    n = 1 << 30  # 4 GiB of fp32
    a = torch.empty(n, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    del a, b
    return 2 * n * 4 / (statistics.median(ts) * 1e-3) / 1e12


def make_sets(cfg, E, nsets, seed):
    T, B, L = cfg["T"], cfg["B"], cfg["L"]
    n = B * L
    g = torch.Generator(device="cuda").manual_seed(seed)
    if cfg["dist"] == "zipf":
        p = torch.arange(1, E + 1, device="cuda", dtype=torch.float64).pow(-1.1)
        cdf = torch.cumsum(p, 0)
        cdf /= cdf[-1].clone()
        perms = torch.stack([torch.randperm(E, device="cuda", generator=g) for _ in range(T)])
    sets = []
    for _ in range(nsets):
        if cfg["dist"] == "uniform":
            idx = torch.randint(0, E, (T, n), device="cuda", generator=g)
        else:
            u = torch.rand((T, n), device="cuda", dtype=torch.float64, generator=g)
            idx = torch.gather(perms, 1, torch.searchsorted(cdf, u).clamp_(max=E - 1))
        key = (idx + torch.arange(T, device="cuda")[:, None] * E).reshape(-1)
        uniq = torch.unique(key)
        unique_per_table = torch.bincount(uniq // E, minlength=T).tolist()
        psw = torch.rand(T * n, device="cuda", generator=g) if cfg["weighted"] else None
        sets.append(dict(indices=idx.reshape(-1).contiguous(),
                         offsets=torch.arange(T * B + 1, device="cuda", dtype=torch.int64) * L,
                         psw=psw, unique=unique_per_table))
    return sets


def ideal_bytes(cfg, spec, unique, w_bytes):
    T, B, L, Ds = cfg["T"], cfg["B"], cfg["L"], cfg["Ds"]
    N = T * B * L
    total = B * sum(Ds) * 4 + N * 8 + (T * B + 1) * 8 + (N * 4 if cfg["weighted"] else 0)
    for t, D in enumerate(Ds):
        per_row = 2 * D * w_bytes
        for s in spec.states:
            per_row += 2 * 4 * (D if s.per == "element" else 1)
        total += unique[t] * per_row
    return total


def bench_one(name, cfg_name, cfg, E, args, bw_tbs, placement="device"):
    spec = load_spec(str(find_spec(name)))
    ops = build.load_ops(spec, with_cuda=True)
    layout = make_layout([(E, D) for D in cfg["Ds"]])
    feats = layout.features_tensor("cuda")
    placements = [placement] * len(cfg["Ds"])
    dev = torch.device("cuda", torch.cuda.current_device())
    element_ranges = [(off, E * D) for off, D in zip(layout.table_offsets, cfg["Ds"])]
    row_ranges = [(kb, E) for kb in layout.table_key_base]

    def alloc(numel, dtype, ranges):
        # the module's allocation (tbegen/placement.py): ordinary device memory, or managed
        return placement_.allocate(ops, numel, dtype, dev, placements, ranges)

    weights = alloc(layout.weights_numel, cfg["dtype"], element_ranges).uniform_(-0.01, 0.01)
    states = [alloc(layout.weights_numel if s.per == "element" else layout.total_hash_size, torch.float32,
                    element_ranges if s.per == "element" else row_ranges).fill_(s.init) for s in spec.states]
    hyper = dict(HYPER.get(name, {}))
    hvals = [hyper.get(h.name, h.default) for h in spec.hyperparameters]
    sets = make_sets(cfg, E, args.nsets, seed=1)
    grad = torch.randn(cfg["B"], layout.total_D, device="cuda")
    step = [0]
    # fp16/bf16 weights are rounded stochastically, as the module (and FBGEMM) do by default
    stochastic_rounding = cfg["dtype"] != torch.float32 and not args.no_stochastic_rounding

    def fwd(i):
        s = sets[i % len(sets)]
        return ops.forward(weights, feats, layout.total_D, layout.max_D, s["indices"], s["offsets"], s["psw"], 0)

    def bwd(i):
        s = sets[i % len(sets)]
        step[0] += 1
        ops.backward(grad, weights, feats, layout.total_D, layout.max_D, layout.total_hash_size, s["indices"],
                     s["offsets"], s["psw"], 0, 32, stochastic_rounding, 0, *states, *hvals, step[0])

    for i in range(args.warmup):
        fwd(i)
        bwd(i)
    torch.cuda.synchronize()
    f_ms, b_ms = [], []
    for i in range(args.iters):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        fwd(i)
        e[1].record()
        bwd(i)
        e[2].record()
        torch.cuda.synchronize()
        f_ms.append(e[0].elapsed_time(e[1]))
        b_ms.append(e[1].elapsed_time(e[2]))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                fwd(i)
                bwd(i)
            torch.cuda.synchronize()
        rows = sorted(((e.device_time_total / 3, e.key) for e in prof.key_averages() if e.device_time_total > 0),
                      reverse=True)
        print(f"  kernels of {cfg_name} {name}, us per iteration:")
        for us, key in rows[:10]:
            print(f"  {us:9.1f}  {key[:110]}")
    unique = [statistics.mean(s["unique"][t] for s in sets) for t in range(cfg["T"])]
    ib = ideal_bytes(cfg, spec, unique, weights.element_size())
    bwd_ms = statistics.median(b_ms)
    row = dict(config=cfg_name, optimizer=name, placement=placement, stochastic_rounding=stochastic_rounding,
               fwd_ms=statistics.median(f_ms), bwd_ms=bwd_ms,
               bwd_p10=sorted(b_ms)[len(b_ms) // 10], bwd_p90=sorted(b_ms)[(9 * len(b_ms)) // 10],
               ideal_gb=ib / 1e9, eff_tbs=ib / (bwd_ms * 1e-3) / 1e12, copy_tbs=bw_tbs,
               limit_ms=ib / (bw_tbs * 1e12) * 1e3)
    row["pct_of_copy"] = 100 * row["eff_tbs"] / bw_tbs
    del weights, states, sets
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default="C1,C2,C3")
    ap.add_argument("--opts", default="sgd,rowwise_adagrad,adagrad,adam")
    ap.add_argument("--E", type=int, default=1_000_000)
    ap.add_argument("--nsets", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of each run")
    ap.add_argument("--no-stochastic-rounding", action="store_true",
                    help="round fp16/bf16 weights to nearest (default: stochastically, as the module does)")
    ap.add_argument("--placements", default="device", help="comma list of device, managed (every table alike)")
    args = ap.parse_args()
    placements = args.placements.split(",")
    for p in placements:
        if p not in placement_.PLACEMENTS:
            raise SystemExit(f"--placements: {p!r} is not one of {list(placement_.PLACEMENTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.2f} TB/s  ({torch.cuda.get_device_name()}, torch {torch.__version__})", flush=True)
    rows = []
    with open(out / "tbegen_results.jsonl", "w") as f:
        for c in args.configs.split(","):
            for o in args.opts.split(","):
                for p in placements:
                    row = bench_one(o, c, CONFIGS[c], args.E, args, bw, p)
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(f"{c} {o:16s} {p:8s} fwd {row['fwd_ms']:7.3f} ms  bwd {row['bwd_ms']:7.3f} ms "
                          f"(p10 {row['bwd_p10']:.3f}, p90 {row['bwd_p90']:.3f})  limit {row['limit_ms']:.3f} ms  "
                          f"{row['pct_of_copy']:5.1f}% of copy BW", flush=True)


if __name__ == "__main__":
    main()
