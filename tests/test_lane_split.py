"""One spec, one meaning (issue 14): every shipped spec gives the same result on the CPU whether a
row is updated in one loop (the CPU kernel) or split over 32 lanes as the CUDA kernel splits it
(the lane-split mode, `backward_lane_split`), and the issue's spec, were the snippet checker
bypassed, fails in lane-split mode although it passes against its reference on the CPU."""

from pathlib import Path

import pytest
import torch

from tbegen import build, harness
from tbegen.spec import list_specs, load_spec, load_spec_text

from conftest import SPECS

ROOT = Path(__file__).resolve().parent.parent

# Mixed widths (lanes with no elements, partial 4-wide slices), a hot row, the widest rows
# (8 slices per lane) and a 16-bit weight dtype.
LANE_CASES = [
    harness.Case(tables=harness.MIXED_TABLES, pooling="sum", weighted=True, seed=101),
    harness.Case(tables=harness.WIDE_TABLES, B=8, max_L=4, pooling="mean", seed=102),
    harness.Case(tables=harness.MIXED_TABLES, pooling="sum", weights_dtype=torch.float16, steps=2, seed=103),
]


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("case", LANE_CASES, ids=lambda c: c.id)
def test_lane_split_agrees_with_the_cpu_kernel(load_ops, record_result, name, case):
    spec, _ = load_ops(name)
    ops = getattr(torch.ops, f"tbegen_{name}")
    result = harness.run_lane_split_case(spec, ops, case)
    record_result(name, "cpu-lane-split", result)
    assert not result.failures, "\n".join(result.failures)
    assert set(result.errors) == {"weights"} | {s.name for s in spec.states + spec.table_states}


def test_issue_14_spec_fails_in_lane_split_mode_when_the_checker_is_bypassed():
    path = ROOT / "tests" / "specs_bad" / "row_acc_in_element.yaml"
    spec = load_spec_text(path.read_text(), str(path), check_snippets=False)
    # (float32 weights only, the library of `tbegen test --quick`: a third of the full one's compile)
    ops = build.load_ops(spec, with_cuda=False, fp32_weights_only=True)
    case = harness.Case(tables=harness.MIXED_TABLES, pooling="sum", seed=104)
    # the CPU kernel alone is fooled: it matches the spec's reference
    plain = harness.run_case(spec, ops, case)
    assert not plain.failures, plain.failures
    # the GPU's division of the row leaves each lane with its own sum in `acc`
    split = harness.run_lane_split_case(spec, ops, case)
    assert split.failures and "per-row state 'acc'" in split.failures[0], split.failures
    assert "depends on how a row is split over lanes" in split.failures[0]


def test_lane_split_catches_a_row_local_changed_per_element():
    """Weights only: the lanes keep equal per-row states, but each halves its own copy of a
    row-stage local once per element it owns (the CPU halves one copy over the whole row)."""
    path = ROOT / "tests" / "specs_bad" / "row_local_assigned_in_element.yaml"
    spec = load_spec_text(path.read_text(), str(path), check_snippets=False)
    ops = build.load_ops(spec, with_cuda=False, fp32_weights_only=True)  # (float32 cases only)
    split = harness.run_lane_split_case(spec, ops, harness.Case(tables=harness.MIXED_TABLES, seed=105))
    assert any("weights" in f for f in split.failures), split.failures
    assert split.errors["weights"] > 0.1 and split.errors["acc"] < 1e-5


def test_every_shipped_spec_validates_without_warnings():
    for path in list_specs():
        warnings = []
        load_spec(str(path), warnings)
        assert warnings == [], [str(w) for w in warnings]
