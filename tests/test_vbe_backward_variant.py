"""The VBE backward's gathered gradient offsets (TBEGEN_VBE_GRAD_OFFSETS; issue 25).

In a VBE batch the backward finds each occurrence's output-gradient row through the plan's
bag-to-output table (bag_output_offsets): with the switch at 0 the update kernels read bag_out[bag]
per occurrence, between loading the occurrence's bag and its row (cuda_kernels.cuh, grad_row). With
the switch at 1 (the default since landing11), prepare_backward gathers every occurrence's offset once after the sort
(gather_grad_offsets_kernel) and the kernels fetch it with the bag, reading the batch as pooling
none with row stride 1 (BackwardArgs::pooling; the kernels' code is unchanged). The
same rows are summed in the same order, so every output, weight, state and per-sample-weight
gradient must be bitwise those of =0: short runs (warp kernel, and the lane-group kernel for
narrow tables), hot rows cut into segments (segment + finish kernels), per-sample weights, mean
pooling, unweighted sum (the case whose sorted values are the bags themselves), the any-width
kernels at D=1024 (and an odd width), and fixed batches (which the switch must not touch).
CUDA only (`pytest -m cuda`; skipped without a GPU): the CPU backward has no such variant.
"""

from __future__ import annotations

import pytest
import torch

from test_any_width import bits_equal as _bits_equal
from test_vbe import make, run_vbe_and_padded, assert_same_training, vbe_batch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_VBE_GRAD_OFFSETS"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adam"]

# name: (tables, feature_table_map, batch sizes [feature][rank], max_L, weighted, pooling, weights dtype)
# Table 1 has 3 rows read by ~120 bags of up to 20 lookups: each row ~400 times a step, runs
# longer than max_segment_length_per_warp (32) and than a segment (256 occurrences): several
# segments, summed by the segment kernel and added by the finish kernel. Table 2 is 24 wide: the
# short runs go to the lane-group kernel; table 0's (128 wide) to the warp kernel.
_MIXED = ([(3000, 128), (3, 32), (500, 24)], [0, 1, 2, 0],
          [[30, 0, 17, 40], [40, 30, 0, 50], [9, 1, 0, 33], [0, 12, 5, 0]])
CASES = {
    "mixed-weighted-sum-hot": (*_MIXED, 20, True, "sum", torch.float32),
    "mixed-mean-hot": (*_MIXED, 20, False, "mean", torch.float32),
    # unweighted sum: the sort's values are the bags (no positions, no gather of step 3b)
    "mixed-sum-hot": (*_MIXED, 20, False, "sum", torch.float32),
    # D=1024 (wider than the 4-wide backward: the any-width kernels, 4-wide occurrence sums) with
    # an odd width beside it (1030: the column loop), a hot row in table 1
    "any-width-D1024-weighted": ([(200, 1024), (4, 1030)], [0, 1, 0],
                                 [[7, 0, 12], [20, 25, 9], [3, 8, 0]], 12, True, "sum", torch.float32),
    "any-width-D1024-mean": ([(150, 1024)], [0, 0], [[10, 4, 0, 6], [0, 21, 2, 2]], 16, True, "mean",
                             torch.float32),
    # 16-bit weights (the 4-wide kernels read the weights through a float copy)
    "fp16-weighted-hot": ([(400, 64), (3, 16)], [0, 1], [[13, 20, 0], [40, 60, 22]], 20, True, "sum",
                          torch.float16),
}


def _train(optimizer, case, switch, monkeypatch, steps=2, seed=11, name=SWITCH):
    """Trains a fresh module on `steps` VBE batches with the switch `name` at `switch`; returns the
    outputs, per-sample-weight gradients, weights and states."""
    tables, ftm, bsfr, max_L, weighted, pooling, wdt = case
    monkeypatch.setenv(name, switch)
    emb = make(optimizer, tables, ftm, device="cuda", pooling=pooling, weights_dtype=wdt)
    assert emb._vbe_direct()  # (the gathered fallback would run the fixed-batch backward)
    gen = torch.Generator().manual_seed(seed)
    rows = [tables[t][0] for t in ftm]
    outs, psw_grads = [], []
    for _ in range(steps):
        indices, offsets, psw = vbe_batch(rows, bsfr, gen, weighted, max_L=max_L)
        indices, offsets = indices.cuda(), offsets.cuda()
        if psw is not None:
            psw = psw.cuda().requires_grad_(True)
        out = emb(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
        out.backward(torch.randn(out.shape, generator=gen).to("cuda", out.dtype))
        outs.append(out.detach().clone())
        if psw is not None:
            psw_grads.append(psw.grad.clone())
    torch.cuda.synchronize()
    states = {s.name: getattr(emb.states, s.name).clone() for s in emb.spec.states}
    return outs, psw_grads, emb.weights.detach().clone(), states


def _assert_same(got, want, what):
    outs_g, pg_g, w_g, st_g = got
    outs_w, pg_w, w_w, st_w = want
    assert len(outs_g) == len(outs_w) and len(pg_g) == len(pg_w)
    for x, y in zip(outs_g, outs_w):
        assert _bits_equal(x, y), f"{what}: forward output differs (a later step's uses the updated weights)"
    for x, y in zip(pg_g, pg_w):
        assert _bits_equal(x, y), f"{what}: per-sample-weight gradient differs"
    assert _bits_equal(w_g, w_w), f"{what}: weights differ, max |diff| {(w_g.double() - w_w.double()).abs().max():.3g}"
    for k in st_w:
        assert _bits_equal(st_g[k], st_w[k]), f"{what}: state {k} differs"


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_gathered_offsets_give_the_default_bits(optimizer, case_id, monkeypatch):
    case = CASES[case_id]
    default = _train(optimizer, case, "0", monkeypatch)
    variant = _train(optimizer, case, "1", monkeypatch)
    again = _train(optimizer, case, "1", monkeypatch)
    unset = _train(optimizer, case, "", monkeypatch)  # (empty: the default, =1)
    # the steps moved the weights (else equality would prove nothing)
    fresh = make(optimizer, case[0], case[1], device="cuda", pooling=case[5], weights_dtype=case[6])
    assert not torch.equal(default[2], fresh.weights.detach()), "the steps left the weights as they were"
    _assert_same(variant, default, "TBEGEN_VBE_GRAD_OFFSETS=1 against =0")
    _assert_same(again, variant, "TBEGEN_VBE_GRAD_OFFSETS=1 twice (determinism)")
    _assert_same(unset, variant, "TBEGEN_VBE_GRAD_OFFSETS empty (the default) against =1")


def _assert_switch_trains_like_the_padded_fixed_batch(optimizer, monkeypatch, switch, pooling, weighted):
    """With `switch` on, VBE training is bitwise the padded fixed batch's (as test_vbe checks for the
    default); with it off, both trainings are the same as with it on (the fixed batch untouched)."""
    bsfr = [[5, 0, 3, 7], [4, 1, 0, 2], [0, 0, 1, 9]]
    tables, ftm = [(50, 16), (30, 6)], [0, 1, 0]
    monkeypatch.setenv(switch, "1")
    a, b, *_ = run_vbe_and_padded(optimizer, "cuda", pooling, weighted, bsfr, tables, ftm, steps=3)
    assert_same_training(a, b)
    monkeypatch.setenv(switch, "0")
    a0, b0, *_ = run_vbe_and_padded(optimizer, "cuda", pooling, weighted, bsfr, tables, ftm, steps=3)
    assert_same_training(a0, a)
    assert_same_training(b0, b)  # the fixed batch: untouched by the switch


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_variant_trains_like_the_padded_fixed_batch(optimizer, monkeypatch):
    """With the switch on, VBE training is still bitwise the padded fixed batch's (as test_vbe
    checks for the default), and the fixed batch itself is what it is with the switch off."""
    _assert_switch_trains_like_the_padded_fixed_batch(optimizer, monkeypatch, SWITCH, "sum", True)


def test_bad_switch_value_is_refused(monkeypatch):
    case = CASES["mixed-sum-hot"]
    with pytest.raises(RuntimeError, match="TBEGEN_VBE_GRAD_OFFSETS must be 0 or 1"):
        _train("sgd", case, "yes", monkeypatch, steps=1)


# ---- TBEGEN_VBE_FUSED_GATHER: the offsets written by step 3b's kernel ----------------------------
#
# Where the sort's values are positions (per-sample weights, mean pooling), the switch at 1 has the
# kernel that gathers each occurrence's bag and scale after the sort also write its output-gradient
# offset (gather_occurrences_kernel<true>), and gather_grad_offsets_kernel does not run. The same
# offsets, so the same bits as the switch at 0 (the default) and as TBEGEN_VBE_GRAD_OFFSETS=0 (the
# update kernels reading bag_out themselves); unweighted sum batches (the sort's values are the
# bags) and fixed batches are untouched.

FUSED = "TBEGEN_VBE_FUSED_GATHER"


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_gather_gives_the_default_bits(optimizer, case_id, monkeypatch):
    case = CASES[case_id]
    monkeypatch.delenv(SWITCH, raising=False)  # (the gathered offsets: the default)
    default = _train(optimizer, case, "0", monkeypatch, name=FUSED)
    fused = _train(optimizer, case, "1", monkeypatch, name=FUSED)
    again = _train(optimizer, case, "1", monkeypatch, name=FUSED)
    unset = _train(optimizer, case, "", monkeypatch, name=FUSED)  # (empty: the default, =0)
    monkeypatch.setenv(FUSED, "1")
    kernels_read = _train(optimizer, case, "0", monkeypatch)  # (TBEGEN_VBE_GRAD_OFFSETS=0: nothing gathered)
    fresh = make(optimizer, case[0], case[1], device="cuda", pooling=case[5], weights_dtype=case[6])
    assert not torch.equal(default[2], fresh.weights.detach()), "the steps left the weights as they were"
    _assert_same(fused, default, "TBEGEN_VBE_FUSED_GATHER=1 against =0")
    _assert_same(again, fused, "TBEGEN_VBE_FUSED_GATHER=1 twice (determinism)")
    _assert_same(unset, default, "TBEGEN_VBE_FUSED_GATHER empty (the default) against =0")
    _assert_same(fused, kernels_read, "TBEGEN_VBE_FUSED_GATHER=1 against TBEGEN_VBE_GRAD_OFFSETS=0")


def _backward_kernels(case, fused, monkeypatch):
    """The CUDA kernels' names of one VBE training step with TBEGEN_VBE_FUSED_GATHER at `fused`."""
    from torch.profiler import ProfilerActivity, profile
    tables, ftm, bsfr, max_L, weighted, pooling, wdt = case
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv(FUSED, fused)
    emb = make("sgd", tables, ftm, device="cuda", pooling=pooling, weights_dtype=wdt)
    gen = torch.Generator().manual_seed(5)
    indices, offsets, psw = vbe_batch([tables[t][0] for t in ftm], bsfr, gen, weighted, max_L=max_L)
    psw = psw.cuda() if psw is not None else None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = emb(indices.cuda(), offsets.cuda(), psw, batch_size_per_feature_per_rank=bsfr)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("case_id,engaged", [("mixed-weighted-sum-hot", True), ("mixed-mean-hot", True),
                                             ("mixed-sum-hot", False)])
def test_fused_gather_runs_one_kernel_fewer(case_id, engaged, monkeypatch):
    """The switch takes effect where the values are positions (else the bitwise test above could
    pass with the switch ignored), and leaves unweighted sum batches on step 3c's kernel."""
    case = CASES[case_id]
    off = _backward_kernels(case, "0", monkeypatch)
    on = _backward_kernels(case, "1", monkeypatch)
    assert any("gather_grad_offsets_kernel" in k for k in off), off
    assert not any("gather_occurrences_kernel<true>" in k for k in off), off
    if engaged:
        assert not any("gather_grad_offsets_kernel" in k for k in on), on
        assert any("gather_occurrences_kernel<true>" in k for k in on), on
        assert len(on) == len(off) - 1, (on, off)
    else:
        assert sorted(on) == sorted(off), (on, off)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_fused_gather_trains_like_the_padded_fixed_batch(optimizer, pooling, monkeypatch):
    """With the switch on, weighted VBE training is still bitwise the padded fixed batch's, and the
    fixed batch is what it is with the switch off."""
    monkeypatch.delenv(SWITCH, raising=False)
    _assert_switch_trains_like_the_padded_fixed_batch(optimizer, monkeypatch, FUSED, pooling, True)


def test_fused_gather_bad_value_is_refused(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    with pytest.raises(RuntimeError, match="TBEGEN_VBE_FUSED_GATHER must be 0 or 1"):
        _train("sgd", CASES["mixed-sum-hot"], "on", monkeypatch, steps=1, name=FUSED)


# ---- TBEGEN_VBE_GATHER_IN_SELECT: the offsets written by the run selection's predicate ------------
#
# Where the sort's values are the bags (unweighted sum), the switch at 1 has the run selection's
# predicate (IsRunStartGathering, cuda_backward_prep_impl.cuh) write each sorted occurrence's
# output-gradient offset, and gather_grad_offsets_kernel does not run: one launch fewer per VBE
# step (issue 25). The same offsets, so the same bits as the switch at 0 (the default) and as
# TBEGEN_VBE_GRAD_OFFSETS=0; weighted and mean batches (their sorted bags come after the selection)
# and fixed batches are untouched.

IN_SELECT = "TBEGEN_VBE_GATHER_IN_SELECT"


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_gather_in_select_gives_the_default_bits(optimizer, case_id, monkeypatch):
    case = CASES[case_id]
    monkeypatch.delenv(SWITCH, raising=False)  # (the gathered offsets: the default)
    monkeypatch.delenv(FUSED, raising=False)
    default = _train(optimizer, case, "0", monkeypatch, name=IN_SELECT)
    in_select = _train(optimizer, case, "1", monkeypatch, name=IN_SELECT)
    again = _train(optimizer, case, "1", monkeypatch, name=IN_SELECT)
    monkeypatch.setenv(IN_SELECT, "1")
    kernels_read = _train(optimizer, case, "0", monkeypatch)  # (TBEGEN_VBE_GRAD_OFFSETS=0: nothing gathered)
    _assert_same(in_select, default, "TBEGEN_VBE_GATHER_IN_SELECT=1 against =0")
    _assert_same(again, in_select, "TBEGEN_VBE_GATHER_IN_SELECT=1 twice (determinism)")
    _assert_same(in_select, kernels_read, "TBEGEN_VBE_GATHER_IN_SELECT=1 against TBEGEN_VBE_GRAD_OFFSETS=0")


@pytest.mark.parametrize("case_id,engaged", [("mixed-sum-hot", True), ("mixed-weighted-sum-hot", False),
                                             ("mixed-mean-hot", False)])
def test_gather_in_select_runs_one_kernel_fewer(case_id, engaged, monkeypatch):
    """The switch takes effect on unweighted sum batches (else the bitwise test above could pass
    with the switch ignored): step 3c's kernel gone, the same kernels otherwise; weighted and mean
    batches keep it."""
    case = CASES[case_id]
    monkeypatch.delenv(IN_SELECT, raising=False)
    off = _backward_kernels(case, "0", monkeypatch)
    monkeypatch.setenv(IN_SELECT, "1")
    on = _backward_kernels(case, "0", monkeypatch)
    assert any("gather_grad_offsets_kernel" in k for k in off), off
    if engaged:
        assert not any("gather_grad_offsets_kernel" in k for k in on), on
        assert len(on) == len(off) - 1, (on, off)
    else:
        assert sorted(on) == sorted(off), (on, off)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_gather_in_select_trains_like_the_padded_fixed_batch(optimizer, monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    _assert_switch_trains_like_the_padded_fixed_batch(optimizer, monkeypatch, IN_SELECT, "sum", False)


def test_gather_in_select_bad_value_is_refused(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    with pytest.raises(RuntimeError, match="TBEGEN_VBE_GATHER_IN_SELECT must be 0 or 1"):
        _train("sgd", CASES["mixed-sum-hot"], "on", monkeypatch, steps=1, name=IN_SELECT)
