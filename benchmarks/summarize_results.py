#!/usr/bin/env python3
"""Table of the harness results a test session recorded ($TBEGEN_RESULTS_DIR, see tests/conftest.py):
cases, failures and the worst error per optimizer and weight dtype.

    python benchmarks/summarize_results.py DIR [--delete]   # prints markdown; --delete merges the
                                                           # per-process files into results.jsonl
"""
import json
import sys
from collections import defaultdict
from pathlib import Path


def main():
    d = Path(sys.argv[1])
    files = sorted(d.glob("harness_results_*.jsonl"))
    rows = [json.loads(l) for f in files for l in f.read_text().splitlines() if l.strip()]
    if "--delete" in sys.argv:
        with open(d / "harness_results.jsonl", "a") as out:
            for r in rows:
                out.write(json.dumps(r) + "\n")
        for f in files:
            f.unlink()
    table = defaultdict(lambda: dict(cases=0, failed=0, worst=0.0, what=""))
    for r in rows:
        t = table[(r["device"], r["optimizer"], r["dtype"])]
        t["cases"] += 1
        t["failed"] += bool(r["failures"])
        for what, e in r["errors"].items():
            if e > t["worst"]:
                t["worst"], t["what"] = e, what
    print("| device | optimizer | weights | cases | failed | worst error (quantity) |")
    print("|---|---|---|---:|---:|---|")
    for (dev, opt, dt), t in sorted(table.items()):
        print(f"| {dev} | {opt} | {dt} | {t['cases']} | {t['failed']} | {t['worst']:.3g} ({t['what']}) |")


if __name__ == "__main__":
    main()
