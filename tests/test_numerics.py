"""Every optimizer's generated CPU kernels against its spec's float64 reference, over the standard
grid of cases (tbegen.harness.standard_cases): pooling sum/mean/none x weighted x fp32/fp16/bf16
weights x int32/int64 indices on mixed dims, with duplicates, empty bags and a hot row, several
steps each; plus wide rows, shared tables and hyperparameter variants."""

import dataclasses

import pytest
import torch

from tbegen import harness
from tbegen.spec import load_spec

from conftest import SPECS

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CASES = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in sorted(SPECS)
    for case in harness.standard_cases(load_spec(str(SPECS[name])), dtypes=DTYPES)
]


@pytest.mark.parametrize("name,case", CASES)
def test_cpu_matches_reference(load_ops, record_result, name, case):
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, case, device="cpu")
    record_result(name, "cpu", result)
    assert not result.failures, "\n".join(result.failures)


def test_stochastic_rounding_cpu_is_deterministic_and_close(load_ops):
    spec, ops = load_ops("sgd")
    case = harness.Case(weights_dtype=torch.bfloat16, stochastic_rounding=True, seed=7)
    first = harness.run_case(spec, ops, case)
    second = harness.run_case(spec, ops, case)
    assert not first.failures, first.failures
    assert first.errors == second.errors


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_cpu_is_unbiased_and_varies_by_element_and_step(load_ops, dtype):
    """The random bits (common.h, random_bits: shared by the CPU and CUDA kernels) drive an
    unbiased rounding: sgd moves each weight by far less than its ulp, so rounding to nearest
    would leave it in place; the mean over many steps (each drawing new bits) converges to the
    exact float32 result, every element's bits independent of its neighbours'. (The CUDA twin is
    tests/test_cuda.py::test_stochastic_rounding_is_unbiased_and_varies_by_step.)"""
    from tbegen.layout import make_layout

    spec, ops = load_ops("sgd")
    E, D = 32, 64
    layout = make_layout([(E, D)])
    feats = layout.features_tensor("cpu")
    gen = torch.Generator().manual_seed(5)
    w0 = (torch.rand(E * D, generator=gen) + 0.5).to(dtype)  # in [0.5, 1.5)
    indices = torch.arange(E, dtype=torch.int64)
    offsets = torch.arange(E + 1, dtype=torch.int64)  # E bags of one row
    go = torch.randn(E, D, generator=gen)
    lr = 1e-4
    exact = w0.float().view(E, D) - lr * go
    reps = 1000
    total = torch.zeros(E, D, dtype=torch.float64)
    up = torch.zeros(E, D)
    for step in range(1, reps + 1):
        w = w0.clone()
        ops.backward(go, w, feats, D, D, E, indices, offsets, None, 0, 32, True, 1234, lr, step)
        total += w.view(E, D).double()
        up += (w.view(E, D).float() != w0.view(E, D).float()).float()
    mean = total / reps
    ulp = (exact.abs() * (2.0**-10 if dtype == torch.float16 else 2.0**-7)).double()
    # standard error of a two-point distribution one ulp wide is <= ulp / (2 sqrt(reps))
    z = ((mean - exact.double()).abs() / (ulp / (2 * reps**0.5))).max().item()
    assert z < 6.0, f"mean of stochastically rounded results is off by {z:.1f} standard errors"
    # nearly every element moved in some steps and stayed in others (its bits vary by step)
    moved = up / reps
    assert bool(((moved > 0) & (moved < 1)).float().mean() > 0.9)


def test_harness_catches_a_wrong_kernel(load_ops):
    """The comparison can fail: a reference that disagrees with the kernel by 1% is caught."""
    spec, ops = load_ops("adagrad")
    wrong = dataclasses.replace(
        spec,
        reference=dataclasses.replace(
            spec.reference, code=spec.reference.code.replace("learning_rate *", "0.99 * learning_rate *")
        ),
    )
    assert wrong.reference.code != spec.reference.code
    result = harness.run_case(wrong, ops, harness.Case(seed=3))
    assert any("weights" in f for f in result.failures)


def test_harness_catches_a_wrong_state(load_ops):
    spec, ops = load_ops("adam")
    wrong = dataclasses.replace(
        spec,
        reference=dataclasses.replace(spec.reference, code=spec.reference.code.replace("(1 - beta2) * g * g", "(1 - beta2) * g * g * 1.001")),
    )
    assert wrong.reference.code != spec.reference.code
    result = harness.run_case(wrong, ops, harness.Case(seed=4))
    assert any("exp_avg_sq" in f for f in result.failures)
