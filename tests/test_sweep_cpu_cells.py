"""benchmarks/sweep_cpu.py's cells beyond fp32 sum pooling: fp16 weights, per-sample weights, mean
pooling (their shapes, their batches, and the markdown's line per kind of cell)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import sweep_cpu  # noqa: E402


def test_fp16_weighted_and_mean_cells_reuse_their_fp32_shapes_batches():
    shapes = sweep_cpu.shapes()
    fp16 = [s for s in shapes if s["dtype"] == "fp16"]
    assert [s["name"] for s in fp16] == [f"{n} fp16" for n in sweep_cpu.FP16_SHAPES]
    assert {s["mode"] for s in shapes} == {"sum", "weighted", "mean"}
    assert sum(s["dtype"] == "fp32" and s["mode"] == "sum" for s in shapes) == 16  # sweep C's shapes
    for s in shapes:
        plain = [b for b in shapes if b["dtype"] == "fp32" and b["mode"] == "sum"
                 and all(b[k] == s[k] for k in ("T", "E", "D", "B", "L", "dist"))]
        assert plain, s["name"]
        # the same batches as the fp32 sum-pooled shape of the same dimensions
        assert sweep_cpu.batch_seed(s) == sum(map(ord, plain[0]["name"])), s["name"]
    quick = sweep_cpu.shapes(quick=True)
    assert {s["dtype"] for s in quick} == {"fp32", "fp16"} and any(s["mode"] == "weighted" for s in quick)


def test_weighted_batches_and_step_pass_per_sample_weights():
    indices = torch.arange(12)
    batches = [(indices, torch.arange(0, 13, 3), None, torch.ones(4, 2))]
    (batch,) = sweep_cpu.with_weights(batches, seed=3)
    psw = batch[4]
    assert psw.shape == indices.shape and bool(((psw >= 0.5) & (psw < 1.5)).all())
    assert torch.equal(psw, sweep_cpu.with_weights(batches, seed=3)[0][4])  # deterministic

    seen = {}

    class Emb(torch.nn.Module):
        def forward(self, idx, off, per_sample_weights=None):
            seen["psw"] = per_sample_weights
            return torch.zeros(4, 2, requires_grad=True) * 1.0

    r = sweep_cpu.weighted_step(Emb(), batch)
    assert seen["psw"] is psw and set(r) == {"fwd", "bwd", "total"}


def test_markdown_has_a_line_per_kind_of_cell():
    cells = []
    for k, s in enumerate(sweep_cpu.shapes()):
        cells.append(dict(shape=s["name"], opt="sgd", **{key: s[key] for key in ("T", "E", "D", "B", "L", "dist", "dtype", "mode")},
                          fbgemm=dict(total=2.0, fwd=1.0, bwd=1.0), tbegen=dict(total=1.0, fwd=0.5, bwd=0.5),
                          speedup=2.0 if s["dtype"] == "fp32" else 3.0))
    md = sweep_cpu.markdown(dict(date_utc="x", machine="m", threads=1, torch="t", fbgemm="f", load_start="0",
                                 load_end="0", cells=cells))
    assert "- fp16 weights: 5 cells, geometric mean 3.00x" in md
    assert "- fp32, sum pooling: 16 cells, geometric mean 2.00x" in md
    assert "- fp32, weighted (per-sample weights): 1 cells" in md and "- fp32, mean pooling: 1 cells" in md
