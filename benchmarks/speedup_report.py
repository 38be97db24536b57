#!/usr/bin/env python3
"""tbegen's speed against FBGEMM, from one run of the referee (bench_tbe.py, both systems timed in
the same process): a JSON summary, a Markdown table and (where matplotlib is installed) a PNG chart
of the speedup over FBGEMM per cell and the share of the copy-bandwidth limit.

    python benchmarks/speedup_report.py RUN_DIR [--out DIR]

RUN_DIR holds the referee's results.jsonl (e.g. docs/gpu-runs/2026-12-04-landing4/fbgemm). Writes
speedup.json, speedup.md and speedup.png into --out (default RUN_DIR). Only ratios from one run
are reported: absolute times move between runs and machines.
"""

import argparse
import json
import math
from pathlib import Path

CONFIGS = ("C1", "C2", "C3")
OPTIMIZERS = ("EXACT_SGD", "EXACT_ROWWISE_ADAGRAD", "EXACT_ADAGRAD", "ADAM")
SHORT = {"EXACT_SGD": "sgd", "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad", "EXACT_ADAGRAD": "adagrad", "ADAM": "adam"}
GOAL_CELL, GOAL_GEOMEAN, GOAL_PRODUCT = 1.1, 1.5, 2.0  # issue 8: every cell, geometric mean, product goal


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def cells(results_path: Path):
    rows = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
    bench = {(r["config"], r["opt"], r["system"]): r for r in rows if r.get("kind") == "bench" and "error" not in r}
    out = []
    for c in CONFIGS:
        for o in OPTIMIZERS:
            f, t = bench.get((c, o, "fbgemm")), bench.get((c, o, "tbegen"))
            if not (f and t):
                continue
            out.append(dict(
                config=c, optimizer=SHORT[o],
                fbgemm_bwd_ms=f["bwd_ms"], tbegen_bwd_ms=t["bwd_ms"], bwd_speedup=f["bwd_ms"] / t["bwd_ms"],
                fbgemm_fwd_ms=f["fwd_ms"], tbegen_fwd_ms=t["fwd_ms"], fwd_speedup=f["fwd_ms"] / t["fwd_ms"],
                tbegen_pct_of_copy=t.get("pct_copy"), fbgemm_pct_of_copy=f.get("pct_copy"),
            ))
    checks = [r for r in rows if r.get("system") == "tbegen" and "vs_fbgemm_rel" in r]
    return out, checks


def markdown(summary) -> str:
    lines = ["| config | optimizer | bwd ms FBGEMM / tbegen | bwd speedup | fwd ms FBGEMM / tbegen | fwd speedup "
             "| tbegen % of copy BW |", "|---|---|---:|---:|---:|---:|---:|"]
    for x in summary["cells"]:
        lines.append(
            f"| {x['config']} | {x['optimizer']} | {x['fbgemm_bwd_ms']:.2f} / {x['tbegen_bwd_ms']:.2f} "
            f"| {x['bwd_speedup']:.2f}x | {x['fbgemm_fwd_ms']:.3f} / {x['tbegen_fwd_ms']:.3f} | {x['fwd_speedup']:.2f}x "
            f"| {x['tbegen_pct_of_copy']:.0f} |")
    s = summary
    lines.append("")
    lines.append(f"Backward: geometric mean {s['bwd_geomean']:.2f}x FBGEMM, worst cell {s['bwd_worst']:.2f}x "
                 f"(goals: every cell {GOAL_CELL}x, geometric mean {GOAL_GEOMEAN}x; product goal {GOAL_PRODUCT}x). "
                 f"Forward: worst {s['fwd_worst']:.2f}x, geometric mean {s['fwd_geomean']:.2f}x. "
                 f"Correctness in the same run: largest tbegen-vs-FBGEMM difference of fp32 weights after the "
                 f"check's steps {s['max_vs_fbgemm_rel']:.2g} (relative).")
    return "\n".join(lines) + "\n"


def chart(summary, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # (optimizer names on two lines where they are long: rowwise_adagrad beside adagrad overlapped)
    labels = [f"{x['config']}\n{x['optimizer'].replace('_', chr(10), 1) if len(x['optimizer']) > 8 else x['optimizer']}"
              for x in summary["cells"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    ax1.bar(labels, [x["bwd_speedup"] for x in summary["cells"]], color="tab:blue", label="backward")
    ax1.plot(labels, [x["fwd_speedup"] for x in summary["cells"]], "o", color="tab:orange", label="forward")
    for y, style in ((1.0, "-"), (GOAL_CELL, "--"), (GOAL_PRODUCT, ":")):
        ax1.axhline(y, color="gray", linestyle=style, linewidth=0.8)
    ax1.set_ylabel("speedup over FBGEMM (x)")
    ax1.legend()
    ax2.bar(labels, [x["tbegen_pct_of_copy"] for x in summary["cells"]], color="tab:green")
    ax2.axhline(60, color="gray", linestyle=":", linewidth=0.8)
    ax2.set_ylabel("tbegen backward, % of copy-bandwidth limit")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = args.run_dir / "results.jsonl"
    if not results.exists():
        raise SystemExit(f"speedup_report: {results} does not exist (give the folder of the referee's results.jsonl)")
    out_dir = args.out or args.run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    cell_rows, checks = cells(results)
    if not cell_rows:
        raise SystemExit(f"speedup_report: {results} has no cell timed for both fbgemm and tbegen")
    bwd = [x["bwd_speedup"] for x in cell_rows]
    fwd = [x["fwd_speedup"] for x in cell_rows]
    summary = dict(
        cells=cell_rows, bwd_geomean=geomean(bwd), bwd_worst=min(bwd), fwd_geomean=geomean(fwd), fwd_worst=min(fwd),
        # fp32 weights only: fp16 weights are rounded stochastically, with other random bits than FBGEMM's
        max_vs_fbgemm_rel=max((c["vs_fbgemm_rel"] for c in checks if c.get("wprec") == "fp32"), default=float("nan")),
    )
    (out_dir / "speedup.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "speedup.md").write_text(markdown(summary))
    made_png = chart(summary, out_dir / "speedup.png")
    print(markdown(summary))
    print(f"wrote {out_dir / 'speedup.json'}, {out_dir / 'speedup.md'}"
          + (f", {out_dir / 'speedup.png'}" if made_png else " (no PNG: matplotlib is not installed)"))


if __name__ == "__main__":
    main()
