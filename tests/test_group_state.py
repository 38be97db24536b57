"""The lane-group backward's cached-rows variant (TBEGEN_GROUP_ROWS_CACHED; issue 29).

Rows of at most 128 columns in a batch with a table of at most 64 columns are updated by
backward_group_kernel (templates/include/tbegen/cuda_kernels.cuh), which reads and writes each
row's weights and states with the streaming (evict-first) cache policy. With the switch at 1 the
launch takes its kStreamRows = false instantiation for float weights: the same code with plain
loads and stores (the local sm_90 SASS differs in those four instructions only), so every weight,
state and output must be bitwise the default's, for narrow rows of 4, 8, 20, 32 and 64 columns
beside full-warp rows, hot rows (in the segment kernels, or with a large
max_segment_length_per_warp in the group kernel itself), per-sample weights and mean pooling,
and for optimizers with per-element states (adagrad, adam), per-row and int per-row states
(rowwise_adagrad_with_counter) and none (sgd). Float16/bfloat16 element states are not the group
kernel's (BackwardKernels::vector_states_fit sends them to the any-width kernels), so no case
here has them. Why the variant exists, and the A/B to run: benchmarks/NOTES-gpu.md, "Narrow rows
with an element state". CUDA only (`pytest -m cuda`; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from conftest import SPECS
from tbegen import harness
from tbegen.layout import make_layout

from test_any_width import _train, bits_equal as _bits_equal

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_GROUP_ROWS_CACHED"
# (those TBEGEN_TEST_OPTIMIZERS leaves in)
OPTIMIZERS = [n for n in ("adagrad", "adam", "rowwise_adagrad_with_counter", "sgd") if n in SPECS]

# Row 0 of the first table is hot (`hot` extra occurrences a step).
CASES = {
    # 4, 8 and 20 columns: 1, 2 and 8 lanes a row (32, 16 and 4 rows a round); per-sample weights
    "fp32-D4-8-20-weighted-hot": harness.Case(tables=((300, 4), (200, 8), (250, 20)), B=64, max_L=8, weighted=True,
                                              hot=300, steps=2, seed=1101),
    # 20, 32 and 64 columns (8, 8 and 16 lanes), mean pooling
    "fp32-D20-32-64-mean-hot": harness.Case(tables=((400, 20), (300, 32), (200, 64)), B=64, max_L=8, pooling="mean",
                                            hot=200, steps=2, seed=1102),
    # narrow rows beside 128-wide ones (one row a round over the whole warp), the hot row's run in
    # the group kernel itself (no segments): its occurrences summed `lanes` at a time
    "fp32-D20-128-weighted-hot-one-warp": harness.Case(tables=((250, 20), (150, 128)), B=48, max_L=10, weighted=True,
                                                       hot=400, max_segment_length_per_warp=100000, steps=2,
                                                       seed=1103),
}


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cached_rows_variant_gives_the_default_bits(load_ops, monkeypatch, name, case_id):
    spec, ops = load_ops(name)
    case = CASES[case_id]
    monkeypatch.setenv(SWITCH, "0")
    out_d, w_d, st_d = _train(ops, spec, case, "cuda")
    monkeypatch.setenv(SWITCH, "1")
    out_v, w_v, st_v = _train(ops, spec, case, "cuda")
    out_v2, w_v2, st_v2 = _train(ops, spec, case, "cuda")
    # the steps changed the weights and the states (else equality would prove nothing)
    gen = torch.Generator().manual_seed(case.seed)
    w0, st0 = harness.initial_state(spec, make_layout(case.tables, case.feature_table_map), case, gen)
    assert not torch.equal(w_d, w0), "the two steps left the weights as they were"
    assert not st_d or any(not torch.equal(st_d[k], st0[k].to(st_d[k].dtype)) for k in st_d), \
        "the two steps left every state as it was"
    assert _bits_equal(w_v, w_d), f"weights differ from the default path: max |diff| {(w_v.double() - w_d.double()).abs().max():.3g}"
    for k in st_d:
        assert _bits_equal(st_v[k], st_d[k]), f"state {k} differs from the default path"
    for a, b in zip(out_v, out_d):
        assert _bits_equal(a, b), "forward output differs (the second step's uses the updated weights)"
    assert _bits_equal(w_v2, w_v) and all(_bits_equal(st_v2[k], st_v[k]) for k in st_v), "variant not deterministic"
    monkeypatch.delenv(SWITCH)  # unset: the cached rows for optimizers with state, else evict-first (the same bits)
    out_a, w_a, st_a = _train(ops, spec, case, "cuda")
    assert _bits_equal(w_a, w_d) and all(_bits_equal(st_a[k], st_d[k]) for k in st_d), "unset differs from =0"


@pytest.mark.parametrize("name", [n for n in ("adagrad", "adam") if n in SPECS])
def test_cached_rows_variant_matches_reference(load_ops, monkeypatch, name):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, "1")
    result = harness.run_case(spec, ops, CASES["fp32-D20-32-64-mean-hot"], device="cuda")
    assert not result.failures, "\n".join(result.failures)


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_cached_rows_switch_refuses_other_values(load_ops, monkeypatch, value):
    if "sgd" not in SPECS:
        pytest.skip("sgd is not among TBEGEN_TEST_OPTIMIZERS")
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D20-32-64-mean-hot"], "cuda")
