"""benchmarks/ab_report.py: the A/B tables of a run_gpu_ab.sh call, from its ab.json (checked on a
small made-up file: the pairs, the change, FBGEMM's drift, and a malformed file refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sweep(t_bwd, f_bwd):
    return {"cells": [{"shape": "D=512", "opt": "sgd", "tbegen": {"bwd_ms": t_bwd}, "fbgemm": {"bwd_ms": f_bwd},
                       "bwd_speedup": f_bwd / t_bwd}]}


def _report(tmp_path, ab):
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(ab))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_report.py"), str(path)],
                          capture_output=True, text=True)


def test_pairs_each_variant_with_its_defaults(tmp_path):
    ab = {"^D=512  | defaults (beside X=1)": _sweep(2.0, 3.0), "^D=512  | X=1": _sweep(1.5, 3.03),
          "^D=8  | defaults": _sweep(1.0, 1.0), "^D=8  | Y=0": _sweep(1.1, 1.0), "end": None}
    proc = _report(tmp_path, ab)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "## X=1 on cells matching `^D=512 `" in out and "## Y=0 on cells matching `^D=8 `" in out
    assert "| D=512 | sgd | 2.000 / 1.500 | -25.0% | 1.50x / 2.02x | +1.0% |" in out
    assert "+10.0%" in out


def test_refuses_a_file_whose_halves_do_not_pair(tmp_path):
    proc = _report(tmp_path, {"^a | X=1": _sweep(1, 1), "^a | defaults": _sweep(1, 1), "end": None})
    assert proc.returncode != 0 and "not an A/B pair" in proc.stderr
