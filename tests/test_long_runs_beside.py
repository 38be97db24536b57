"""The long runs' kernels in series (TBEGEN_LONG_RUNS_BESIDE=0; issue 29).

With the switch at 0 the hot rows' segment and finish kernels run on the caller's stream before the
short runs' kernel (templates/include/tbegen/cuda_ops.cuh, long_runs_beside), instead of beside it
on a side stream. They update disjoint rows, so every weight and state must be bitwise the
default's: hot rows (long runs, split into segments) on the 4-wide kernels with several width
classes (a third stream for the narrow class), and on the any-width kernels (1024 columns, fp32
and fp16, mean pooling). Why, and the A/B to run: benchmarks/NOTES-gpu.md, "The long runs in
series". CUDA only (`pytest -m cuda`; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tbegen import harness

from test_cuda import NAMES, _assert_switch_keeps_the_bits, _one_step, _problem

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LONG_RUN_CASES = [
    harness.Case(tables=((300, 8), (100, 256), (50, 128)), B=64, max_L=20, pooling="sum", weighted=True,
                 hot=1500, seed=81),
    harness.Case(tables=((120, 1024), (80, 1024)), B=48, max_L=20, pooling="mean", hot=900, seed=82),
    harness.Case(tables=((90, 1024), (60, 520)), B=48, max_L=16, pooling="sum", weights_dtype=torch.float16,
                 stochastic_rounding=True, hot=700, seed=83),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", LONG_RUN_CASES, ids=lambda c: c.id)
def test_long_runs_in_series_give_the_beside_bits(load_ops, monkeypatch, name, case):
    spec, ops = load_ops(name)
    _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, "TBEGEN_LONG_RUNS_BESIDE", "0")


@pytest.mark.parametrize("value", ["2", "yes", " 0"])
def test_long_runs_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops(NAMES[0])
    case = LONG_RUN_CASES[0]
    weights, states, batch, go = _problem(spec, case)
    monkeypatch.setenv("TBEGEN_LONG_RUNS_BESIDE", value)
    with pytest.raises(RuntimeError, match="TBEGEN_LONG_RUNS_BESIDE must be 0 or 1"):
        _one_step(spec, ops, case, "cuda", weights, states, batch, go)
