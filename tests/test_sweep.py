"""The GPU shape sweep's cells and report (benchmarks/sweep_gpu.py, sweep_report.py), without a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sweep_gpu  # noqa: E402
import sweep_report  # noqa: E402


def test_the_sweep_has_80_to_150_cells_varying_every_axis():
    todo = sweep_gpu.cells()
    assert 80 <= len(todo) <= 150
    shapes = {s["name"]: s for s, _ in todo}
    assert {o for _, o in todo} == set(sweep_gpu.OPTIMIZERS)
    widths = {d for s in shapes.values() for d in s["Ds"]}
    assert min(widths) <= 4 and max(widths) >= 1024
    assert max(max(s["Ds"]) for s in shapes.values() if s["wprec"] == "fp16") >= 2048
    assert {s["wprec"] for s in shapes.values()} == {"fp32", "fp16", "bf16"}
    assert min(s["T"] for s in shapes.values()) == 1 and max(s["T"] for s in shapes.values()) >= 300
    assert min(s["L"] for s in shapes.values()) == 1 and max(s["L"] for s in shapes.values()) >= 100
    assert min(s["B"] for s in shapes.values()) <= 512 and max(s["B"] for s in shapes.values()) >= 65536
    assert {s["dist"] for s in shapes.values()} == {"uniform", "zipf"}
    alphas = {s["alpha"] for s in shapes.values() if s["dist"] == "zipf"}
    assert min(alphas) <= 1.05 and max(alphas) >= 1.3
    assert {s["pooling"] for s in shapes.values()} == {"sum", "mean"}
    assert any(s["weighted"] for s in shapes.values()) and not all(s["weighted"] for s in shapes.values())
    assert any(len(set(s["Ds"])) > 1 for s in shapes.values())  # mixed widths in one module
    for s in shapes.values():  # every module fits the per-module element budget
        assert s["E"] * sum(s["Ds"]) <= max(sweep_gpu.MAX_ELEMENTS, 1000 * sum(s["Ds"]))


def test_the_cells_are_deterministic():
    assert sweep_gpu.cells() == sweep_gpu.cells()
    assert sweep_gpu.random_shapes(4) == sweep_gpu.random_shapes(4)
    assert sweep_gpu.random_shapes(4, seed=1) != sweep_gpu.random_shapes(4)


def _fake_summary():
    cells = []
    for k, (s, opt) in enumerate(sweep_gpu.cells(quick=True)):
        t, f = 1.0 + 0.1 * k, 1.2 + 0.05 * k
        cell = dict(shape=s["name"], opt=opt, describe=sweep_gpu.describe(s))
        if k == 3:
            cell.update(fbgemm=dict(error="RuntimeError: refused"), tbegen=dict(fwd_ms=1, bwd_ms=1, total_ms=2))
        else:
            cell.update(fbgemm=dict(fwd_ms=f / 2, bwd_ms=f, total_ms=1.5 * f), tbegen=dict(fwd_ms=t / 2, bwd_ms=t, total_ms=1.5 * t),
                        bwd_speedup=f / t, fwd_speedup=f / t)
        cells.append(cell)
    env = dict(date_utc="2026-12-04 13:00:00", gpu="fake", torch="x", fbgemm_gpu="y")
    return dict(env=env, copy_tbps=None, args={}, seconds=1.0, cells=cells)


def test_the_report_sorts_worst_first_and_names_what_was_not_timed():
    summary = _fake_summary()
    md = sweep_gpu.markdown(summary)
    timed = [c for c in summary["cells"] if "bwd_speedup" in c]
    worst = min(timed, key=lambda c: c["bwd_speedup"])
    rows = [line for line in md.splitlines() if line.startswith("| ") and "x |" in line]
    assert rows[0].startswith(f"| {worst['shape']} | {worst['opt']} |")
    assert len(rows) == len(timed)
    assert "fbgemm: RuntimeError: refused" in md
    assert f"worst {worst['bwd_speedup']:.2f}x" in md


def test_the_report_gives_each_cells_rounds_range():
    summary = _fake_summary()
    timed = [c for c in summary["cells"] if "bwd_speedup" in c]
    for k, c in enumerate(timed):
        c["bwd_speedup_rounds"] = [c["bwd_speedup"] * x for x in (0.9, 1.0, 1.3 if k == 0 else 1.05)]
    md = sweep_gpu.markdown(summary)
    first = timed[0]
    lo, hi = first["bwd_speedup"] * 0.9, first["bwd_speedup"] * 1.3
    row = next(line for line in md.splitlines() if line.startswith(f"| {first['shape']} | {first['opt']} |"))
    assert f"| {lo:.2f}-{hi:.2f}x |" in row
    under = [c for c in timed if c["bwd_speedup"] < 1.1]
    noisy = sum(max(c["bwd_speedup_rounds"]) >= 1.1 for c in under)
    assert under and f"cells under 1.1x: {len(under)} ({noisy} of them with a round at or above 1.1x)" in md
    del first["bwd_speedup_rounds"]  # (a sweep.json from before the rounds were kept: an empty range)
    row = next(line for line in sweep_gpu.markdown(summary).splitlines()
               if line.startswith(f"| {first['shape']} | {first['opt']} |"))
    assert f"| {first['bwd_speedup']:.2f}x |  | " in row


def test_the_heatmap_matrix_has_a_row_per_shape(tmp_path):
    summary = _fake_summary()
    rows, cols, values = sweep_report.matrix(summary)
    assert len(rows) == len({c["shape"] for c in summary["cells"]})
    assert len(cols) == 2 * len(sweep_gpu.OPTIMIZERS)
    assert sum(v is None for row in values for v in row) == 2  # the refused cell, backward and forward
    (tmp_path / "sweep.json").write_text(json.dumps(summary))
    assert sweep_report.main([str(tmp_path)]) == 0
    assert (tmp_path / "sweep.md").read_text() == sweep_gpu.markdown(summary)


def test_the_cpu_sweep_varies_each_axis_from_the_referee_shape():
    import sweep_cpu

    shapes = sweep_cpu.shapes()
    names = [s["name"] for s in shapes]
    assert names[:2] == ["CPU-1", "CPU-2"] and len(set(names)) == len(names)
    for axis in ("D", "T", "L", "B"):
        values = {s[axis] for s in shapes}
        assert len(values) >= 3, axis
    assert {s["dist"] for s in shapes} == {"uniform", "zipf"}
    fake = dict(date_utc="x", machine="m", threads=2, torch="t", fbgemm="f", load_start="0", load_end="0",
                cells=[dict(shape=s["name"], opt="sgd", T=s["T"], E=s["E"], D=s["D"], B=s["B"], L=s["L"], dist=s["dist"],
                            fbgemm=dict(total=2.0, fwd=1.0, bwd=1.0), tbegen=dict(total=1.0 + k / 10, fwd=0.5, bwd=0.5),
                            speedup=2.0 / (1.0 + k / 10)) for k, s in enumerate(shapes)])
    md = sweep_cpu.markdown(fake)
    rows = [line for line in md.splitlines() if line.startswith("| ") and line.endswith("x |")]
    assert rows[0].startswith(f"| {shapes[-1]['name']} |")  # the worst cell first
