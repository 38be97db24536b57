#!/usr/bin/env python3
"""The module's host time per call, measured on the CPU with the tiniest shape.

With one table of 8 rows x 4 columns, a batch of 1 and one index, the CPU kernels take about a
microsecond, so a forward call's time and an `out.backward(grad)` call's time are the host work
around them: argument checks, the autograd function, the error record, the operator's dispatch.
Most of that is the same Python on a GPU machine (benchmarks/host_overhead.py measures it there
beside FBGEMM_GPU). Each figure is the median over --rounds rounds of --calls calls each (wall
time per call, time.perf_counter); --profile adds cProfile's top functions of the backward.

    TBEGEN_BUILD_DIR=build/ext python3 benchmarks/host_overhead_cpu.py --optimizers sgd,rowwise_adagrad
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time


def per_call_us(emb, indices, offsets, grad, calls: int, rounds: int, torch):
    """Median over rounds of (forward us per call, backward us per call, forward under no_grad)."""
    fwd, bwd, inf = [], [], []
    for _ in range(rounds):
        outs = []
        t0 = time.perf_counter()
        for _ in range(calls):
            outs.append(emb(indices, offsets))
        t1 = time.perf_counter()
        for out in outs:
            out.backward(grad)
        t2 = time.perf_counter()
        with torch.no_grad():
            for _ in range(calls):
                emb(indices, offsets)
        t3 = time.perf_counter()
        fwd.append((t1 - t0) / calls * 1e6)
        bwd.append((t2 - t1) / calls * 1e6)
        inf.append((t3 - t2) / calls * 1e6)
    return statistics.median(fwd), statistics.median(bwd), statistics.median(inf)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default="sgd,rowwise_adagrad,adam")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="cProfile the backward calls of the first optimizer")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    import tbegen

    torch.set_num_threads(1)
    indices = torch.tensor([3], dtype=torch.int64)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    grad = torch.ones(1, 4)
    rows = []
    for k, name in enumerate(args.optimizers.split(",")):
        emb = tbegen.TableBatchedEmbeddingBags([(8, 4)], optimizer=name, device="cpu", seed=0)
        per_call_us(emb, indices, offsets, grad, 200, 1, torch)  # warm-up (and the build)
        fwd, bwd, inf = per_call_us(emb, indices, offsets, grad, args.calls, args.rounds, torch)
        rows.append(dict(optimizer=name, forward_us=round(fwd, 2), backward_us=round(bwd, 2),
                         forward_no_grad_us=round(inf, 2)))
        if not args.json:
            print(f"{name:24s} forward {fwd:7.2f} us  backward {bwd:7.2f} us  forward (no_grad) {inf:7.2f} us",
                  flush=True)
        if args.profile and k == 0:
            outs = [emb(indices, offsets) for _ in range(args.calls)]
            prof = cProfile.Profile()
            prof.enable()
            for out in outs:
                out.backward(grad)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
    if args.json:
        print(json.dumps(dict(torch=torch.__version__, calls=args.calls, rounds=args.rounds, rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
