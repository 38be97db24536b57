"""CPU and CUDA kernels on the same inputs, for every shipped spec and weight dtype (issue 14),
with the differences recorded ($TBEGEN_RESULTS_DIR, device "cpu-vs-cuda": per spec, per dtype,
per compared tensor, relative as in the harness). The CPU runs both ways: its own loop and the
lane-split mode that reproduces the GPU's division of a row; the GPU must agree with both.

It also runs issue 14's spec with the snippet checker bypassed: the GPU disagrees with the CPU
kernel (the bug the checker now prevents), and the lane-split mode refuses it."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tbegen import build, harness
from tbegen.layout import make_layout
from tbegen.spec import load_spec_text

from conftest import SPECS

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parent.parent
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CASES = [
    harness.Case(tables=harness.MIXED_TABLES, pooling="sum", weighted=True, hot=200, seed=301),
    harness.Case(tables=harness.WIDE_TABLES, B=8, max_L=4, pooling="mean", seed=302),
    # odd widths and offsets: the any-width kernels, against the lane-split mode's column split
    harness.Case(tables=((30, 1), (20, 3), (10, 5), (7, 7), (9, 33), (4, 1031)), B=8, max_L=4, pooling="sum",
                 weighted=True, hot=200, seed=303),
]


def _step(spec, ops, op, case, device, weights, states, batch, grad_output):
    """One fused backward step through `op` from copies of the inputs; returns the results on the CPU."""
    layout = make_layout(case.tables, case.feature_table_map)
    hyper = harness.default_hyperparameters(spec, dict(case.hyper))
    w = weights.clone().to(device)
    st = {k: v.clone().to(device) for k, v in states.items()}
    psw = batch.per_sample_weights.to(device) if batch.per_sample_weights is not None else None
    harness.call_backward(spec, ops, op, case, layout, layout.features_tensor(device), hyper,
                          grad_output.to(device), w, st, batch.indices.to(device), batch.offsets.to(device), psw, 1)
    return w.cpu(), {k: v.cpu() for k, v in st.items()}


def _inputs(spec, case):
    gen = torch.Generator().manual_seed(case.seed)
    layout = make_layout(case.tables, case.feature_table_map)
    weights, states = harness.initial_state(spec, layout, case, gen)
    batch = harness.random_batch(case, layout, gen)
    rows = case.B if case.pooling != "none" else batch.indices.numel()
    cols = layout.total_D if case.pooling != "none" else layout.max_D
    return weights, states, batch, torch.randn(rows, cols, generator=gen)


def _differences(spec, ops, case, weights, states, batch, go, first, second):
    """{tensor name: relative difference} between two of cpu / cpu_lane_split / cuda."""
    runs = {}
    for which in (first, second):
        device = "cuda" if which == "cuda" else "cpu"
        op = "backward_lane_split" if which == "cpu_lane_split" else "backward"
        runs[which] = _step(spec, ops, op, case, device, weights, states, batch, go)
    (wa, sa), (wb, sb) = runs[first], runs[second]
    before_w = weights if case.weights_dtype == torch.float32 else None
    diffs = {"weights": harness._err(wb, wa.double(), before_w)}
    for k in sa:
        diffs[k] = harness._err(sb[k], sa[k].double(), states[k])
    return diffs


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cpu_and_cuda_kernels_agree_and_are_recorded(load_ops, record_result, name, dtype, case):
    spec, ops = load_ops(name)
    case = dataclasses.replace(case, weights_dtype=dtype)
    inputs = _inputs(spec, case)
    for first in ("cpu", "cpu_lane_split"):
        result = harness.Result(case)
        for what, err in _differences(spec, ops, case, *inputs, first, "cuda").items():
            result.note(what, err, harness.TOLERANCE[dtype if what == "weights" else torch.float32], 1)
        record_result(name, f"{first}-vs-cuda", result)
        assert not result.failures, f"{first} vs cuda: " + "; ".join(result.failures)


def test_issue_14_spec_disagrees_on_the_gpu_and_lane_split_refuses_it(record_result):
    path = ROOT / "tests" / "specs_bad" / "row_acc_in_element.yaml"
    spec = load_spec_text(path.read_text(), str(path), check_snippets=False)
    ops = build.load_ops(spec, with_cuda=True)
    case = harness.Case(tables=harness.MIXED_TABLES, pooling="sum", seed=304)
    inputs = _inputs(spec, case)
    plain = _differences(spec, ops, case, *inputs, "cpu", "cuda")
    result = harness.Result(case, errors={f"cpu-vs-cuda {k}": v for k, v in plain.items()})
    # the GPU keeps lane 0's partial sum: far from the CPU's whole-row sum
    assert plain["acc"] > 0.1, plain
    # the lane-split mode refuses the spec (its lanes end with different copies of acc)
    with pytest.raises(RuntimeError, match="per-row state 0"):
        _step(spec, ops, "backward_lane_split", case, "cpu", *inputs)
    record_result(spec.name, "cpu-vs-cuda (checker bypassed)", result)
