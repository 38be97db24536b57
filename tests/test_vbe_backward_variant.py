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


def _train(optimizer, case, switch, monkeypatch, steps=2, seed=11):
    """Trains a fresh module on `steps` VBE batches with the switch at `switch`; returns the
    outputs, per-sample-weight gradients, weights and states."""
    tables, ftm, bsfr, max_L, weighted, pooling, wdt = case
    monkeypatch.setenv(SWITCH, switch)
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


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_variant_trains_like_the_padded_fixed_batch(optimizer, monkeypatch):
    """With the switch on, VBE training is still bitwise the padded fixed batch's (as test_vbe
    checks for the default), and the fixed batch itself is what it is with the switch off."""
    bsfr = [[5, 0, 3, 7], [4, 1, 0, 2], [0, 0, 1, 9]]
    tables, ftm = [(50, 16), (30, 6)], [0, 1, 0]
    monkeypatch.setenv(SWITCH, "1")
    a, b, *_ = run_vbe_and_padded(optimizer, "cuda", "sum", True, bsfr, tables, ftm, steps=3)
    assert_same_training(a, b)
    monkeypatch.setenv(SWITCH, "0")
    a0, b0, *_ = run_vbe_and_padded(optimizer, "cuda", "sum", True, bsfr, tables, ftm, steps=3)
    assert_same_training(a0, a)
    assert_same_training(b0, b)  # the fixed batch: untouched by the switch


def test_bad_switch_value_is_refused(monkeypatch):
    case = CASES["mixed-sum-hot"]
    with pytest.raises(RuntimeError, match="TBEGEN_VBE_GRAD_OFFSETS must be 0 or 1"):
        _train("sgd", case, "yes", monkeypatch, steps=1)
