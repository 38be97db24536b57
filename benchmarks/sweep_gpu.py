#!/usr/bin/env python3
"""The GPU shape sweep: tbegen beside FBGEMM_GPU on the shapes users train, not only C1-C3.

    # on the GPU machine, from the repository root, with the referee's bundle carried in .anchor/
    python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site
    PYTHONPATH=/tmp/fbg_site:$PWD python3 benchmarks/sweep_gpu.py --out $OUT/sweep      # ~120 cells
    python3 benchmarks/sweep_gpu.py --quick ...          # a smoke test of a dozen cells
    python3 benchmarks/sweep_report.py $OUT/sweep         # (anywhere with matplotlib) the heatmap PNG

Both systems are timed in one process on the same batches, through their user paths (the module's
forward, then `out.backward(grad)`), by the referee's own code: bench_tbe.py's batch generator
(`gen_sets`) and timing loop (`time_loop`), imported from .anchor/ (or $TBEGEN_REFEREE), so a cell
at C1-C3's shape reproduces the referee's figures.

The cells (`cells()`): a base shape (32 tables of 500,000 x 128 fp32 rows, batch 8192, pooling
factor 20, Zipf 1.1 indices, sum pooling, unweighted), then one axis varied at a time from it
(the row width D from 4 to 1024 in fp32 and to 2048 in fp16, bf16 weights, the number of tables
from 1 to 512, the pooling factor from 1 to 150, the batch from 512 to 65536, uniform and Zipf
1.05-1.3 indices, weighted bags, mean pooling, mixed widths in one module, the shapes users
reported behind: many narrow skewed weighted tables and many small lightly pooled ones), plus
seeded random draws over all axes; each shape with sgd, rowwise_adagrad, adagrad and adam. Rows
per table shrink with the shape (at most 2^29 weight elements per module), so that every cell
fits and initialises quickly.

Output (--out): sweep.json (every cell: shape, optimizer, forward and backward ms of each system,
the speedups, and tbegen's share of the copy-bandwidth limit), sweep.md (the cells sorted by the
backward speedup, worst first). A cell either system refuses is recorded with its error.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import referee as referee_scripts  # noqa: E402  (benchmarks/referee.py)
OPTIMIZERS = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adagrad": "EXACT_ADAGRAD",
              "adam": "ADAM"}
LR, EPS, BETA1, BETA2 = 0.01, 1e-8, 0.9, 0.999
MAX_ELEMENTS = 1 << 29  # weight elements per module (rows per table shrink to fit)
BASE = dict(T=32, E=500_000, Ds=None, D=128, B=8192, L=20, dist="zipf", alpha=1.1, wprec="fp32",
            weighted=False, pooling="sum")


# ---- the cells ----------------------------------------------------------------------------------


def shape(name: str, **changes) -> dict:
    """The base shape with `changes`; Ds (one width per table) from D unless given; E shrunk to fit."""
    s = dict(BASE, name=name, **changes)
    if s["Ds"] is None:
        s["Ds"] = [s["D"]] * s["T"]
    s["T"] = len(s["Ds"])
    s["E"] = max(1000, min(s["E"], MAX_ELEMENTS // sum(s["Ds"])))
    s.pop("D")
    return s


def grid() -> list:
    """One axis varied at a time from the base shape."""
    out = [shape("base")]
    out += [shape(f"D={d}", D=d) for d in (4, 8, 20, 32, 64, 256, 512, 1024)]
    out += [shape(f"fp16 D={d}", D=d, wprec="fp16") for d in (128, 512, 2048)]
    out += [shape("bf16 D=128", wprec="bf16")]
    out += [shape(f"T={t}", T=t) for t in (1, 4, 128, 512)]
    out += [shape(f"L={n}", L=n) for n in (1, 50, 150)]
    out += [shape(f"B={b}", B=b) for b in (512, 2048, 65536)]
    out += [shape("uniform", dist="uniform")] + [shape(f"zipf {a}", alpha=a) for a in (1.05, 1.3)]
    out += [shape("weighted", weighted=True), shape("mean", pooling="mean")]
    out += [shape("mixed 8-256", Ds=[8, 16, 32, 64, 128, 256] * 5),
            shape("narrow skewed weighted", Ds=[8, 16, 24, 32] * 32, L=10, alpha=1.2, weighted=True),
            shape("small light", T=256, D=64, E=20_000, L=2)]
    return out


def random_shapes(n: int, seed: int = 2026) -> list:
    """Seeded draws over every axis at once."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        wprec = rng.choice(["fp32", "fp32", "fp16", "bf16"])
        widths = [4, 8, 16, 32, 48, 64, 128, 256, 512] + ([1024] if wprec != "fp32" else [])
        T = rng.choice([2, 8, 24, 64, 160])
        Ds = [rng.choice(widths) for _ in range(T)] if rng.random() < 0.5 else [rng.choice(widths)] * T
        out.append(shape(f"random {k}", Ds=Ds, B=rng.choice([1024, 4096, 16384]), L=rng.choice([1, 3, 10, 30, 80]),
                         dist=rng.choice(["uniform", "zipf"]), alpha=rng.choice([1.05, 1.1, 1.2, 1.3]), wprec=wprec,
                         weighted=rng.random() < 0.3, pooling=rng.choice(["sum", "sum", "mean"]),
                         E=rng.choice([50_000, 500_000, 2_000_000])))
    return out


def cells(quick: bool = False, draws: int = 4) -> list:
    """(shape, optimizer) pairs: every shape with every optimizer (--quick: a dozen)."""
    shapes = grid() + random_shapes(draws)
    if quick:
        shapes = [s for s in shapes if s["name"] in ("base", "D=8", "fp16 D=512", "small light")]
    return [(s, opt) for s in shapes for opt in OPTIMIZERS]


def describe(s: dict) -> str:
    widths = sorted(set(s["Ds"]))
    d = str(widths[0]) if len(widths) == 1 else f"{widths[0]}-{widths[-1]}"
    dist = "uniform" if s["dist"] == "uniform" else f"zipf {s['alpha']}"
    return (f"T={s['T']} E={s['E']} D={d} B={s['B']} L={s['L']} {dist} {s['wprec']}"
            f"{' weighted' if s['weighted'] else ''} {s['pooling']}")


# ---- the systems -----------------------------------------------------------------------------------


def referee():
    """bench_tbe.py, the referee (its batch generator, timing loop and FBGEMM import)."""
    return referee_scripts.load("bench_tbe.py")


def tbegen_module(s: dict, opt: str, torch):
    import tbegen
    from tbegen.module import TableBatchedEmbeddingBags as M

    hp = dict(learning_rate=LR)
    if opt != "sgd":
        hp["eps"] = EPS
    if opt == "adam":
        hp.update(beta1=BETA1, beta2=BETA2)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[s["wprec"]]
    orig = M._initial_weights
    # weights filled on the GPU, as FBGEMM's are (the CPU initialisation is not what is measured)
    M._initial_weights = lambda self, device: torch.empty(
        self.layout.weights_numel, dtype=self.weights_dtype, device=device).uniform_(-0.01, 0.01)
    try:
        return tbegen.TableBatchedEmbeddingBags(tables=[(s["E"], D) for D in s["Ds"]], optimizer=opt,
                                                pooling=s["pooling"], weights_dtype=dtype, device="cuda", **hp)
    finally:
        M._initial_weights = orig


def fbgemm_module(ref, s: dict, opt: str, torch):
    F = ref.FBG
    st = F["SparseType"]
    specs = [(s["E"], D, F["EmbeddingLocation"].DEVICE, F["ComputeDevice"].CUDA) for D in s["Ds"]]
    emb = F["TBE"](specs, optimizer=getattr(F["OptimType"], OPTIMIZERS[opt]),
                   weights_precision={"fp32": st.FP32, "fp16": st.FP16, "bf16": st.BF16}[s["wprec"]],
                   output_dtype=st.FP32,
                   # (FBGEMM_GPU 1.6.0 refuses bf16 weights on the device unless the cache
                   # precision is given: "cache_precision bf16 not supported"; FP32 is its default
                   # for the others, and no cache exists with device placement)
                   **({"cache_precision": st.FP32} if s["wprec"] == "bf16" else {}),
                   learning_rate=LR, eps=EPS, beta1=BETA1, beta2=BETA2, weight_decay=0.0,
                   pooling_mode=getattr(F["PoolingMode"], s["pooling"].upper()), device=torch.device("cuda"))
    emb.weights_dev.uniform_(-0.01, 0.01)
    return emb


def time_system(ref, emb, sets, grad, warmup, iters, torch):
    torch.cuda.synchronize()

    def fwd(i):
        b = sets[i]
        return emb(b["indices"], b["offsets"], per_sample_weights=b["psw"])

    def bwd(out):
        out.backward(grad)

    return ref.time_loop(fwd, bwd, len(sets), warmup, iters)


PROFILE_TOP = 24


def profile_system(ref, emb, sets, grad, torch) -> dict:
    """Kernel time and launches per step (forward and backward), and the PROFILE_TOP longest kernels
    (enough to hold a step's preparation kernels, the sort and the selections, beside the update
    kernels): in a latency-bound cell, a step whose kernels add up to much less than its time waits
    for the host."""
    rows = ref.profile_kernels(lambda i: emb(sets[i]["indices"], sets[i]["offsets"], per_sample_weights=sets[i]["psw"]),
                               lambda out: out.backward(grad), len(sets))
    return dict(us_per_step=sum(r["us_per_iter"] for r in rows),
                launches_per_step=sum(r["calls_per_iter"] for r in rows),
                top=[dict(name=r["name"][:120], us=round(r["us_per_iter"], 1), calls=r["calls_per_iter"]) for r in rows[:PROFILE_TOP]])


# ---- the run ---------------------------------------------------------------------------------------


def run(args) -> int:
    import torch

    ref = referee()
    ref.DEV = torch.device("cuda")
    fbg_version, skipped = ref.load_fbgemm()
    ref.patch_fbgemm_adam_fp16()
    env = ref.env_info(fbg_version, skipped)
    try:
        copy_tbps = ref.copy_bandwidth()["4GiB"]["TBps"]
    except Exception:  # (triton missing: the share of the copy limit is left out)
        copy_tbps = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = cells(args.quick, args.draws)
    if args.only:
        import re
        todo = [(s, o) for s, o in todo if re.search(args.only, f"{s['name']} {o}")]
    todo = todo[: args.cells] if args.cells else todo
    print(f"# {len(todo)} cells; {json.dumps(env)}", flush=True)
    results, t0 = [], time.time()
    by_shape = {}
    for s, opt in todo:
        by_shape.setdefault(s["name"], (s, []))[1].append(opt)
    for name, (s, opts) in by_shape.items():
        cfg = dict(s, E=s["E"])
        gc.collect()
        torch.cuda.empty_cache()
        sets = ref.gen_sets(cfg_for_referee(cfg), args.nsets, seed=sum(map(ord, name)))
        grad = torch.randn((s["B"], sum(s["Ds"])), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
        U = [statistics.mean(b["U"][t] for b in sets) for t in range(s["T"])]
        for opt in opts:
            if time.time() - t0 > args.budget_s:
                results.append(dict(shape=name, opt=opt, skipped="budget"))
                continue
            cell = dict(shape=name, opt=opt, describe=describe(s), T=s["T"], E=s["E"], Ds=sorted(set(s["Ds"])),
                        B=s["B"], L=s["L"], dist=s["dist"], alpha=s["alpha"], wprec=s["wprec"],
                        weighted=s["weighted"], pooling=s["pooling"])
            # both modules at once, timed in alternating rounds (FBGEMM, tbegen, FBGEMM, ...): the
            # median of the rounds' medians, so that a slow moment of the machine (the latency-bound
            # cells move 20-50% between back-to-back runs) falls on both systems alike
            mods = {}
            for system, make in (("fbgemm", lambda: fbgemm_module(ref, s, opt, torch)),
                                 ("tbegen", lambda: tbegen_module(s, opt, torch))):
                try:
                    mods[system] = make()
                except Exception as e:  # (a shape one system refuses is a result too)
                    cell[system] = dict(error=f"{type(e).__name__}: {e}"[:300])
            rounds = {k: [] for k in mods}
            for _ in range(args.rounds):
                for system in list(mods):
                    try:
                        rounds[system].append(time_system(ref, mods[system], sets, grad, args.warmup, args.iters, torch))
                    except Exception as e:
                        cell[system] = dict(error=f"{type(e).__name__}: {e}"[:300])
                        del mods[system]
            for system in mods:
                rs = rounds[system]
                cell[system] = {k: statistics.median(r[k] for r in rs) for k in ("fwd_ms", "bwd_ms", "total_ms")}
                if args.profile:
                    cell[system]["kernels"] = profile_system(ref, mods[system], sets, grad, torch)
            del mods
            gc.collect()
            torch.cuda.empty_cache()
            f, t = cell["fbgemm"], cell["tbegen"]
            if "error" not in f and "error" not in t:
                cell["bwd_speedup"] = f["bwd_ms"] / t["bwd_ms"]
                # each round's own ratio (the two systems timed back to back): their spread is the
                # cell's noise, wide in the host-bound cells (landing12: 0.90-1.22x for one cell)
                cell["bwd_speedup_rounds"] = [a["bwd_ms"] / b["bwd_ms"] for a, b in zip(rounds["fbgemm"], rounds["tbegen"])]
                cell["fwd_speedup"] = f["fwd_ms"] / t["fwd_ms"]
                if copy_tbps:
                    w = {"fp32": 4, "fp16": 2, "bf16": 2}[s["wprec"]]
                    ideal = ref.ideal_bytes(cfg_for_referee(s), U, OPTIMIZERS[opt], w, 4, 4, 4)
                    cell["tbegen_bwd_copy_share"] = ideal / (t["bwd_ms"] * 1e-3) / (copy_tbps * 1e12)
            results.append(cell)
            print(json.dumps(cell), flush=True)
        del sets, grad
    summary = dict(env=env, copy_tbps=copy_tbps, args=vars(args), seconds=time.time() - t0, cells=results)
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    (out / "sweep.md").write_text(markdown(summary))
    print((out / "sweep.md").read_text())
    return 0


def cfg_for_referee(s: dict) -> dict:
    """The referee's config keys (gen_sets and ideal_bytes read T, E, Ds, B, L, dist, alpha, weighted)."""
    return dict(T=s["T"], E=s["E"], Ds=s["Ds"], B=s["B"], L=s["L"], dist=s["dist"], alpha=s["alpha"],
                wprec=s["wprec"], weighted=s["weighted"])


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def rounds_range(cell: dict) -> str:
    """The lowest and highest of a cell's per-round backward speedups ('' where not recorded)."""
    r = cell.get("bwd_speedup_rounds")
    return f"{min(r):.2f}-{max(r):.2f}x" if r else ""


def under_but_noisy(cells_: list, bar: float) -> str:
    """', N of them with a round at or above the bar' (cells whose median is under `bar` while one of
    their rounds is not: the host-bound cells' noise), or '' where no round was recorded."""
    under = [c for c in cells_ if c["bwd_speedup"] < bar and c.get("bwd_speedup_rounds")]
    if not under:
        return ""
    return f" ({sum(max(c['bwd_speedup_rounds']) >= bar for c in under)} of them with a round at or above {bar}x)"


def markdown(summary: dict) -> str:
    cells_ = [c for c in summary["cells"] if "bwd_speedup" in c]
    failed = [c for c in summary["cells"] if "bwd_speedup" not in c]
    env = summary["env"]
    lines = [
        "# GPU shape sweep: tbegen beside FBGEMM_GPU",
        "",
        f"{env.get('date_utc')} UTC, {env.get('gpu')}, torch {env.get('torch')}, FBGEMM_GPU {env.get('fbgemm_gpu')}; "
        f"{len(cells_)} cells timed, {len(failed)} not; {summary['seconds']:.0f} s. Speedup = FBGEMM's time / "
        f"tbegen's, same batches, same process (the referee's gen_sets and time_loop), "
        f"the median of {summary['args'].get('rounds', 1)} alternating rounds.",
        "",
        f"- backward: geometric mean {geomean([c['bwd_speedup'] for c in cells_]):.2f}x, "
        f"worst {min((c['bwd_speedup'] for c in cells_), default=float('nan')):.2f}x, "
        f"cells under 1.1x: {sum(c['bwd_speedup'] < 1.1 for c in cells_)}"
        f"{under_but_noisy(cells_, 1.1)}",
        f"- forward: geometric mean {geomean([c['fwd_speedup'] for c in cells_]):.2f}x, "
        f"worst {min((c['fwd_speedup'] for c in cells_), default=float('nan')):.2f}x, "
        f"cells under 1.0x: {sum(c['fwd_speedup'] < 1.0 for c in cells_)}",
        "",
        "| shape | optimizer | cell | bwd ms fbgemm / tbegen | bwd speedup | rounds' range | fwd ms fbgemm / tbegen | fwd speedup | tbegen bwd % of copy limit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(cells_, key=lambda c: c["bwd_speedup"]):
        share = c.get("tbegen_bwd_copy_share")
        lines.append(f"| {c['shape']} | {c['opt']} | {c['describe']} | {c['fbgemm']['bwd_ms']:.3f} / {c['tbegen']['bwd_ms']:.3f} "
                     f"| {c['bwd_speedup']:.2f}x | {rounds_range(c)} | {c['fbgemm']['fwd_ms']:.3f} / {c['tbegen']['fwd_ms']:.3f} "
                     f"| {c['fwd_speedup']:.2f}x | {'' if share is None else f'{100 * share:.0f}%'} |")
    profiled = [c for c in cells_ if "kernels" in c["fbgemm"] and "kernels" in c["tbegen"]]
    if profiled:
        lines += ["", "Kernels per step (torch.profiler, 3 steps; time of the CUDA kernels, not of the step):", "",
                  "| shape | optimizer | step ms fbgemm / tbegen | kernel us fbgemm / tbegen | launches fbgemm / tbegen |",
                  "|---|---|---|---|---|"]
        for c in profiled:
            f, t = c["fbgemm"], c["tbegen"]
            lines.append(f"| {c['shape']} | {c['opt']} | {f['total_ms']:.3f} / {t['total_ms']:.3f} "
                         f"| {f['kernels']['us_per_step']:.0f} / {t['kernels']['us_per_step']:.0f} "
                         f"| {f['kernels']['launches_per_step']:.0f} / {t['kernels']['launches_per_step']:.0f} |")
    if failed:
        lines += ["", "Not timed:", ""]
        for c in failed:
            why = c.get("skipped") or "; ".join(f"{k}: {c[k]['error']}" for k in ("fbgemm", "tbegen")
                                                  if isinstance(c.get(k), dict) and "error" in c[k])
            lines.append(f"- {c['shape']} {c['opt']}: {why}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "sweep-out"))
    ap.add_argument("--quick", action="store_true", help="a dozen cells: a smoke test")
    ap.add_argument("--cells", type=int, default=0, help="only the first N cells")
    ap.add_argument("--only", default="", help="only cells whose 'shape optimizer' matches this regex")
    ap.add_argument("--draws", type=int, default=4, help="random shapes beside the grid")
    ap.add_argument("--nsets", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per system (median)")
    ap.add_argument("--profile", action="store_true",
                    help="also each system's CUDA kernels per step (the referee's profile_kernels, 3 steps): "
                         "kernel time and launches per step, the %d longest kernels, into sweep.json" % PROFILE_TOP)
    ap.add_argument("--budget-s", type=float, default=540, help="start no new cell after this many seconds")
    ap.add_argument("--list", action="store_true", help="print the cells and exit (no GPU needed)")
    args = ap.parse_args(argv)
    if args.list:
        todo = cells(args.quick, args.draws)
        for s, opt in todo:
            print(f"{s['name']:>24}  {opt:<16} {describe(s)}")
        print(f"{len(todo)} cells")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
