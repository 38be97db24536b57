#!/usr/bin/env python3
"""Host time per call, tbegen beside FBGEMM_GPU, on the sweep's latency-bound cells.

When a step's kernels take less time than the host needs to launch them, the GPU waits for the
host, and the step's time is the host's. This measures, for the shapes named by --only (a regex
over the sweep's 'shape optimizer' names, benchmarks/sweep_gpu.py), each system's host time per
forward call and per `out.backward(grad)` call (wall time of the call itself, no synchronisation
inside the timed region; the GPU is synchronised between steps so that the launch queue never
fills), then the CPU-side operators of tbegen's backward (torch.profiler, self CPU time, top 25) and, for the first two
cells, each system's GPU kernels per step (torch.profiler: whether the kernels fill the step).

    PYTHONPATH=/tmp/fbg_site:$PWD python3 benchmarks/host_overhead.py --only '^T=1 |^L=1 ' --out $OUT/host
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_gpu  # noqa: E402


def host_times(emb, sets, grad, iters, torch):
    fwd_us, bwd_us = [], []
    for i in range(iters):
        b = sets[i % len(sets)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = emb(b["indices"], b["offsets"], per_sample_weights=b["psw"])
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        fwd_us.append((t1 - t0) * 1e6)
        bwd_us.append((t2 - t1) * 1e6)
        del out
    torch.cuda.synchronize()
    return dict(fwd_host_us=statistics.median(fwd_us), bwd_host_us=statistics.median(bwd_us))


def gpu_kernels(ref, emb, sets, grad):
    def fwd(i):
        b = sets[i]
        return emb(b["indices"], b["offsets"], per_sample_weights=b["psw"])

    return ref.profile_kernels(fwd, lambda out: out.backward(grad), len(sets), n=5)


# The host calls counted per step (forward + backward) under the CPU-ops profile: launches,
# allocations, memsets and copies, event traffic, capture and occupancy queries (issue 29).
COUNTED = ("cudaLaunchKernel", "aten::empty", "aten::zeros", "cudaMemsetAsync", "cudaMemcpyAsync",
           "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaEventRecord", "cudaStreamWaitEvent",
           "cudaEventQuery", "cudaStreamIsCapturing", "cudaOccupancyMaxActiveBlocksPerMultiprocessor")


def cpu_ops(emb, sets, grad, torch, n=20):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            b = sets[i % len(sets)]
            out = emb(b["indices"], b["offsets"], per_sample_weights=b["psw"])
            out.backward(grad)
            torch.cuda.synchronize()
    averages = prof.key_averages()
    counts = {e.key: e.count for e in averages}
    per_step = ", ".join(f"{counts.get(name, 0) / n:g} {name}" for name in COUNTED)
    return f"per step: {per_step}\n\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=r"^T=1 |^T=4 |^L=1 |^B=512 |^B=2048 ")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="host-out")
    args = ap.parse_args(argv)
    import torch

    ref = sweep_gpu.referee()
    ref.DEV = torch.device("cuda")
    ref.load_fbgemm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, profiles = [], []
    for s, opt in sweep_gpu.cells():
        if not re.search(args.only, f"{s['name']} {opt}"):
            continue
        sets = ref.gen_sets(sweep_gpu.cfg_for_referee(s), 3, seed=sum(map(ord, s["name"])))
        grad = torch.randn((s["B"], sum(s["Ds"])), device="cuda")
        row = dict(shape=s["name"], opt=opt, describe=sweep_gpu.describe(s))
        for system, make in (("fbgemm", lambda: sweep_gpu.fbgemm_module(ref, s, opt, torch)),
                             ("tbegen", lambda: sweep_gpu.tbegen_module(s, opt, torch))):
            emb = make()
            host_times(emb, sets, grad, 5, torch)  # warm-up
            row[system] = host_times(emb, sets, grad, args.iters, torch)
            if len(profiles) < 4:
                # the GPU's side: each kernel's time per step (is the step's time the kernels', or
                # the host's?), and for tbegen the CPU-side operators
                kernels = gpu_kernels(ref, emb, sets, grad)
                row[system]["kernel_us"] = sum(k["us_per_iter"] for k in kernels)
                text = "\n".join(f"{k['us_per_iter']:9.1f} us {k['calls_per_iter']:5.1f}x {k['name'][:110]}"
                                  for k in kernels[:15])
                profiles.append(f"## {s['name']} {opt}: {system}'s GPU kernels per step "
                                f"(total {row[system]['kernel_us']:.0f} us)\n\n{text}\n")
                if system == "tbegen":
                    profiles.append(f"## {s['name']} {opt}: tbegen's CPU-side operators\n\n{cpu_ops(emb, sets, grad, torch)}\n")
            del emb
            torch.cuda.empty_cache()
        results.append(row)
        print(json.dumps(row), flush=True)
    (out / "host_overhead.json").write_text(json.dumps(results, indent=1))
    lines = ["| shape | optimizer | fwd host us fbgemm / tbegen | bwd host us fbgemm / tbegen |", "|---|---|---|---|"]
    for r in results:
        f, t = r["fbgemm"], r["tbegen"]
        lines.append(f"| {r['shape']} | {r['opt']} | {f['fwd_host_us']:.0f} / {t['fwd_host_us']:.0f} "
                     f"| {f['bwd_host_us']:.0f} / {t['bwd_host_us']:.0f} |")
    text = "\n".join(lines) + "\n\n" + "\n".join(profiles)
    (out / "host_overhead.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
