#!/usr/bin/env python3
"""CPU fused training step (forward + backward + update), tbegen vs PyTorch, in one run.

    python benchmarks/bench_cpu.py [--threads 2] [--opts sgd,adagrad,rowwise_adagrad]

CPU-1: T=8, E=100,000, D=64, B=2048, L=20, uniform indices, fp32, sum. CPU-2: CPU-1 with Zipf(1.1).
PyTorch: one nn.EmbeddingBag(sum, sparse=True) per table + torch.optim.SGD / Adagrad (rowwise
Adagrad written in torch ops over the coalesced sparse gradient). Medians over --iters steps after
--warmup, rotating over --nsets input sets.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tbegen import build  # noqa: E402
from tbegen.layout import make_layout  # noqa: E402
from tbegen.spec import find_spec, load_spec  # noqa: E402

T, E, D, B, L = 8, 100_000, 64, 2048, 20
LR, EPS = 0.01, 1e-8


def make_sets(dist, nsets, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = B * L
    if dist == "zipf":
        p = torch.arange(1, E + 1, dtype=torch.float64).pow(-1.1)
        cdf = torch.cumsum(p, 0)
        cdf /= cdf[-1].clone()
        perms = torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    sets = []
    for _ in range(nsets):
        if dist == "uniform":
            idx = torch.randint(0, E, (T, n), generator=g)
        else:
            ranks = torch.searchsorted(cdf, torch.rand(T, n, generator=g, dtype=torch.float64)).clamp_(max=E - 1)
            idx = torch.gather(perms, 1, ranks)
        sets.append(idx)
    return sets


def time_steps(step, nsets, warmup, iters):
    for i in range(warmup):
        step(i % nsets)
    ts = []
    for i in range(iters):
        t0 = time.perf_counter()
        step(i % nsets)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def bench_tbegen(name, sets, grad, args):
    spec = load_spec(str(find_spec(name)))
    ops = build.load_ops(spec, with_cuda=False)
    layout = make_layout([(E, D)] * T)
    feats = layout.features_tensor()
    weights = torch.empty(layout.weights_numel).uniform_(-0.01, 0.01)
    states = [torch.zeros(layout.weights_numel if s.per == "element" else layout.total_hash_size) for s in spec.states]
    hyper = {"learning_rate": LR, "eps": EPS}
    hvals = [hyper.get(h.name, h.default) for h in spec.hyperparameters]
    offsets = torch.arange(T * B + 1) * L
    flat = [s.reshape(-1).contiguous() for s in sets]
    counter = [0]

    def step(i):
        counter[0] += 1
        out = ops.forward(weights, feats, layout.total_D, layout.max_D, flat[i], offsets, None, 0)
        ops.backward(grad, weights, feats, layout.total_D, layout.max_D, layout.total_hash_size, flat[i], offsets,
                     None, 0, 32, False, 0, *states, *hvals, counter[0])
        return out

    return time_steps(step, len(sets), args.warmup, args.iters)


def bench_torch(name, sets, grad, args):
    bags = [torch.nn.EmbeddingBag(E, D, mode="sum", sparse=True) for _ in range(T)]
    params = [b.weight for b in bags]
    if name == "sgd":
        opt = torch.optim.SGD(params, lr=LR)
    elif name == "adagrad":
        opt = torch.optim.Adagrad(params, lr=LR, eps=EPS)
    else:
        opt = None
        acc = [torch.zeros(E) for _ in range(T)]
    offsets = torch.arange(B) * L
    grads = grad.split(D, dim=1)

    def step(i):
        outs = [bags[t](sets[i][t], offsets) for t in range(T)]
        torch.autograd.backward(outs, grads)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                for t, p in enumerate(params):
                    gr = p.grad.coalesce()
                    rows, vals = gr.indices()[0], gr.values()
                    acc[t].index_add_(0, rows, (vals * vals).mean(1))
                    p.index_add_(0, rows, -(LR / (acc[t][rows].sqrt() + EPS))[:, None] * vals)
                    p.grad = None

    return time_steps(step, len(sets), args.warmup, args.iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--opts", default="sgd,adagrad,rowwise_adagrad")
    ap.add_argument("--nsets", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; fused step ms (median of {args.iters})")
    print("| config | optimizer | tbegen | PyTorch | PyTorch / tbegen |")
    print("|---|---|---:|---:|---:|")
    for cfg, dist in (("CPU-1", "uniform"), ("CPU-2", "zipf")):
        sets = make_sets(dist, args.nsets)
        grad = torch.randn(B, T * D)
        for name in args.opts.split(","):
            ours = bench_tbegen(name, sets, grad, args)
            theirs = bench_torch(name, sets, grad, args)
            print(f"| {cfg} | {name} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
