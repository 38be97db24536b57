#!/usr/bin/env python3
"""Markdown table, JSON summary and PNG chart of one CPU referee run (FBGEMM beside tbegen).

The referee is ../shared/tools/fbgemm-anchor/bench_cpu.py, which steps FBGEMM CPU, PyTorch and
tbegen round-robin in one process and writes its medians with --json:

    PYTHONPATH=$PWD /tmp/anchor-cpu/bin/python ../shared/tools/fbgemm-anchor/bench_cpu.py \\
        --tbegen --iters 30 --warmup 6 --repeats 3 --json run.json
    python benchmarks/cpu_referee_report.py run.json [--png chart.png] [--summary summary.json]

Each cell's speed is FBGEMM's fused step (forward + backward, the default bounds check, as FBGEMM
ships) divided by tbegen's, both medians of the same run; the geometric mean is over the cells.
"""

import argparse
import json
import math

FBGEMM = "FBGEMM CPU TBE (default bounds_check=WARNING)"
FBGEMM_NO_CHECK = "FBGEMM CPU TBE (bounds_check=NONE)"
TBEGEN = "tbegen TableBatchedEmbeddingBags"
OPTIMIZERS = {"exact_sgd": "sgd", "exact_adagrad": "adagrad", "exact_rowwise_adagrad": "rowwise_adagrad"}


def cells(results):
    """(config, optimizer) -> {implementation label: result row}, in the run's order."""
    out = {}
    for r in results:
        out.setdefault((r["config"], r["optimizer"]), {})[r["impl"]] = r
    return out


def summarize(run):
    rows = []
    for (config, opt), impls in cells(run["results"]).items():
        fb, tb = impls.get(FBGEMM), impls.get(TBEGEN)
        if fb is None or tb is None:
            raise SystemExit(f"{config} {opt}: the run has no {'FBGEMM' if fb is None else 'tbegen'} row "
                             "(was bench_cpu.py run with --tbegen?)")
        torch_row = next((r for label, r in impls.items() if label not in (FBGEMM, FBGEMM_NO_CHECK, TBEGEN)), None)
        rows.append(dict(
            config=config, optimizer=OPTIMIZERS.get(opt, opt),
            fbgemm_ms=fb["total"], fbgemm_no_check_ms=impls.get(FBGEMM_NO_CHECK, {}).get("total"),
            torch_ms=torch_row["total"] if torch_row else None, tbegen_ms=tb["total"],
            fbgemm_fwd_ms=fb["fwd"], tbegen_fwd_ms=tb["fwd"], fbgemm_bwd_ms=fb["bwd"], tbegen_bwd_ms=tb["bwd"],
            tbegen_reps=tb["total_reps"], fbgemm_reps=fb["total_reps"],
            speedup=fb["total"] / tb["total"],
        ))
    geo = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows))
    return dict(info=run.get("info", {}), cells=rows, geometric_mean=geo, worst=min(r["speedup"] for r in rows))


def markdown(s):
    lines = [
        "| config | optimizer | FBGEMM CPU | FBGEMM (no bounds check) | PyTorch | tbegen | tbegen fwd / FBGEMM fwd "
        "| tbegen bwd / FBGEMM bwd | speed vs FBGEMM |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["cells"]:
        nc = f"{r['fbgemm_no_check_ms']:.1f}" if r["fbgemm_no_check_ms"] is not None else "-"
        pt = f"{r['torch_ms']:.1f}" if r["torch_ms"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['optimizer']} | {r['fbgemm_ms']:.1f} | {nc} | {pt} | {r['tbegen_ms']:.1f} "
            f"| {r['tbegen_fwd_ms']:.1f} / {r['fbgemm_fwd_ms']:.1f} | {r['tbegen_bwd_ms']:.1f} / {r['fbgemm_bwd_ms']:.1f} "
            f"| {r['speedup']:.2f}x |"
        )
    lines.append("")
    lines.append(f"Geometric mean {s['geometric_mean']:.2f}x, worst cell {s['worst']:.2f}x (FBGEMM's step / tbegen's).")
    return "\n".join(lines)


def chart(s, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['config']}\n{r['optimizer']}" for r in s["cells"]]
    speed = [r["speedup"] for r in s["cells"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(speed)), speed, color=["tab:green" if x >= 1 else "tab:red" for x in speed])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(speed)), labels, fontsize=8)
    ax.set_ylabel("FBGEMM CPU step / tbegen step")
    ax.set_title(f"tbegen vs FBGEMM CPU, fused step (geometric mean {s['geometric_mean']:.2f}x)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="the JSON that bench_cpu.py --json wrote")
    ap.add_argument("--png", help="write the speedup chart here")
    ap.add_argument("--summary", help="write the per-cell ratios as JSON here")
    args = ap.parse_args()
    with open(args.run) as f:
        s = summarize(json.load(f))
    print(markdown(s))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(s, f, indent=1)
    if args.png:
        chart(s, args.png)


if __name__ == "__main__":
    main()
