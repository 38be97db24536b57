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
