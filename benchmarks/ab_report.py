"""The A/Bs of a run_gpu_ab.sh call side by side, cell by cell (its ab.json: each A/B's sweep.json
with the defaults, then with the variant's switches, FBGEMM timed beside both).

    python3 benchmarks/ab_report.py docs/gpu-runs/<run>/ab/ab.json > ab_report.md

Per cell: tbegen's backward ms with the defaults and with the variant, the variant's change, and
both backward speedups over FBGEMM; FBGEMM's own drift between the two halves says how much of a
change is noise (the same FBGEMM kernels timed minutes apart)."""

from __future__ import annotations

import argparse
import json
import math


def pairs(ab: dict):
    """(regex, variant, default sweep, variant sweep) for each A/B, in the order the call ran them
    (keys "REGEX | defaults" or, since landing10, "REGEX | defaults (beside VARIANT)", then
    "REGEX | VARIANT")."""
    keys = [k for k in ab if k != "end"]
    for k in range(0, len(keys) - 1, 2):
        only, side = keys[k].rsplit(" | ", 1)
        only2, variant = keys[k + 1].rsplit(" | ", 1)
        if not side.startswith("defaults") or only2 != only:
            raise SystemExit(f"ab.json: {keys[k]!r} and {keys[k + 1]!r} are not an A/B pair")
        yield only, variant, ab[keys[k]], ab[keys[k + 1]]


def by_cell(sweep: dict) -> dict:
    return {(c["shape"], c["opt"]): c for c in sweep["cells"] if "tbegen" in c and "fbgemm" in c}


def table(only: str, variant: str, base: dict, var: dict) -> str:
    a, b = by_cell(base), by_cell(var)
    lines = [f"## {variant} on cells matching `{only}`", "",
             "| shape | optimizer | tbegen bwd ms default / variant | change | bwd speedup default / variant | FBGEMM drift |",
             "|---|---|---|---|---|---|"]
    logs = []
    for key in sorted(a, key=lambda k: a[k]["bwd_speedup"]):
        if key not in b:
            continue
        t0, t1 = a[key]["tbegen"]["bwd_ms"], b[key]["tbegen"]["bwd_ms"]
        f0, f1 = a[key]["fbgemm"]["bwd_ms"], b[key]["fbgemm"]["bwd_ms"]
        logs.append(math.log(t1 / t0))
        lines.append(f"| {key[0]} | {key[1]} | {t0:.3f} / {t1:.3f} | {100 * (t1 / t0 - 1):+.1f}% | "
                     f"{a[key]['bwd_speedup']:.2f}x / {b[key]['bwd_speedup']:.2f}x | {100 * (f1 / f0 - 1):+.1f}% |")
    if logs:
        lines += ["", f"geometric mean change of tbegen's backward: {100 * (math.exp(sum(logs) / len(logs)) - 1):+.1f}% "
                  f"over {len(logs)} cells", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ab_json")
    args = ap.parse_args()
    with open(args.ab_json) as f:
        ab = json.load(f)
    print("\n".join(table(*p) for p in pairs(ab)))


if __name__ == "__main__":
    main()
