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


def vbe_batch(F: int, R: int, torch, unequal: bool = False):
    """A tiny VBE batch of F features x R ranks: (indices, VBE offsets, sizes, padded offsets,
    output gradient, padded output gradient); every bag has one index, sizes 0-2 (not all 0).
    Every feature gets the same sizes (so the same total: the module runs such a batch unpadded,
    no gather of the offsets), or with `unequal` sizes that differ by feature (padding needed)."""
    sizes = [[((f if unequal else 0) + 2 * r + 1) % 3 for r in range(R)] for f in range(F)]
    sizes[0][0] = max(sizes[0][0], 1)
    totals = [sum(row) for row in sizes]
    n, max_B = sum(totals), max(totals)
    indices = torch.arange(n, dtype=torch.int64) % 8
    offsets = torch.arange(n + 1, dtype=torch.int64)
    pad, start = [], 0
    for f in range(F):
        pad += [start + min(b, totals[f]) for b in range(max_B)]
        start += totals[f]
    padded = offsets[torch.tensor(pad + [n])]
    return indices, offsets, sizes, padded, torch.ones(n * 4), torch.ones(max_B, F * 4)


def vbe_per_call_us(emb, F: int, R: int, calls: int, rounds: int, torch, clock=time.perf_counter,
                    unequal: bool = False):
    """Best over rounds of the VBE and padded calls' us per call (see the module docstring)."""
    indices, offsets, sizes, padded, grad, pgrad = vbe_batch(F, R, torch, unequal)
    plans = lambda: emb.__dict__.get("_vbe_plans", {})  # noqa: E731

    def vbe_fwd():
        with torch.no_grad():
            for _ in range(calls):
                emb(indices, offsets, batch_size_per_feature_per_rank=sizes)

    def pad_fwd():
        with torch.no_grad():
            for _ in range(calls):
                emb(indices, padded)

    def vbe_step():
        for _ in range(calls):
            emb(indices, offsets, batch_size_per_feature_per_rank=sizes).backward(grad)

    def vbe_step_new_plan():
        for _ in range(calls):
            plans().clear()
            emb(indices, offsets, batch_size_per_feature_per_rank=sizes).backward(grad)

    def pad_step():
        for _ in range(calls):
            emb(indices, padded).backward(pgrad)

    # As a training loop runs them: each step's offsets a new tensor (a data loader's), for both
    # (the VBE step already makes one, its padded offsets; on this machine the first tensor a
    # step allocates beyond the module's own costs ~8 us, further ones ~0.5 us, so the steps with
    # kept inputs above charge that to VBE alone; NOTES-cpu.md, "VBE host time")
    def vbe_step_fresh():
        for _ in range(calls):
            emb(indices, offsets.clone(), batch_size_per_feature_per_rank=sizes).backward(grad)

    def pad_step_fresh():
        for _ in range(calls):
            emb(indices, padded.clone()).backward(pgrad)

    cases = dict(vbe_forward_no_grad=vbe_fwd, padded_forward_no_grad=pad_fwd, vbe_step_plan_kept=vbe_step,
                 vbe_step_new_plan=vbe_step_new_plan, padded_step=pad_step,
                 vbe_step_fresh_offsets=vbe_step_fresh, padded_step_fresh_offsets=pad_step_fresh)
    with torch.no_grad():  # (the check: the VBE output is the padded output's real rows)
        a = emb(indices, offsets, batch_size_per_feature_per_rank=sizes)
        b = emb(indices, padded)
    prefix = [[sum(sizes[f][:r]) for r in range(R)] for f in range(F)]
    want = torch.cat([b[prefix[f][r]:prefix[f][r] + sizes[f][r], f * 4:(f + 1) * 4].reshape(-1)
                      for r in range(R) for f in range(F)])
    if not torch.equal(a, want):
        raise SystemExit("host_overhead_cpu: the VBE output differs from the padded output's rows")
    best = {k: float("inf") for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            t0 = clock()
            fn()
            best[k] = min(best[k], (clock() - t0) / calls * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default="sgd,rowwise_adagrad,adam")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="cProfile the backward calls of the first optimizer")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--vbe", default=None, metavar="FxR[,FxR]",
                    help="time VBE calls beside padded ones at these shapes (features x ranks) instead")
    ap.add_argument("--vbe-unequal", action="store_true",
                    help="--vbe: batch sizes that differ by feature, so that the offsets need padding (a gather); "
                         "by default every feature has the same sizes")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="--vbe: wall time (time.perf_counter) or the thread's CPU time (time.thread_time: "
                         "steadier on a loaded machine, where other processes take the core between calls)")
    args = ap.parse_args(argv)
    import torch

    import tbegen

    torch.set_num_threads(1)
    indices = torch.tensor([3], dtype=torch.int64)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    grad = torch.ones(1, 4)
    rows = []
    if args.vbe:
        for name in args.optimizers.split(","):
            for shape in args.vbe.split(","):
                F, R = (int(x) for x in shape.lower().split("x"))
                emb = tbegen.TableBatchedEmbeddingBags([(8, 4)] * F, optimizer=name, device="cpu", seed=0)
                vbe_per_call_us(emb, F, R, 50, 1, torch, unequal=args.vbe_unequal)  # warm-up (and the build)
                clock = time.perf_counter if args.clock == "wall" else time.thread_time
                best = vbe_per_call_us(emb, F, R, args.calls, args.rounds, torch, clock, args.vbe_unequal)
                rows.append(dict(optimizer=name, features=F, ranks=R, unequal=args.vbe_unequal,
                                 **{k: round(v, 2) for k, v in best.items()}))
                if not args.json:
                    print(f"{name} F={F} R={R}{' (unequal)' if args.vbe_unequal else ''}: forward (no_grad) VBE {best['vbe_forward_no_grad']:6.2f} us, padded "
                          f"{best['padded_forward_no_grad']:6.2f} us ({best['vbe_forward_no_grad'] / best['padded_forward_no_grad']:.2f}x); "
                          f"step VBE plan kept {best['vbe_step_plan_kept']:6.2f} us "
                          f"({best['vbe_step_plan_kept'] / best['padded_step']:.2f}x), new plan "
                          f"{best['vbe_step_new_plan']:6.2f} us ({best['vbe_step_new_plan'] / best['padded_step']:.2f}x), "
                          f"padded {best['padded_step']:6.2f} us; with new offsets each step: VBE (plan kept) "
                          f"{best['vbe_step_fresh_offsets']:6.2f} us, padded {best['padded_step_fresh_offsets']:6.2f} us "
                          f"({best['vbe_step_fresh_offsets'] / best['padded_step_fresh_offsets']:.2f}x)", flush=True)
        if args.json:
            print(json.dumps(dict(torch=torch.__version__, calls=args.calls, rounds=args.rounds, clock=args.clock,
                                  vbe=rows)))
        return 0
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
