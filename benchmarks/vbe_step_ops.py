#!/usr/bin/env python3
"""What one VBE training step dispatches beyond the padded fixed-batch step (issue 25): the
operators, the tensors made and, on CUDA, the runtime calls (kernel launches, copies, memsets,
allocations), counted per step with torch.profiler.

    TBEGEN_BUILD_DIR=build/ext python3 benchmarks/vbe_step_ops.py                 # CPU (any machine)
    TBEGEN_BUILD_DIR=... python3 benchmarks/vbe_step_ops.py --device cuda --json $OUT/vbe_ops.json

A step is what bench_vbe.py times: forward + `out.backward(grad)` with the fused update, on one of
bench_vbe's skewed batches (features of different totals, so that the offsets need padding) of
--shape F x R (features x ranks), per-rank batch up to --batch. Three steps: `padded` (the same
lookups as a fixed batch padded to the largest), `vbe_kept` (the plan of these sizes kept, as
when sizes repeat), `vbe_new` (the module's kept plans dropped first, as when every batch has new
sizes: TorchRec's case); and the forward alone (no_grad) of VBE and padded.

Counted per step (the mean of --steps profiled steps after --warmup; every count is an integer
when each step does the same):
- `ops`: every operator dispatched (aten and tbegen, at any depth: aten::zeros counts itself, its
  aten::empty and its aten::zero_/fill_);
- `top ops`: those called from Python or autograd rather than from inside another operator;
- `compute ops`: the outermost operators that are neither views, metadata nor bare allocations
  (each is at least one kernel, memset or copy on CUDA), the tbegen operators counted apart;
- `allocation ops`: the aten::empty* calls (every tensor an operator or the module makes
  dispatches one; on CUDA each is a request to the caching allocator);
- CUDA only: the runtime calls by kind, and the host time each kind took (the profiler's CPU
  duration of those calls);
- with --python: the Python the step runs, counted (no clock: the same on any machine for the same
  tree): `python calls` (function calls of any module, C functions included: cProfile's count) and
  `tbegen lines` (lines executed in tbegen/*.py, by file: sys.settrace), per step.
The tbegen operators' own insides differ between the CPU and CUDA builds (the CUDA operators make
scratch tensors and launch several kernels each; the CPU ones mostly work in place): on the CPU,
the counts of the module's Python and the aten operators around the tbegen ones are what carries
over to CUDA. benchmarks/NOTES-cpu.md ("VBE: launches per step") has what the CUDA operators add,
read from their source.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vbe import draw_batch  # noqa: E402
from tbegen import TableBatchedEmbeddingBags  # noqa: E402

# operators that make no new data on any device (views, metadata, no-op conversions), and bare
# allocations; everything else dispatched is work (a kernel, a memset or a copy on CUDA)
VIEW_OPS = frozenset(f"aten::{n}" for n in (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "narrow", "detach",
    "detach_", "alias", "t", "transpose", "expand", "unsqueeze", "squeeze", "permute", "contiguous", "lift_fresh",
    "resolve_conj", "resolve_neg", "unbind", "split", "chunk", "flatten", "unflatten", "to", "result_type",
    "view_as", "expand_as", "set_", "record_stream", "is_nonzero", "_local_scalar_dense", "item"))
ALLOC_PREFIXES = ("aten::empty", "aten::new_empty", "aten::empty_like", "aten::empty_strided")
# CUDA runtime and driver calls by kind (torch.profiler's CPU-side events of the CUDA runtime)
KINDS = (
    ("kernel launches", ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")),
    ("async copies", ("cudaMemcpyAsync", "cudaMemcpy2DAsync")),
    ("memsets", ("cudaMemsetAsync", "cudaMemsetD")),
    ("host waits", ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                    "cudaStreamWaitValue")),
    ("device allocations", ("cudaMalloc", "cudaFree")),
    ("pinned allocations", ("cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaHostRegister")),
    ("event records", ("cudaEventRecord",)),
    ("event queries", ("cudaEventQuery",)),
    ("stream waits", ("cudaStreamWaitEvent",)),
)


def is_op(name: str) -> bool:
    """A dispatched operator: aten's or a tbegen extension's (their namespaces start with tbegen)."""
    return name.startswith("aten::") or (name.startswith("tbegen") and "::" in name)


def runtime_kind(name: str):
    for kind, prefixes in KINDS:
        if any(name == p or name.startswith(p + "_") or name.startswith(p + "(") for p in prefixes):
            return kind
    if name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper()):
        return "other runtime calls"
    return None


def count(prof, steps: int) -> dict:
    ops, top, compute, tbegen_ops, allocs, runtime, runtime_us = (Counter() for _ in range(7))
    for e in prof.events():
        name = e.name
        if e.device_type != torch.autograd.DeviceType.CPU:  # (the GPU's own kernel and copy records)
            continue
        kind = runtime_kind(name) if not is_op(name) else None
        if kind is not None:
            runtime[kind] += 1
            runtime_us[kind] += e.cpu_time_total
            continue
        if not is_op(name):
            continue
        ops[name] += 1
        parents, p = [], e.cpu_parent
        while p is not None:
            parents.append(p.name)
            p = p.cpu_parent
        if not any(is_op(q) for q in parents):
            top[name] += 1
        if name.startswith("tbegen"):
            tbegen_ops[name.split("::", 1)[1]] += 1
        elif name.startswith(ALLOC_PREFIXES):
            allocs[name] += 1
        elif name not in VIEW_OPS and not any(is_op(q) and not q.startswith("tbegen") and q not in VIEW_OPS
                                                 and not q.startswith(ALLOC_PREFIXES) for q in parents):
            compute[name] += 1

    def per_step(c):
        return {k: (v // steps if v % steps == 0 else round(v / steps, 2)) for k, v in sorted(c.items())}

    out = {"ops": sum(ops.values()) / steps, "top ops": per_step(top), "compute ops": per_step(compute),
           "tbegen operators": per_step(tbegen_ops), "allocation ops": per_step(allocs)}
    if runtime:
        out["runtime calls"] = per_step(runtime)
        out["runtime host us"] = {k: round(v / steps, 1) for k, v in sorted(runtime_us.items())}
    return out


def count_python(step, steps: int) -> dict:
    """The Python one step runs (after the profiled steps, so warm): cProfile's function calls, and
    the lines executed in tbegen's own files (sys.settrace), per step."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    calls = pstats.Stats(prof).total_calls
    root = str(Path(__file__).resolve().parents[1] / "tbegen")
    lines = Counter()

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(root):
            return None  # (no line events for frames outside tbegen)

        def local(frame, event, arg):
            if event == "line":
                lines[Path(frame.f_code.co_filename).name] += 1
            return local
        return local(frame, event, arg)

    sys.settrace(tracer)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(None)
    per = lambda v: v // steps if v % steps == 0 else round(v / steps, 2)  # noqa: E731
    return {"python calls": per(calls), "tbegen lines": {k: per(v) for k, v in sorted(lines.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--shape", default="32x16", help="features x ranks (bench_vbe's narrow-skewed: 32x16)")
    ap.add_argument("--batch", type=int, default=16, help="per-rank batch, at most (bench_vbe: 256)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--pooling-factor", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--python", action="store_true",
                    help="also count the Python function calls and tbegen's executed lines per step")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    F, R = (int(x) for x in args.shape.lower().split("x"))
    dev = args.device
    gen = torch.Generator().manual_seed(1)
    ind, off, bsfr, poff, max_B = draw_batch(F, args.rows, R, args.batch, args.pooling_factor, True, gen)
    ind, off, poff = ind.to(dev), off.to(dev), poff.to(dev)
    n_out = sum(b * args.dim for per_rank in bsfr for b in per_rank)
    grad = torch.randn(n_out, generator=gen).to(dev)
    pgrad = torch.randn(max_B, F * args.dim, generator=gen).to(dev)
    hyper = dict(learning_rate=0.01) if args.optimizer == "sgd" else dict(learning_rate=0.01, eps=1e-8)
    emb = TableBatchedEmbeddingBags([(args.rows, args.dim)] * F, optimizer=args.optimizer, device=dev, **hyper)

    def vbe_kept():
        emb(ind, off, batch_size_per_feature_per_rank=bsfr).backward(grad)

    def vbe_new():
        emb.__dict__.get("_vbe_plans", {}).clear()  # (new batch sizes: a new plan)
        vbe_kept()

    def padded():
        emb(ind, poff).backward(pgrad)

    def vbe_forward():
        with torch.no_grad():
            emb(ind, off, batch_size_per_feature_per_rank=bsfr)

    def padded_forward():
        with torch.no_grad():
            emb(ind, poff)

    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    result = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                  optimizer=args.optimizer, features=F, ranks=R, max_B=max_B, bags=off.numel() - 1,
                  padded_bags=poff.numel() - 1, steps={})
    for name, step in dict(padded=padded, vbe_kept=vbe_kept, vbe_new=vbe_new, padded_forward=padded_forward,
                           vbe_forward=vbe_forward).items():
        for _ in range(args.warmup):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(args.steps):
                step()
        if dev == "cuda":
            torch.cuda.synchronize()
        result["steps"][name] = count(prof, args.steps)
        if args.python:
            result["steps"][name].update(count_python(step, args.steps))
    emb.check_errors()

    def diff(a, b):
        keys = sorted(set(a) | set(b))
        return {k: round(a.get(k, 0) - b.get(k, 0), 2) for k in keys if a.get(k, 0) != b.get(k, 0)}

    s = result["steps"]
    result["vbe minus padded"] = {
        m: {part: diff(s[m][part], s[base][part]) for part in ("top ops", "compute ops", "tbegen operators",
                                                                "allocation ops", "runtime calls", "tbegen lines")
            if part in s[m]} | {"ops": s[m]["ops"] - s[base]["ops"]}
        | ({"python calls": s[m]["python calls"] - s[base]["python calls"]} if "python calls" in s[m] else {})
        for m, base in (("vbe_kept", "padded"), ("vbe_new", "padded"), ("vbe_forward", "padded_forward"))}
    print(f"{result['device']}, {args.optimizer}, F x R = {F} x {R}, {result['bags']} bags padded to "
          f"{result['padded_bags']}; per step:")
    for name, c in s.items():
        line = (f"  {name:<15} ops {c['ops']:6.1f}  compute {sum(c['compute ops'].values()):5.1f}  "
                f"tbegen {sum(c['tbegen operators'].values()):4.1f}  allocation ops "
                f"{sum(c['allocation ops'].values()):5.1f}")
        if "python calls" in c:
            line += f"  python calls {c['python calls']}  tbegen lines {sum(c['tbegen lines'].values())}"
        if "runtime calls" in c:
            line += "  | " + ", ".join(f"{k} {v}" for k, v in c["runtime calls"].items())
        print(line)
    for m, d in result["vbe minus padded"].items():
        print(f"  {m} - its padded counterpart: " + json.dumps(d))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
