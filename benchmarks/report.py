#!/usr/bin/env python3
"""Side-by-side table of one GPU run: tbegen (bench.py) vs FBGEMM and PyTorch (the anchor script).

    python benchmarks/report.py OUT_DIR     # OUT_DIR holds tbegen_results.jsonl and fbgemm/results.jsonl
"""

import json
import sys
from pathlib import Path

FBGEMM_NAMES = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adagrad": "EXACT_ADAGRAD", "adam": "ADAM"}


def read_jsonl(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main():
    out = Path(sys.argv[1])
    ours = read_jsonl(out / "tbegen_results.jsonl")
    anchors = [r for r in read_jsonl(out / "fbgemm" / "results.jsonl") if r.get("kind") == "bench" and "error" not in r]
    by = {(r["config"], r["system"], r["opt"]): r for r in anchors}
    print("| config | optimizer | tbegen fwd ms | FBGEMM fwd ms | tbegen bwd ms | FBGEMM bwd ms | PyTorch bwd ms "
          "| FBGEMM / tbegen (bwd) | tbegen % of copy BW |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in ours:
        fb = by.get((r["config"], "fbgemm", FBGEMM_NAMES.get(r["optimizer"], "")), {})
        pt = by.get((r["config"], "torch", FBGEMM_NAMES.get(r["optimizer"], "")), {})
        ratio = f"{fb['bwd_ms'] / r['bwd_ms']:.2f}x" if fb else "-"
        print(f"| {r['config']} | {r['optimizer']} | {r['fwd_ms']:.3f} | {fb.get('fwd_ms', float('nan')):.3f} "
              f"| {r['bwd_ms']:.3f} | {fb.get('bwd_ms', float('nan')):.3f} | {pt.get('bwd_ms', float('nan')):.2f} "
              f"| {ratio} | {r['pct_of_copy']:.0f} |")


if __name__ == "__main__":
    main()
