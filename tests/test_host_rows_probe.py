"""benchmarks/tools/host_rows_probe.py on a GPU, on tables small enough to take seconds: every
kind allocates, every column is timed, and the exchange column does not break when --rows
exceeds half the table's rows (its out and in rows must be disjoint, n each)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

cuda = pytest.mark.cuda

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "tools"))


@cuda
@pytest.mark.parametrize("rows", [500, 1500])  # (the table: 0.001 GB of 512-byte rows, 1953 rows)
def test_cuda_probe_runs_every_kind(tmp_path, rows):
    import host_rows_probe

    out = tmp_path / "probe.json"
    host_rows_probe.main(["--gb", "0.001", "--rows", str(rows), "--reps", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    kinds = {c["kind"] for c in result["cases"]}
    assert kinds == {"managed", "managed-thp", "host", "host-thp", "split-host"}, kinds
    for case in result["cases"]:
        assert case["h2d_GBps"] > 0 and case["d2h_GBps"] > 0 and case["both_GBps"] > 0
        timed = "exchange_GBps" in case
        assert timed == (case["kind"] in host_rows_probe.WITH_SLOTS and 2 * rows <= 1953), case
