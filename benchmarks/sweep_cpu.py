#!/usr/bin/env python3
"""The CPU shape sweep: tbegen beside FBGEMM CPU on shapes around the referee's CPU-1 and CPU-2.

    PYTHONPATH=$PWD python3 benchmarks/sweep_cpu.py --out DIR [--threads 2] [--quick]

Needs fbgemm-gpu-cpu beside its torch (1.8.0 with 2.13; `. ../shared/tools/fbgemm-suite/venv.sh`
makes such a venv and sets APY). The referee (../shared/tools/fbgemm-anchor/bench_cpu.py, or
.anchor/) is imported and its own code does the work: its batch generator, FBGEMM's module as it
builds it, tbegen's module as it builds it, the step (forward, then `out.backward(grad)`) and the
round-robin timing (one step of each system per iteration, medians). The sweep only changes the
referee's shape globals (T, E, D, B, L) per cell, from the base CPU-1 (T=8, E=100,000, D=64,
B=2048, L=20): the row width, the number of tables, the pooling factor, the batch, uniform or Zipf
1.1 indices; each shape with sgd, adagrad and rowwise_adagrad (the optimizers FBGEMM CPU has).
Beside the fp32 sum-pooled cells: fp16 weights on five of the shapes (FBGEMM's
weights_precision=SparseType.FP16, fp32 output in both; FBGEMM CPU ignores stochastic_rounding, so
tbegen rounds to nearest too), and CPU-2 with per-sample weights (weighted sum) and with mean pooling.
For those cells the modules are built here, with the referee's tables, weights, learning rate and
eps; the step is the referee's (forward, then `out.backward(grad)`, timed the same way), with the
per-sample weights passed to the forward of the weighted cells.

Writes sweep_cpu.json and sweep_cpu.md (cells sorted by speedup, worst first) into --out. CPU times
move with what else runs on the machine: the load average at the start and end is recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import referee as referee_scripts  # noqa: E402  (benchmarks/referee.py)
OPTS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")
BASE = dict(T=8, E=100_000, D=64, B=2048, L=20, dist="uniform")


BASE = dict(BASE, dtype="fp32", mode="sum")
FP16_SHAPES = ("CPU-1", "CPU-2", "D=16 zipf", "D=128 zipf", "L=5 zipf")


def shapes(quick: bool = False) -> list:
    """The cells' shapes: fp32 sum-pooled ones, then fp16 (FP16_SHAPES), then CPU-2 weighted and
    mean. A shape's name says what differs from fp32 sum pooling."""
    out = [dict(BASE, name="CPU-1"), dict(BASE, name="CPU-2", dist="zipf")]
    for d in (8, 16, 32, 128, 256):
        out.append(dict(BASE, name=f"D={d} zipf", D=d, dist="zipf"))
    out += [dict(BASE, name=f"T={t} zipf", T=t, dist="zipf") for t in (2, 32)]
    out += [dict(BASE, name=f"L={n} zipf", L=n, dist="zipf") for n in (1, 5, 60)]
    out += [dict(BASE, name=f"B={b} zipf", B=b, dist="zipf") for b in (256, 8192)]
    out += [dict(BASE, name="D=128 uniform", D=128), dict(BASE, name="L=5 uniform", L=5)]
    by_name = {s["name"]: s for s in out}
    out += [dict(by_name[n], name=f"{n} fp16", dtype="fp16") for n in FP16_SHAPES]
    out += [dict(by_name["CPU-2"], name="CPU-2 weighted", mode="weighted"),
            dict(by_name["CPU-2"], name="CPU-2 mean", mode="mean")]
    if quick:
        out = out[:2] + [s for s in out if s["dtype"] == "fp16"][:1] + [s for s in out if s["mode"] == "weighted"]
    return out


def batch_seed(s: dict) -> int:
    """The seed of a shape's batches: the fp32 sum-pooled shape's own (its fp16, weighted and mean
    cells step through the same batches)."""
    base = s["name"].split(" fp16")[0].replace(" weighted", "").replace(" mean", "")
    return sum(map(ord, base))


def with_weights(batches: list, seed: int) -> list:
    """The batches with per-sample weights in [0.5, 1.5) appended (one per index)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(*b, torch.rand(b[0].numel(), generator=g) + 0.5) for b in batches]


def weighted_step(emb, batch):
    """The referee's fbgemm_step with the batch's per-sample weights passed to the forward."""
    indices, offsets, _, grad, psw = batch
    t0 = time.perf_counter()
    out = emb(indices, offsets, per_sample_weights=psw)
    t1 = time.perf_counter()
    out.backward(grad)
    t2 = time.perf_counter()
    return {"fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0}


def make_fbgemm(ref, opt: str, W0, s: dict):
    """FBGEMM's module for a cell: the referee's own for fp32 sum pooling, else built the way the
    referee builds it, with the cell's weights precision and pooling."""
    if s["dtype"] == "fp32" and s["mode"] == "sum":
        return ref.make_fbgemm(opt, W0)
    import torch
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, PoolingMode, SplitTableBatchedEmbeddingBagsCodegen)

    emb = SplitTableBatchedEmbeddingBagsCodegen(
        [(ref.E, ref.D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * ref.T,
        optimizer=ref.FBGEMM_OPT[opt], learning_rate=ref.LR, eps=ref.EPS,
        pooling_mode=PoolingMode.MEAN if s["mode"] == "mean" else PoolingMode.SUM,
        weights_precision=SparseType.FP16 if s["dtype"] == "fp16" else SparseType.FP32,
        output_dtype=SparseType.FP32)
    with torch.no_grad():
        for w, w0 in zip(emb.split_embedding_weights(), W0):
            w.copy_(w0)
    return emb


def make_tbegen(ref, opt: str, W0, s: dict):
    """tbegen's module for a cell: the referee's own for fp32 sum pooling, else the same tables and
    hyperparameters with the cell's weights dtype (rounded to nearest, as FBGEMM CPU) and pooling."""
    if s["dtype"] == "fp32" and s["mode"] == "sum":
        return ref.make_tbegen(opt, W0)
    import torch
    import tbegen

    name = ref.TBEGEN_OPT[opt]
    hp = dict(learning_rate=ref.LR) if name == "sgd" else dict(learning_rate=ref.LR, eps=ref.EPS)
    emb = tbegen.TableBatchedEmbeddingBags(
        tables=[(ref.E, ref.D)] * ref.T, optimizer=name, pooling="mean" if s["mode"] == "mean" else "sum",
        weights_dtype=torch.float16 if s["dtype"] == "fp16" else torch.float32, output_dtype=torch.float32,
        stochastic_rounding=False, device="cpu", **hp)
    for w, w0 in zip(emb.split_embedding_weights(), W0):
        w.copy_(w0)
    return emb


def referee():
    """bench_cpu.py, the referee (its batches, modules, step and round-robin timing)."""
    return referee_scripts.load("bench_cpu.py")


def set_shape(ref, s: dict, torch) -> None:
    """The referee's shape globals, as its functions read them."""
    ref.T, ref.E, ref.D, ref.B, ref.L = s["T"], s["E"], s["D"], s["B"], s["L"]
    ref._TOFF = torch.arange(0, s["B"] * s["L"] + 1, s["L"], dtype=torch.int64)


def git_tree() -> str:
    """The checkout's commit, with '+changes' when tracked files differ from it ('' without git)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+changes" if dirty else "")


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def group_lines(cells: list) -> list:
    """One line per kind of cell (fp32 sum pooling, fp16, weighted, mean) when there are several."""
    def kind(c):
        return ("fp16 weights" if c.get("dtype", "fp32") == "fp16" else
                {"sum": "fp32, sum pooling", "weighted": "fp32, weighted (per-sample weights)",
                 "mean": "fp32, mean pooling"}[c.get("mode", "sum")])

    kinds = {}
    for c in cells:
        kinds.setdefault(kind(c), []).append(c)
    if len(kinds) < 2:
        return []
    lines = []
    for k, cs in kinds.items():
        worst = min(cs, key=lambda c: c["speedup"])
        lines.append(f"- {k}: {len(cs)} cells, geometric mean {geomean([c['speedup'] for c in cs]):.2f}x, worst "
                     f"{worst['speedup']:.2f}x ({worst['shape']} {worst['opt']}), under 1.1x: {sum(c['speedup'] < 1.1 for c in cs)}")
    return lines + [""]


def markdown(summary: dict) -> str:
    cells = sorted(summary["cells"], key=lambda c: c["speedup"])
    lines = [
        "# CPU shape sweep: tbegen beside FBGEMM CPU",
        "",
        f"{summary['date_utc']} UTC, {summary['machine']}, {summary['threads']} threads, torch {summary['torch']}, "
        f"fbgemm-gpu-cpu {summary['fbgemm']}; load average {summary['load_start']} at the start, "
        f"{summary['load_end']} at the end. Speedup = FBGEMM's step (forward + backward with its fused "
        f"update, its default bounds check) / tbegen's, medians of the same round-robin run.",
        "",
        *([f"Command: `{summary['command']}`" + (f" (tree {summary['tree']})" if summary.get("tree") else ""), ""]
          if summary.get("command") else []),
        f"Geometric mean **{geomean([c['speedup'] for c in cells]):.2f}x**, worst {cells[0]['speedup']:.2f}x "
        f"({cells[0]['shape']} {cells[0]['opt']}), cells under 1.1x: {sum(c['speedup'] < 1.1 for c in cells)} of {len(cells)}.",
        "",
        *group_lines(cells),
        "| shape | optimizer | T E D B L dist | FBGEMM ms (fwd / bwd) | tbegen ms (fwd / bwd) | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        f, t = c["fbgemm"], c["tbegen"]
        lines.append(f"| {c['shape']} | {c['opt']} | {c['T']} {c['E']} {c['D']} {c['B']} {c['L']} {c['dist']} "
                     f"| {f['total']:.2f} ({f['fwd']:.2f} / {f['bwd']:.2f}) | {t['total']:.2f} ({t['fwd']:.2f} / {t['bwd']:.2f}) "
                     f"| {c['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="sweep-cpu-out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="three shapes: a smoke test")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    ap.add_argument("--markdown", default=None, metavar="JSON",
                    help="print the markdown table of a sweep_cpu.json written before, and exit")
    ap.add_argument("--only", default=None, help="only cells whose 'shape optimizer' matches this regex "
                                                  "(e.g. 'rowwise'; the optimizer without 'exact_')")
    args = ap.parse_args(argv)
    only = re.compile(args.only) if args.only else None
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())), end="")
        return 0
    if args.list:
        for s in shapes(args.quick):
            print(s)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    ref = referee()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_start = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "?"
    cells = []
    for s in shapes(args.quick):
        cell_opts = [o for o in OPTS if not only or only.search(f"{s['name']} {o.replace('exact_', '')}")]
        if not cell_opts:
            continue
        set_shape(ref, s, torch)
        batches = ref.make_batches(s["dist"], seed=batch_seed(s))
        step = ref.fbgemm_step
        if s["mode"] == "weighted":
            batches, step = with_weights(batches, batch_seed(s)), weighted_step
        W0 = ref.init_weights(7)
        for opt in cell_opts:
            impls = [("fbgemm", step, make_fbgemm(ref, opt, W0, s)),
                     ("tbegen", step, make_tbegen(ref, opt, W0, s))]
            r = ref.time_interleaved(impls, batches, args.warmup, args.iters)
            del impls
            cell = dict(shape=s["name"], opt=opt.replace("exact_", ""), **{k: s[k] for k in ("T", "E", "D", "B", "L", "dist", "dtype", "mode")},
                        fbgemm=r["fbgemm"], tbegen=r["tbegen"], speedup=r["fbgemm"]["total"] / r["tbegen"]["total"])
            cells.append(cell)
            print(json.dumps(cell), flush=True)
    import fbgemm_gpu

    summary = dict(date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                   threads=args.threads, torch=torch.__version__, fbgemm=getattr(fbgemm_gpu, "__version__", "?"),
                   load_start=" ".join(load_start), load_end=" ".join(open("/proc/loadavg").read().split()[:3]),
                   command=" ".join([sys.executable] + sys.argv), tree=git_tree(), cells=cells)
    (out / "sweep_cpu.json").write_text(json.dumps(summary, indent=1))
    (out / "sweep_cpu.md").write_text(markdown(summary))
    print((out / "sweep_cpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
