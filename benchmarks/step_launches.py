"""Launches, copies and host waits of one small training step of the module, eager and as a
replayed CUDA graph, and their times (issue 29: small, latency-bound steps).

    python3 benchmarks/step_launches.py [--optimizer rowwise_adagrad] [--batch 512] [--json out.json]

One step = forward + backward with the fused update, device-placed fp32 tables (2 tables of
10^5 x 64 by default), warmed up first. The profiler's CUDA runtime events are sorted into kernel
launches, memcpy/memset calls and synchronizing calls (cudaStreamSynchronize,
cudaDeviceSynchronize, cudaEventSynchronize, and synchronous cudaMemcpy); the step times are the
median of --iters steps of each kind (eager: the module's calls; graph: g.replay()).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tbegen.module import TableBatchedEmbeddingBags  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def batch(T, B, L, rows, seed):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
    indices = torch.randint(0, rows, (T * B * L,), generator=g)
    return indices.cuda(), offsets.cuda()


def classify(prof):
    counts = Counter()
    for e in prof.events():
        name = e.name
        if name.startswith("cudaLaunchKernel") or name.startswith("cuLaunchKernel") or name == "cudaLaunchKernelExC":
            counts["kernel launches"] += 1
        elif name.startswith("cudaMemcpyAsync"):
            counts["async copies"] += 1
        elif name.startswith("cudaMemsetAsync"):
            counts["memsets"] += 1
        elif name == "cudaMemcpy" or name.startswith(SYNC_CALLS):
            counts["host waits (" + name + ")"] += 1
        elif name.startswith("cudaEventQuery"):
            counts["event queries (non-blocking)"] += 1
        elif name.startswith("cudaEventRecord"):
            counts["event records"] += 1
        elif name.startswith("cudaStreamWaitEvent"):
            counts["stream waits (device side)"] += 1
        elif name.startswith("cudaGraphLaunch"):
            counts["graph launches"] += 1
    return dict(sorted(counts.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--pooling-factor", type=int, default=10)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_launches.py needs a CUDA device")

    T, B, L = args.tables, args.batch, args.pooling_factor
    m = TableBatchedEmbeddingBags([(args.rows, args.dim)] * T, optimizer=args.optimizer, device="cuda")
    grad = torch.randn(B, T * args.dim, device="cuda")
    idx, off = batch(T, B, L, args.rows, 0)

    def step():
        m(idx, off).backward(grad)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    eager_counts = classify(prof)

    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    graph_counts = classify(prof)

    def timed(fn):
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    eager_ms, graph_ms = timed(step), timed(g.replay)
    m.check_errors()
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "optimizer": args.optimizer,
        "shape": {"T": T, "rows": args.rows, "D": args.dim, "B": B, "L": L},
        "eager_step": eager_counts, "graph_replay": graph_counts,
        "eager_step_ms": round(eager_ms, 4), "graph_replay_ms": round(graph_ms, 4),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
