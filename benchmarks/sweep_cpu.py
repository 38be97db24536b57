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


def shapes(quick: bool = False) -> list:
    out = [dict(BASE, name="CPU-1"), dict(BASE, name="CPU-2", dist="zipf")]
    for d in (8, 16, 32, 128, 256):
        out.append(dict(BASE, name=f"D={d} zipf", D=d, dist="zipf"))
    out += [dict(BASE, name=f"T={t} zipf", T=t, dist="zipf") for t in (2, 32)]
    out += [dict(BASE, name=f"L={n} zipf", L=n, dist="zipf") for n in (1, 5, 60)]
    out += [dict(BASE, name=f"B={b} zipf", B=b, dist="zipf") for b in (256, 8192)]
    out += [dict(BASE, name="D=128 uniform", D=128), dict(BASE, name="L=5 uniform", L=5)]
    if quick:
        out = out[:3]
    return out


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
        set_shape(ref, s, torch)
        batches = ref.make_batches(s["dist"], seed=sum(map(ord, s["name"])))
        W0 = ref.init_weights(7)
        for opt in OPTS:
            if only and not only.search(f"{s['name']} {opt.replace('exact_', '')}"):
                continue
            impls = [("fbgemm", ref.fbgemm_step, ref.make_fbgemm(opt, W0)),
                     ("tbegen", ref.fbgemm_step, ref.make_tbegen(opt, W0))]
            r = ref.time_interleaved(impls, batches, args.warmup, args.iters)
            cell = dict(shape=s["name"], opt=opt.replace("exact_", ""), **{k: s[k] for k in ("T", "E", "D", "B", "L", "dist")},
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
