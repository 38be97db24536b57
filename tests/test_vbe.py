"""Variable batch size per feature (VBE): TableBatchedEmbeddingBags.forward(...,
batch_size_per_feature_per_rank=...) and the FBGEMM class's forward with FBGEMM's argument.

Checked against a float64 reference written here from FBGEMM's documented semantics (bags
ordered per feature, then per rank, then per sample; the output 1-D and rank-major: for each
rank, for each feature, its B[f][r] x D_f values), against the fixed-batch path on the same
lookups padded to the largest batch (every optimizer: bitwise equal weights and states), and
against FBGEMM CPU's own VBE (fbgemm-gpu-cpu). CUDA tests carry the `cuda` marker.
"""

from __future__ import annotations

import itertools
import types
from typing import List

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tbegen.module import TableBatchedEmbeddingBags, _vbe_key

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.cuda
# optimizers whose extensions the CPU tests load (the change is optimizer-independent: the bags'
# order and the output positions, not the update)
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adam"]


# ---- helpers -------------------------------------------------------------------------------------


def vbe_batch(rows: List[int], bsfr: List[List[int]], gen: torch.Generator, weighted: bool, max_L: int = 4):
    """Random bags in VBE order (feature, rank, sample); some empty, duplicates likely."""
    lengths = [int(torch.randint(0, max_L + 1, (1,), generator=gen)) for f in range(len(bsfr)) for _ in range(sum(bsfr[f]))]
    feat = [f for f in range(len(bsfr)) for _ in range(sum(bsfr[f]))]
    indices = torch.cat([torch.randint(0, rows[f], (L,), generator=gen) for f, L in zip(feat, lengths)]
                        + [torch.zeros(0, dtype=torch.int64)])
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0) if lengths else offsets[1:]
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return indices, offsets, psw


def bag_list(bsfr):
    """(feature, rank, sample) of each bag in VBE input order."""
    return [(f, r, j) for f in range(len(bsfr)) for r in range(len(bsfr[f])) for j in range(bsfr[f][r])]


def reference_forward(tables_w, ftm, bsfr, indices, offsets, psw, pooling):
    """float64 output (1-D, rank-major) and, per bag in input order, its position in that output."""
    pooled = {}
    for k, (f, r, j) in enumerate(bag_list(bsfr)):
        lo, hi = int(offsets[k]), int(offsets[k + 1])
        rows = tables_w[ftm[f]].double()[indices[lo:hi]]
        if psw is not None:
            rows = rows * psw[lo:hi].double()[:, None]
        v = rows.sum(0)
        if pooling == "mean" and hi > lo:
            v = v / (hi - lo)
        pooled[(f, r, j)] = v
    R = len(bsfr[0])
    order = [(f, r, j) for r in range(R) for f in range(len(bsfr)) for j in range(bsfr[f][r])]
    pos, at = {}, 0
    for key in order:
        pos[key] = at
        at += pooled[key].numel()
    out = torch.cat([pooled[k] for k in order]) if order else torch.zeros(0, dtype=torch.float64)
    return out, pos


def reference_row_grads(tables_w, ftm, bsfr, indices, offsets, psw, pooling, grad, pos):
    """float64 gradient of each table (dense) for the 1-D output gradient `grad`."""
    grads = [torch.zeros_like(w, dtype=torch.float64) for w in tables_w]
    for k, (f, r, j) in enumerate(bag_list(bsfr)):
        lo, hi = int(offsets[k]), int(offsets[k + 1])
        D = tables_w[ftm[f]].shape[1]
        g = grad.double()[pos[(f, r, j)]: pos[(f, r, j)] + D]
        for i in range(lo, hi):
            s = 1.0 if psw is None else float(psw[i])
            if pooling == "mean":
                s /= hi - lo
            grads[ftm[f]][int(indices[i])] += s * g
    return grads


def padded(bsfr, offsets):
    """The same lookups as a fixed batch: each feature padded with empty bags to the largest
    batch (feature-major offsets), and, per VBE bag (f, r, j), its row in that batch."""
    F = len(bsfr)
    B = max(sum(b) for b in bsfr)
    out, k = [0], 0
    row = {}
    for f in range(F):
        n = 0
        for r in range(len(bsfr[f])):
            for j in range(bsfr[f][r]):
                out.append(int(offsets[k + 1]))
                row[(f, r, j)] = n
                k += 1
                n += 1
        out.extend([out[-1]] * (B - n))
    return torch.tensor(out, dtype=offsets.dtype), B, row


def make(optimizer, tables, ftm=None, device="cpu", pooling="sum", **kw):
    h = dict(learning_rate=0.3) if optimizer != "none" else {}
    h.update(kw)
    return TableBatchedEmbeddingBags(tables, optimizer=optimizer, pooling=pooling, feature_table_map=ftm,
                                     device=device, seed=5, **h)


shapes = st.integers(1, 3).flatmap(lambda F: st.integers(1, 3).flatmap(lambda R: st.tuples(
    st.lists(st.lists(st.integers(0, 4), min_size=R, max_size=R), min_size=F, max_size=F),
    st.lists(st.sampled_from([1, 3, 4, 8]), min_size=F, max_size=F),
    st.booleans(),  # weighted
    st.sampled_from(["sum", "mean"]),
    st.booleans(),  # two features share table 0
    st.integers(0, 2**31 - 1),
)))


# ---- against the float64 reference --------------------------------------------------------------


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(shapes)
def test_vbe_matches_float64_reference(case):
    bsfr, dims, weighted, pooling, share, seed = case
    F = len(bsfr)
    gen = torch.Generator().manual_seed(seed)
    ftm = list(range(F))
    if share and F > 1:
        ftm[-1] = 0
        dims[-1] = dims[0]
    n_tables = max(ftm) + 1
    tables = [(int(torch.randint(3, 12, (1,), generator=gen)), dims[t]) for t in range(n_tables)]
    emb = make("sgd", tables, ftm, pooling=pooling)
    w0 = [w.detach().clone() for w in emb.split_embedding_weights()]
    rows = [tables[ftm[f]][0] for f in range(F)]
    indices, offsets, psw = vbe_batch(rows, bsfr, gen, weighted)
    out = emb(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
    ref, pos = reference_forward(w0, ftm, bsfr, indices, offsets, psw, pooling)
    assert out.dim() == 1 and out.numel() == sum(bsfr[f][r] * dims[f] for f in range(F) for r in range(len(bsfr[0])))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    assert emb.step == 1
    grads = reference_row_grads(w0, ftm, bsfr, indices, offsets, psw, pooling, grad, pos)
    for t, w in enumerate(emb.split_embedding_weights()):
        torch.testing.assert_close(w.double(), w0[t].double() - 0.3 * grads[t], rtol=1e-5, atol=1e-6)


def test_rowwise_adagrad_step_matches_float64_reference():
    bsfr = [[3, 0, 2], [1, 4, 2], [0, 0, 5]]
    tables = [(9, 4), (6, 8), (7, 3)]
    gen = torch.Generator().manual_seed(7)
    emb = make("rowwise_adagrad", tables, pooling="mean", eps=1e-6)
    w = [x.detach().double().clone() for x in emb.split_embedding_weights()]
    mom = [torch.zeros(E, dtype=torch.float64) for E, _ in tables]
    for step in range(3):
        indices, offsets, psw = vbe_batch([E for E, _ in tables], bsfr, gen, weighted=True)
        out = emb(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
        ref, pos = reference_forward(w, [0, 1, 2], bsfr, indices, offsets, psw, "mean")
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        grads = reference_row_grads(w, [0, 1, 2], bsfr, indices, offsets, psw, "mean", grad, pos)
        for t in range(3):
            touched = torch.unique(indices[int(offsets[sum(map(sum, bsfr[:t]))]): int(offsets[sum(map(sum, bsfr[:t + 1]))])])
            g = grads[t][touched]
            mom[t][touched] += (g * g).mean(1)
            w[t][touched] -= (0.3 / (mom[t][touched].sqrt() + 1e-6))[:, None] * g
            torch.testing.assert_close(emb.split_embedding_weights()[t].double(), w[t], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(emb.split_optimizer_states()[t]["momentum"].double(), mom[t], rtol=1e-5,
                                       atol=1e-9)


# ---- against the fixed-batch path (every optimizer here, bitwise) --------------------------------


def run_vbe_and_padded(optimizer, device, pooling, weighted, bsfr, tables, ftm, seed=3, steps=2, dtype=torch.int64):
    """Trains a VBE module and a fixed-batch module (same seed) on the same lookups; returns both
    and the outputs of the last step."""
    gen = torch.Generator().manual_seed(seed)
    a = make(optimizer, tables, ftm, device=device, pooling=pooling)
    b = make(optimizer, tables, ftm, device=device, pooling=pooling)
    rows = [tables[t][0] for t in ftm]
    for _ in range(steps):
        indices, offsets, psw = vbe_batch(rows, bsfr, gen, weighted)
        poff, B, row = padded(bsfr, offsets)
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        out_a = a(mv(indices).to(dtype), mv(offsets).to(dtype), mv(psw), batch_size_per_feature_per_rank=bsfr)
        out_b = b(mv(indices).to(dtype), mv(poff).to(dtype), mv(psw))
        grad = torch.randn(out_a.shape, generator=gen).to(device)
        # the same gradient, placed where the fixed batch has each bag
        grad_b = torch.zeros(out_b.shape, device=device)
        cols = a.layout.feature_out_offsets()
        _, pos = reference_forward([w.detach().cpu() for w in a.split_embedding_weights()], ftm, bsfr, indices,
                                   offsets, None, "sum")
        for (f, r, j), p in pos.items():
            D = tables[ftm[f]][1]
            grad_b[row[(f, r, j)], cols[f]:cols[f] + D] = grad[p:p + D]
        out_a.backward(grad)
        out_b.backward(grad_b)
    return a, b, out_a, out_b, pos, row


def assert_same_training(a, b):
    assert a.step == b.step
    assert torch.equal(a.weights.detach(), b.weights.detach())
    for s in a.spec.states:
        assert torch.equal(getattr(a.states, s.name), getattr(b.states, s.name)), s.name


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_vbe_trains_like_the_padded_fixed_batch(optimizer, pooling, weighted):
    bsfr = [[2, 0, 3], [4, 1, 0], [0, 0, 1]]
    tables, ftm = [(11, 4), (7, 5)], [0, 1, 0]
    a, b, out_a, out_b, pos, row = run_vbe_and_padded(optimizer, "cpu", pooling, weighted, bsfr, tables, ftm)
    cols = a.layout.feature_out_offsets()
    for (f, r, j), p in pos.items():
        D = tables[ftm[f]][1]
        assert torch.equal(out_a[p:p + D], out_b[row[(f, r, j)], cols[f]:cols[f] + D])
    assert_same_training(a, b)


def test_vbe_int32_and_output_dtype_and_pooling_none():
    bsfr = [[1, 2], [3, 0]]
    tables = [(10, 4), (8, 4)]
    a, b, out_a, _, _, _ = run_vbe_and_padded("sgd", "cpu", "sum", True, bsfr, tables, [0, 1], dtype=torch.int32)
    assert_same_training(a, b)
    # fp16 output: the float32 sums rounded
    h = make("sgd", tables, output_dtype=torch.float16)
    gen = torch.Generator().manual_seed(1)
    ind, off, _ = vbe_batch([10, 8], bsfr, gen, False)
    out16 = h(ind, off, batch_size_per_feature_per_rank=bsfr)
    f = make("sgd", tables)
    assert out16.dtype == torch.float16
    assert torch.equal(out16, f(ind, off, batch_size_per_feature_per_rank=bsfr).half())
    # pooling none: one row per index, whatever the batch sizes
    n = make("sgd", tables, pooling="none")
    assert torch.equal(n(ind, off, batch_size_per_feature_per_rank=bsfr),
                       n(ind, padded(bsfr, off)[0]))


def test_vbe_all_batches_empty_and_deterministic():
    emb = make("adam", [(5, 4), (6, 2)])
    out = emb(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
              batch_size_per_feature_per_rank=[[0, 0], [0, 0]])
    assert out.shape == (0,)
    bsfr = [[3, 1], [0, 2]]
    runs = [run_vbe_and_padded("adam", "cpu", "mean", True, bsfr, [(9, 4), (6, 2)], [0, 1], seed=11)[0]
            for _ in range(2)]
    assert_same_training(runs[0], runs[1])


@pytest.mark.parametrize(
    "bsfr,offsets,message",
    [
        ([[1, 2]], [0, 1, 2, 3], r"one list of per-rank batch sizes per feature \(2\)"),
        ([[1, 2], [1]], [0, 1, 2, 3, 4, 5], r"same number of ranks: feature 0 has 2, feature 1 has 1"),
        ([[1, -1], [1, 1]], [0, 1, 2, 3], r"batch_size_per_feature_per_rank\[0\]\[1\] must be a non-negative int"),
        ([[1, 2], []], [0, 1, 2, 3], r"batch_size_per_feature_per_rank\[1\] must be a non-empty list"),
        ([[1, 2], [1, 1]], [0, 1, 2, 3, 4], r"\(sum of all batch sizes\) \+ 1 = 6 entries"),
        ([[1, 2.0], [1, 1]], [0, 1, 2, 3, 4, 5], r"\[0\]\[1\] must be a non-negative int, got 2.0"),
    ],
)
def test_vbe_errors_name_the_problem(bsfr, offsets, message):
    emb = make("sgd", [(5, 4), (6, 2)])
    offsets = torch.tensor(offsets)
    with pytest.raises(ValueError, match=message):
        emb(torch.zeros(int(offsets[-1]), dtype=torch.int64), offsets, batch_size_per_feature_per_rank=bsfr)


def test_vbe_malformed_offsets_raise():
    emb = make("sgd", [(5, 4), (6, 2)])
    with pytest.raises(Exception, match="offsets"):  # decreasing: the operators' own check
        emb(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 2, 1, 3]), batch_size_per_feature_per_rank=[[1, 1], [1, 0]])
    with pytest.raises(Exception, match="offsets"):  # the last offset is not the number of indices
        emb(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 2, 2]), batch_size_per_feature_per_rank=[[1, 1], [1, 0]])


# ---- against FBGEMM CPU's own VBE ----------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["EXACT_SGD", "EXACT_ROWWISE_ADAGRAD"])
@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
@pytest.mark.parametrize("weighted", [False, True])
def test_vbe_matches_fbgemm_cpu(optimizer, pooling, weighted):
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from tbegen.fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen as Compat

    if weighted and pooling == "MEAN":
        pytest.skip("FBGEMM CPU's weighted-MEAN backward leaves out 1/L (docs/fbgemm.md)")
    dims = [4, 8, 12]
    specs = [(12, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for d in dims]
    kw = dict(optimizer=getattr(EmbOptimType, optimizer), learning_rate=0.2, pooling_mode=getattr(PoolingMode, pooling))
    if optimizer != "EXACT_SGD":
        kw["eps"] = 1e-4
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(specs, **kw)
    ours = Compat(specs, **kw)
    with torch.no_grad():
        for a, b in zip(ours.split_embedding_weights(), theirs.split_embedding_weights()):
            a.copy_(b)
    gen = torch.Generator().manual_seed(4)
    for bsfr in ([[2, 3], [0, 4], [1, 1]], [[5, 0], [2, 2], [0, 3]]):
        indices, offsets, psw = vbe_batch([12] * 3, bsfr, gen, weighted)
        out_t = theirs(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
        out_o = ours(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
        assert out_o.shape == out_t.shape
        torch.testing.assert_close(out_o, out_t, rtol=1e-5, atol=1e-6)
        grad = torch.randn(out_t.shape, generator=gen)
        out_t.backward(grad)
        out_o.backward(grad)
        for a, b in zip(ours.split_embedding_weights(), theirs.split_embedding_weights()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if optimizer != "EXACT_SGD":
            for a, b in zip(ours.split_optimizer_states(), theirs.split_optimizer_states()):
                torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-7)


# ---- CUDA ----------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_cuda_vbe_trains_like_the_padded_fixed_batch_and_cpu(optimizer, pooling):
    bsfr = [[5, 0, 3, 7], [4, 1, 0, 2], [0, 0, 1, 9]]
    tables, ftm = [(50, 16), (30, 6)], [0, 1, 0]
    a, b, out_a, out_b, pos, row = run_vbe_and_padded(optimizer, "cuda", pooling, True, bsfr, tables, ftm, steps=3)
    assert_same_training(a, b)  # (the same operators on the same bags: the same bits)
    again = run_vbe_and_padded(optimizer, "cuda", pooling, True, bsfr, tables, ftm, steps=3)[0]
    assert_same_training(a, again)  # deterministic
    c = run_vbe_and_padded(optimizer, "cpu", pooling, True, bsfr, tables, ftm, steps=3)[0]
    torch.testing.assert_close(a.weights.detach().cpu(), c.weights.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_a.detach().cpu(), run_vbe_and_padded(
        optimizer, "cpu", pooling, True, bsfr, tables, ftm, steps=3)[2].detach(), rtol=1e-5, atol=1e-6)


@cuda
def test_cuda_vbe_matches_float64_reference():
    bsfr = [[64, 3, 0], [1, 100, 17]]
    tables = [(200, 32), (100, 12)]
    gen = torch.Generator().manual_seed(2)
    emb = make("sgd", tables, device="cuda", pooling="mean")
    w0 = [w.detach().cpu().clone() for w in emb.split_embedding_weights()]
    indices, offsets, psw = vbe_batch([200, 100], bsfr, gen, True, max_L=20)
    out = emb(indices.cuda(), offsets.cuda(), psw.cuda(), batch_size_per_feature_per_rank=bsfr)
    ref, pos = reference_forward(w0, [0, 1], bsfr, indices, offsets, psw, "mean")
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad.cuda())
    grads = reference_row_grads(w0, [0, 1], bsfr, indices, offsets, psw, "mean", grad, pos)
    for t, w in enumerate(emb.split_embedding_weights()):
        torch.testing.assert_close(w.cpu().double(), w0[t].double() - 0.3 * grads[t], rtol=1e-5, atol=1e-6)


# ---- the direct path: the operators write and read the 1-D output (bag_output_offsets) -----------


def gathered(monkeypatch):
    """Forces the gathered fallback (the padded output copied into the 1-D one)."""
    monkeypatch.setattr(TableBatchedEmbeddingBags, "_vbe_direct", lambda self: False)


def train_vbe(emb, bsfr, seed, steps=2, weighted=True, psw_grad=False):
    """Trains `emb` on VBE batches; returns the outputs and the per-sample-weight gradients."""
    gen = torch.Generator().manual_seed(seed)
    rows = [emb.layout.tables[t][0] for t in emb.layout.feature_table_map]
    outs, psw_grads = [], []
    for _ in range(steps):
        indices, offsets, psw = vbe_batch(rows, bsfr, gen, weighted)
        dev = emb.weights.device
        indices, offsets = indices.to(dev), offsets.to(dev)
        if psw is not None:
            psw = psw.to(dev).requires_grad_(psw_grad)
        out = emb(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
        out.backward(torch.randn(out.shape, generator=gen).to(dev, out.dtype))
        outs.append(out.detach().clone())
        psw_grads.append(None if psw is None or not psw_grad else psw.grad.clone())
    return outs, psw_grads


def assert_same_vbe_training(make_emb, bsfr, monkeypatch, **kw):
    """The direct path and the gathered one: the same outputs, gradients, weights and states, bitwise."""
    direct = make_emb()
    assert direct._vbe_direct()
    got = train_vbe(direct, bsfr, seed=9, **kw)
    with monkeypatch.context() as m:
        gathered(m)
        ref_emb = make_emb()
        assert not ref_emb._vbe_direct()
        want = train_vbe(ref_emb, bsfr, seed=9, **kw)
    for x, y in zip(got[0] + got[1], want[0] + want[1]):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)
    assert torch.equal(direct.weights.detach(), ref_emb.weights.detach())
    for s in direct.spec.states:
        assert torch.equal(getattr(direct.states, s.name), getattr(ref_emb.states, s.name)), s.name


def test_vbe_direct_path_has_no_padded_output(monkeypatch):
    # the gathered fallback's pieces are not used on the CPU
    def refuse(*args, **kwargs):
        raise AssertionError("the gathered VBE fallback ran")
    monkeypatch.setattr(TableBatchedEmbeddingBags, "_vbe_gather", refuse)
    bsfr = [[3, 0, 2], [1, 4, 2], [0, 0, 5]]
    emb = make("sgd", [(9, 4), (6, 8), (7, 3)], pooling="mean")
    out, _ = train_vbe(emb, bsfr, seed=1, steps=1)
    assert out[0].shape == (sum(bsfr[f][r] * d for f, d in enumerate([4, 8, 3]) for r in range(3)),)
    assert emb.step == 1


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_vbe_direct_equals_gathered_weighted_with_empty_features_and_ranks(optimizer, pooling, monkeypatch):
    # feature 1 has no bags at all; rank 1 has no bags of any feature; feature 3 shares table 0
    bsfr = [[4, 0, 2], [0, 0, 0], [1, 0, 5], [2, 0, 0]]
    tables, ftm = [(13, 8), (5, 4), (9, 3)], [0, 1, 2, 0]
    assert_same_vbe_training(lambda: make(optimizer, tables, ftm, pooling=pooling), bsfr, monkeypatch,
                             steps=3, psw_grad=True)


@pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16, "int8"])
def test_vbe_direct_equals_gathered_narrow_weights(weights_dtype, monkeypatch):
    bsfr = [[2, 3], [0, 4], [5, 1]]
    tables = [(10, 8), (7, 4), (12, 16)]
    assert_same_vbe_training(lambda: make("rowwise_adagrad", tables, pooling="mean", weights_dtype=weights_dtype),
                             bsfr, monkeypatch, psw_grad=True)


def test_vbe_direct_equals_gathered_dense_gradient_and_output_dtype(monkeypatch):
    bsfr = [[2, 3], [0, 4]]
    tables = [(10, 4), (7, 5)]
    for kw in (dict(optimizer="none"), dict(optimizer="sgd", output_dtype=torch.bfloat16)):
        opt = kw.pop("optimizer")
        def build(opt=opt, kw=kw):
            return make(opt, tables, **kw)
        direct, ref_emb = build(), None
        got = train_vbe(direct, bsfr, seed=4, psw_grad=True)
        with monkeypatch.context() as m:
            gathered(m)
            ref_emb = build()
            want = train_vbe(ref_emb, bsfr, seed=4, psw_grad=True)
        for x, y in zip(got[0] + got[1], want[0] + want[1]):
            assert torch.equal(x, y)
        if opt == "none":
            assert torch.equal(direct.weights.grad, ref_emb.weights.grad)
        else:
            assert torch.equal(direct.weights.detach(), ref_emb.weights.detach())


def test_vbe_subclass_with_five_argument_backward_is_gathered():
    calls = []

    class FiveArgs(TableBatchedEmbeddingBags):
        def _run_backward(self, grad_output, weights, indices, offsets, per_sample_weights) -> None:
            calls.append(tuple(grad_output.shape))
            super()._run_backward(grad_output, weights, indices, offsets, per_sample_weights)

    bsfr = [[1, 2], [3, 0]]
    emb = FiveArgs([(6, 4), (5, 2)], optimizer="sgd", learning_rate=0.1)
    assert not emb._vbe_direct()
    plain = make("sgd", [(6, 4), (5, 2)], learning_rate=0.1)
    emb.load_state_dict(plain.state_dict())
    a, _ = train_vbe(emb, bsfr, seed=2, steps=1)
    b, _ = train_vbe(plain, bsfr, seed=2, steps=1)
    assert torch.equal(a[0], b[0]) and torch.equal(emb.weights.detach(), plain.weights.detach())
    assert calls == [(3, 6)]  # the padded [max_B, total_D] gradient


def op_args(emb, indices, offsets):
    return (emb.weights.detach(), emb.features, emb.layout.total_D, emb.layout.max_D, indices, offsets)


@pytest.mark.parametrize(
    "table,size,message",
    [
        (torch.tensor([0, 4, -1, 8, 11, 14], dtype=torch.int32), 17, "bag_output_offsets must be int64, got Int"),
        (torch.tensor([0, 4, -1, 8, 11], dtype=torch.int64), 17, r"one entry per bag \(F \* B = 2 x 3 = 6\)"),
        (torch.tensor([0, 4, -1, 8, 11, 15], dtype=torch.int64), 17, r"bag_output_offsets\[5\] = 15 puts feature 1's 3 "
         r"values outside the variable-batch output of 17 elements"),
        (torch.tensor([0, -1, -1, 8, 11, 14], dtype=torch.int64), 17, r"marks bag 1 \(feature 0\) as padding \(-1\), "
         r"but it has 1 indices"),
        (torch.tensor([0, 4, -1, 8, 11, 14], dtype=torch.int64), -1, "output_size"),
    ],
)
def test_vbe_operator_checks_the_table(table, size, message):
    emb = make("sgd", [(6, 4), (5, 3)])
    # bags: feature 0: 1, 1, (padding) ; feature 1: 1, 1, 1
    indices = torch.tensor([1, 2, 0, 3, 4])
    offsets = torch.tensor([0, 1, 2, 2, 3, 4, 5])
    with pytest.raises(RuntimeError, match=message):
        emb._ops.forward(*op_args(emb, indices, offsets), None, 0, None, False, table, size)
    if size >= 0:
        grad = torch.zeros(size)
        with pytest.raises(RuntimeError, match=message):
            emb._ops.grad_per_sample_weights(grad, *op_args(emb, indices, offsets), 0, None, False, table)
        w0 = emb.weights.detach().clone()
        with pytest.raises(RuntimeError, match=message):
            emb._run_backward(grad, emb.weights, indices, offsets, None, bag_output_offsets=table)
        assert torch.equal(emb.weights.detach(), w0)  # nothing written


@pytest.mark.parametrize(
    "dims,table,size,message",
    [
        ((4, 3), [0, 3, -1, 8, 11, 14], 17, r"bag_output_offsets\[1\] = 3 overlaps an earlier bag's row"),
        ((4, 3), [0, 4, -1, 8, 11, 14], 18, r"leaves 1 of the variable-batch output's 18 elements unwritten"),
        ((4, 8), [0, 4, -1, 8, 16, 26], 36, r"bag_output_offsets\[5\] = 26 does not start a row \(every offset "
                                             r"of a variable-batch output is a multiple of 4\)"),
    ],
)
def test_vbe_forward_checks_that_the_rows_tile_the_output(dims, table, size, message):
    # (the forward does not zero its output first: the real bags' rows must cover it exactly)
    emb = make("sgd", [(6, dims[0]), (5, dims[1])])
    indices = torch.tensor([1, 2, 0, 3, 4])
    offsets = torch.tensor([0, 1, 2, 2, 3, 4, 5])
    with pytest.raises(RuntimeError, match=message):
        emb._ops.forward(*op_args(emb, indices, offsets), None, 0, None, False, torch.tensor(table), size)
    # the backward only reads the gradient: overlapping rows are no error there
    if "overlaps" in message:
        emb._ops.grad_per_sample_weights(torch.zeros(size), *op_args(emb, indices, offsets), 0, None, False,
                                         torch.tensor(table))


def test_vbe_forward_trusts_only_an_unchanged_plan_table_for_its_own_output():
    # a bag_out table vbe_plan made tiles its output by construction: the forward skips its tiling
    # check for it (vbe.h, VbePlanTables; on CUDA it skips zeroing the output), but not for another
    # output size, other widths, or once the table was changed in place
    emb = make("sgd", [(6, 4), (5, 3)])
    indices = torch.tensor([1, 2, 0, 3, 4])
    offsets = torch.tensor([0, 1, 2, 2, 3, 4, 5])  # (feature 0: 2 bags and a padding bag; feature 1: 3)
    pad, table, (total, max_B, numel) = emb._ops.vbe_plan([1, 1, 2, 1], 2, [4, 3], emb.weights.detach())
    assert (max_B, numel) == (3, 17) and table.tolist() == [0, 10, -1, 4, 7, 14]  # (rank-major)
    out = emb._ops.forward(*op_args(emb, indices, offsets), None, 0, None, False, table, numel)
    assert torch.equal(out, emb._ops.forward(*op_args(emb, indices, offsets), None, 0, None, False, table.clone(),
                                             numel))
    with pytest.raises(RuntimeError, match=r"leaves 3 of the variable-batch output's 20 elements unwritten"):
        emb._ops.forward(*op_args(emb, indices, offsets), None, 0, None, False, table, numel + 3)
    other = make("sgd", [(6, 4), (5, 2)])  # (feature 1 two wide: its rows 4..5, 7..8, 14..15)
    with pytest.raises(RuntimeError, match=r"output's 17 elements are not rows of the features' widths"):
        other._ops.forward(*op_args(other, indices, offsets), None, 0, None, False, table, numel)
    table[4] = 4  # (in place: its version moves on) feature 1's second row over its first
    with pytest.raises(RuntimeError, match=r"bag_output_offsets\[4\] = 4 overlaps an earlier bag's row"):
        emb._ops.forward(*op_args(emb, indices, offsets), None, 0, None, False, table, numel)


@cuda
@pytest.mark.parametrize("dims", [(4, 8), (4, 3)])  # (the 4-wide kernels; the any-width ones)
def test_cuda_vbe_forward_writes_every_element_of_a_plan_output(dims):
    # with a table vbe_plan made, the CUDA forward does not zero its output (VbePlanTables): the
    # memory it gets is first filled with NaN here, so that an element no bag wrote would show;
    # empty bags (no lookups) and empty ranks included
    gen = torch.Generator().manual_seed(3)
    tables = [(6, dims[0]), (5, dims[1])]
    bsfr = [[2, 0, 3], [1, 4, 0]]
    indices, offsets, _ = vbe_batch([6, 5], bsfr, gen, weighted=False, max_L=2)
    emb_cpu = make("sgd", tables)
    emb = make("sgd", tables, device="cuda")
    emb.load_state_dict(emb_cpu.state_dict())
    numel = emb._vbe_plan(bsfr)["numel"]
    for _ in range(3):
        junk = torch.full((numel,), float("nan"), device="cuda")
        del junk  # (its block goes back to the caching allocator, for the output to take)
        with torch.no_grad():
            out = emb(indices.cuda(), offsets.cuda(), batch_size_per_feature_per_rank=bsfr)
            want = emb_cpu(indices, offsets, batch_size_per_feature_per_rank=bsfr)
        assert not bool(out.isnan().any())
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)


def test_vbe_operator_refuses_pooling_none_and_a_2d_gradient():
    emb = make("sgd", [(6, 4), (5, 4)], pooling="none")
    indices, offsets = torch.tensor([1, 2]), torch.tensor([0, 1, 2])
    table = torch.tensor([0, 4])
    with pytest.raises(RuntimeError, match="needs pooling sum or mean"):
        emb._ops.forward(*op_args(emb, indices, offsets), None, 2, None, False, table, 8)
    s = make("sgd", [(6, 4), (5, 4)])
    with pytest.raises(RuntimeError, match="grad_output must be the 1-D gradient"):
        s._run_backward(torch.zeros(1, 8), s.weights, indices, offsets, None, bag_output_offsets=table)


@cuda
@pytest.mark.parametrize("dims", [(16, 8), (6, 3), (2048, 16)])  # the 4-wide kernels, any-width, chunked rows
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float16, "int8"])
def test_cuda_vbe_direct_equals_gathered(dims, weights_dtype, monkeypatch):
    # feature 1 reads table 1 and has a rank with no bags; rank 2 has none at all; feature 2 shares table 0
    bsfr = [[5, 3, 0, 7], [4, 0, 0, 2], [0, 9, 0, 1]]
    tables, ftm = [(40, dims[0]), (30, dims[1])], [0, 1, 0]
    for pooling in ("sum", "mean"):
        assert_same_vbe_training(lambda: make("rowwise_adagrad", tables, ftm, device="cuda", pooling=pooling,
                                              weights_dtype=weights_dtype),
                                 bsfr, monkeypatch, steps=2, psw_grad=True)


@cuda
def test_cuda_vbe_direct_path_is_taken_and_checks_the_table(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the gathered VBE fallback ran")
    monkeypatch.setattr(TableBatchedEmbeddingBags, "_vbe_gather", refuse)
    emb = make("sgd", [(6, 4), (5, 3)], device="cuda")
    out, _ = train_vbe(emb, [[1, 2], [3, 0]], seed=3, steps=1)
    assert out[0].shape == (3 * 4 + 3 * 3,) and emb.step == 1
    indices = torch.tensor([1, 2, 0, 3, 4], device="cuda")
    offsets = torch.tensor([0, 1, 2, 2, 3, 4, 5], device="cuda")
    for table, message in ((torch.tensor([0, 4, -1, 8, 11, 14], dtype=torch.int32), "must be int64"),
                           (torch.tensor([0, 4, -1, 8, 11]), "one entry per bag")):
        with pytest.raises(RuntimeError, match=message):
            emb._ops.forward(*op_args(emb, indices, offsets), None, 0, None, False, table.cuda(), 17)
        with pytest.raises(RuntimeError, match=message):
            emb._run_backward(torch.zeros(17, device="cuda"), emb.weights, indices, offsets, None,
                              bag_output_offsets=table.cuda())


# ---- the plan (the vbe_plan operator) -------------------------------------------------------------


def formula_plan(B: torch.Tensor, dims: torch.Tensor):
    """The plan as the module computed it before the vbe_plan operator (vectorised torch
    operations): (pad, bag_out, total bags, max_B, output numel), the reference the operator must
    equal bitwise."""
    F, R = B.shape
    B_f = B.sum(dim=1)
    total, max_B = int(B_f.sum()), int(B_f.max())
    n_out = int((B * dims[:, None]).sum())
    start_f = torch.cumsum(B_f, 0) - B_f
    b = torch.arange(max_B, dtype=torch.int64)
    pad = (start_f[:, None] + torch.minimum(b[None, :], B_f[:, None])).reshape(-1)
    pad = torch.cat([pad, pad.new_full((1,), total)])
    ends = torch.cumsum(B, 1)
    bf = b[None, :].expand(F, max_B).contiguous()
    r = torch.searchsorted(ends, bf, right=True).clamp_(max=R - 1)
    seg_size = (B * dims[:, None]).t().reshape(-1)
    seg_first = (torch.cumsum(seg_size, 0) - seg_size).view(R, F).t()
    j = bf - (ends - B).gather(1, r)
    at = seg_first.gather(1, r) + j * dims[:, None]
    bag_out = torch.where(bf < B_f[:, None], at, at.new_full((), -1)).reshape(-1)
    return pad, bag_out, total, max_B, n_out


@pytest.fixture(scope="module")
def sgd_ops():
    return make("sgd", [(4, 2)])._ops


plan_sizes = st.integers(1, 6).flatmap(lambda F: st.integers(1, 6).flatmap(lambda R: st.tuples(
    # (zeros likely: empty ranks, empty features, all-empty batches)
    st.lists(st.lists(st.one_of(st.just(0), st.integers(0, 12)), min_size=R, max_size=R), min_size=F, max_size=F),
    st.lists(st.integers(1, 9), min_size=F, max_size=F),
)))


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=plan_sizes)
def test_vbe_plan_operator_equals_the_vectorised_formula(case, sgd_ops):
    sizes, dims = case
    B, D = torch.tensor(sizes, dtype=torch.int64), torch.tensor(dims, dtype=torch.int64)
    want = formula_plan(B, D)
    for op, given in ((sgd_ops.vbe_plan, B.reshape(-1).tolist()), (sgd_ops.vbe_plan_tensor, B.reshape(-1))):
        pad, bag_out, totals = op(given, B.shape[1], dims, torch.empty(0))
        assert torch.equal(pad, want[0]) and torch.equal(bag_out, want[1])
        assert list(totals) == list(want[2:])


def test_vbe_plan_operator_equals_the_formula_on_a_large_batch(sgd_ops):
    # (over 16384 padded bags: the CPU operator's loop in several parallel chunks)
    sizes = [[40_000, 0, 7, 1], [0, 0, 0, 0], [3, 25_000, 0, 9000]]
    dims = [4, 3, 16]
    pad, bag_out, totals = sgd_ops.vbe_plan([b for row in sizes for b in row], 4, dims, torch.empty(0))
    want = formula_plan(torch.tensor(sizes), torch.tensor(dims))
    assert torch.equal(pad, want[0]) and torch.equal(bag_out, want[1]) and list(totals) == list(want[2:])


def test_vbe_plan_of_a_module_with_shared_tables_and_empty_ranks():
    emb = make("sgd", [(9, 4), (7, 3)], [0, 1, 0])
    bsfr = [[2, 0, 1], [0, 0, 0], [3, 1, 0]]
    plan = emb._vbe_plan(bsfr)
    # (feature 2 reads table 0: 4 wide) rank 0: f0 rows 0-1 (0..8), f2 rows 0-2 (8..20); rank 1: f2
    # row 3 (20..24); rank 2: f0 row 2 (24..28); feature 1 has no bags
    assert plan["bag_out"].tolist() == [0, 4, 24, -1, -1, -1, -1, -1, 8, 12, 16, 20]
    assert plan["pad"].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3, 4, 5, 6, 7]
    assert (plan["total_bags"], plan["max_B"], plan["numel"]) == (7, 4, 28)
    want = formula_plan(torch.tensor(bsfr), torch.tensor([4, 3, 4]))
    assert torch.equal(plan["pad"], want[0]) and torch.equal(plan["bag_out"], want[1])


def test_vbe_plan_asks_the_current_vbe_direct():
    # a new plan records whether its batches take the direct path; the module remembers a yes per
    # device and _vbe_direct, so that one set on the instance (bench_vbe's gathered runs) or a
    # subclass's is still asked
    emb = make("sgd", [(5, 4), (6, 2)])
    assert emb._vbe_plan([[1, 2], [3, 0]])["direct"]
    emb._vbe_direct = lambda: False
    assert not emb._vbe_plan([[2, 2], [3, 0]])["direct"]
    del emb._vbe_direct
    assert emb._vbe_plan([[3, 2], [3, 0]])["direct"]

    class Gathered(TableBatchedEmbeddingBags):
        def _vbe_direct(self):
            return False

    sub = Gathered([(5, 4), (6, 2)], optimizer="sgd", device="cpu")
    assert not sub._vbe_plan([[1, 2], [3, 0]])["direct"]


def test_vbe_plan_is_kept_per_sizes_and_still_checks_the_input():
    emb = make("sgd", [(5, 4), (6, 2)])
    bsfr = [[1, 2], [3, 0]]
    plan = emb._vbe_plan(bsfr)
    # the same sizes in another form find the same plan; other sizes make a new one
    assert emb._vbe_plan([[1, 2], [3, 0]]) is plan
    assert emb._vbe_plan(((1, 2), (3, 0))) is plan
    assert emb._vbe_plan(torch.tensor(bsfr)) is plan
    assert emb._vbe_plan(torch.tensor(bsfr, dtype=torch.int32).t().contiguous().t()) is plan
    assert emb._vbe_plan([[1, 2], [0, 3]]) is not plan
    # values equal to the kept sizes but not ints are refused, not served from the cache
    for bad, message in (([[1, 2.0], [3, 0]], r"\[0\]\[1\] must be a non-negative int, got 2.0"),
                         ([[1, 2], [3, -0.0]], r"\[1\]\[1\] must be a non-negative int, got -0.0")):
        with pytest.raises(ValueError, match=message):
            emb._vbe_plan(bad)
    # at most _VBE_PLANS_KEPT plans, the oldest dropped first
    for n in range(emb._VBE_PLANS_KEPT + 3):
        emb._vbe_plan([[n, 1], [1, 1]])
    assert len(emb._vbe_plans) == emb._VBE_PLANS_KEPT
    assert emb._vbe_plan(bsfr) is not plan


def test_vbe_plan_of_many_features_and_ranks_goes_through_the_tensor_operator():
    # (over _VBE_SIZES_AS_LIST sizes: packed into an int64 tensor for vbe_plan_tensor)
    gen = torch.Generator().manual_seed(5)
    emb = make("sgd", [(9, 4), (7, 3), (5, 8)], [0, 1, 2, 0, 1, 2, 0, 1, 2])
    assert 9 * 8 > emb._VBE_SIZES_AS_LIST
    bsfr = torch.randint(0, 6, (9, 8), generator=gen).tolist()
    bsfr[4] = [0] * 8
    plan = emb._vbe_plan(bsfr)
    want = formula_plan(torch.tensor(bsfr), torch.tensor([4, 3, 8] * 3))
    assert torch.equal(plan["pad"], want[0]) and torch.equal(plan["bag_out"], want[1])
    assert (plan["total_bags"], plan["max_B"], plan["numel"]) == tuple(want[2:])
    assert emb._vbe_plan([list(row) for row in bsfr]) is plan
    bad = [list(row) for row in bsfr]
    bad[7][5] = -3
    with pytest.raises(ValueError, match=r"\[7\]\[5\] must be a non-negative int, got -3"):
        emb._vbe_plan(bad)
    bad[7][5] = 2**63
    with pytest.raises(ValueError, match=r"not F = 9 lists of R non-negative ints"):
        emb._vbe_plan(bad)
    bad[7][5] = 2**62
    bad[7][6] = 2**62
    with pytest.raises(RuntimeError, match=r"overflow int64"):
        emb._vbe_plan(bad)


@pytest.mark.parametrize(
    "sizes,ranks,dims,message",
    [
        ([1, 2, 3], 2, [4, 4], r"sizes must hold F x R batch sizes \(F = 2 features, the length of dims; R = 2 "
                               r"ranks, at least 1\), got 3"),
        ([1, 2], 0, [4], r"R = 0 ranks, at least 1"),
        ([], 1, [], r"F = 0 features"),
        ([1, 2], 2, [0], r"dims\[0\] must be positive, got 0"),
        ([1, -2], 2, [4], r"batch_size_per_feature_per_rank\[0\]\[1\] must be a non-negative int, got -2"),
        ([2**62, 2**62], 2, [4], r"overflow int64"),
        ([2**61], 1, [8], r"output's size overflows int64"),
    ],
)
def test_vbe_plan_operator_checks_its_input(sizes, ranks, dims, message, sgd_ops):
    with pytest.raises(RuntimeError, match=message):
        sgd_ops.vbe_plan(sizes, ranks, dims, torch.empty(0))
    with pytest.raises(RuntimeError, match=message):  # (the same sizes in an int64 tensor)
        sgd_ops.vbe_plan_tensor(torch.tensor(sizes, dtype=torch.int64), ranks, dims, torch.empty(0))


def test_vbe_plan_tensor_operator_checks_its_sizes_tensor(sgd_ops):
    message = r"vbe_plan_tensor: sizes must be a 1-D contiguous int64 CPU tensor, got "
    for bad, got in ((torch.tensor([1, 2], dtype=torch.int32), r"Int of shape \[2\] on cpu"),
                     (torch.tensor([[1, 2]]), r"Long of shape \[1, 2\] on cpu"),
                     (torch.tensor([1, 9, 2, 9])[::2], r"Long of shape \[2\] on cpu"),
                     (torch.tensor([1.0, 2.0]), r"Float of shape \[2\]")):
        with pytest.raises(RuntimeError, match=message + got):
            sgd_ops.vbe_plan_tensor(bad, 2, [4], torch.empty(0))


def test_vbe_plan_refuses_bad_sizes_however_given():
    emb = make("sgd", [(5, 4), (6, 2)])
    emb._vbe_plan([[1, 2], [3, 0]])
    for bad, message in (([[1, 2], [3, -1]], r"\[1\]\[1\] must be a non-negative int, got -1"),
                         ([[1, 2], [3]], r"feature 0 has 2, feature 1 has 1"),
                         ([[1, 2]], r"one list of per-rank batch sizes per feature \(2\)"),
                         ([[], []], r"\[0\] must be a non-empty list"),
                         ([[1, 2], [3, 2**64]], r"not F = 2 lists of R non-negative ints"),
                         (torch.tensor([[1, 2], [3, -1]]), r"\[1\]\[1\] must be a non-negative int, got -1")):
        with pytest.raises(ValueError, match=message):
            emb._vbe_plan(bad)


def test_vbe_batch_whose_features_have_equal_totals_runs_unpadded(monkeypatch):
    # every feature with as many bags as the largest (ranks of different batch sizes, the same for
    # every feature): the padded batch is the VBE batch itself, so the forward takes the offsets
    # as they are (no gather), and trains as the padded batch does. Padded batches: no gather
    # either where the operators read the offsets through the plan's padding index (the CPU's
    # default, _vbe_pad_route), one where they take the padded offsets (route off, CUDA's default)
    gen = torch.Generator().manual_seed(4)
    tables = [(6, 4), (5, 2), (7, 3)]
    for (bsfr, unpadded), route in itertools.product(
            (([[1, 3], [2, 2], [0, 4]], True), ([[1, 3], [2, 1], [0, 4]], False)), (True, False)):
        emb, ref = make("sgd", tables), make("sgd", tables)
        emb.__dict__["_vbe_pad_known"] = (torch.device("cpu"), route)
        ref.load_state_dict(emb.state_dict())
        indices, offsets, psw = vbe_batch([6, 5, 7], bsfr, gen, weighted=True)
        plan = emb._vbe_plan(bsfr)
        assert plan["unpadded"] == unpadded
        padded = emb.vbe_padded_offsets(offsets, bsfr)
        gathers = []
        real = torch.Tensor.index_select
        monkeypatch.setattr(torch.Tensor, "index_select", lambda *a, **k: gathers.append(1) or real(*a, **k))
        out = emb(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
        monkeypatch.undo()
        assert len(gathers) == (0 if unpadded or route else 1)
        assert (plan["vbe_pad"] is not plan["vbe"]) == (route and not unpadded)
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        # the same step on the padded batch: its output's real rows, rank-major, and its weights
        full = ref(indices, padded, psw)
        prefix = [[sum(bsfr[f][:r]) for r in range(2)] for f in range(3)]
        dims = [4, 2, 3]
        cols = [0, 4, 6]
        rows = [(prefix[f][r] + j, f) for r in range(2) for f in range(3) for j in range(bsfr[f][r])]
        want = torch.cat([full[b, cols[f]:cols[f] + dims[f]] for b, f in rows])
        assert torch.equal(out, want)
        grad_full = torch.zeros_like(full)
        at = 0
        for b, f in rows:
            grad_full[b, cols[f]:cols[f] + dims[f]] = grad[at:at + dims[f]]
            at += dims[f]
        full.backward(grad_full)
        assert torch.equal(emb.weights, ref.weights)


def test_vbe_forward_finds_a_kept_plan_without_building_it_and_still_checks_the_input(monkeypatch):
    # the forward's own lookup of a kept plan (_vbe_prepare): no call to _vbe_plan_and_padded for sizes
    # it has seen, given as a new list; floats, bad offsets and other devices' plans still go the
    # checked way
    emb = make("sgd", [(5, 4), (6, 2)])
    indices, offsets = torch.tensor([1, 2, 3, 4, 0, 5]), torch.tensor([0, 1, 2, 3, 4, 5, 6])
    with torch.no_grad():
        first = emb(indices, offsets, batch_size_per_feature_per_rank=[[1, 2], [3, 0]])
    built = []
    real = TableBatchedEmbeddingBags._vbe_plan_and_padded
    monkeypatch.setattr(TableBatchedEmbeddingBags, "_vbe_plan_and_padded",
                        lambda self, bsfr, key=None, offsets=None, through_pad=False:
                        built.append(bsfr) or real(self, bsfr, key, offsets, through_pad))
    with torch.no_grad():
        again = emb(indices, offsets, batch_size_per_feature_per_rank=[[1, 2], [3, 0]])
        as_tuples = emb(indices, offsets, batch_size_per_feature_per_rank=((1, 2), (3, 0)))
    assert built == [] and torch.equal(again, first) and torch.equal(as_tuples, first)
    # (the last plan used is tried first; emptying the kept plans forgets it too: a new one is made)
    assert emb._vbe_plans.last is emb._vbe_plans[_vbe_key([[1, 2], [3, 0]], 2)]
    emb._vbe_plans.clear()
    with torch.no_grad():
        assert torch.equal(emb(indices, offsets, batch_size_per_feature_per_rank=[[1, 2], [3, 0]]), first)
    assert built == [[[1, 2], [3, 0]]]
    built.clear()
    # a bool is an int (True a batch of 1), kept plan or not; numpy ints and tensors are converted
    np = pytest.importorskip("numpy")
    for sizes in ([[True, 2], [3, False]], [[np.int64(1), 2], [3, np.int32(0)]], torch.tensor([[1, 2], [3, 0]]),
                  [[torch.tensor(1), 2], [3, 0]]):
        with torch.no_grad():
            assert torch.equal(emb(indices, offsets, batch_size_per_feature_per_rank=sizes), first), sizes
    fresh = make("sgd", [(5, 4), (6, 2)])
    with torch.no_grad():
        assert torch.equal(fresh(indices, offsets, batch_size_per_feature_per_rank=[[True, 2], [3, False]]), first)
    # values equal to the kept sizes but not ints are refused, not served from the kept plan
    for bad, message in (([[1, 2.0], [3, 0]], r"\[0\]\[1\] must be a non-negative int, got 2.0"),
                         (((1, 2), (3, -0.0)), r"\[1\]\[1\] must be a non-negative int, got -0.0"),
                         ([[1, 2], [3, "0"]], r"\[1\]\[1\] must be a non-negative int, got '0'")):
        with pytest.raises(ValueError, match=message):
            emb(indices, offsets, batch_size_per_feature_per_rank=bad)
    # sizes whose int64 bytes equal a kept plan's key but are not F lists of R sizes, and a set
    # for a row (no order), are refused, not served from the kept plan (_vbe_key); a tensor for a
    # row goes the checked way, which converts it
    three = make("sgd", [(5, 4), (6, 2), (7, 2)])
    with torch.no_grad():
        kept = three(indices, offsets, batch_size_per_feature_per_rank=[[1, 2], [3, 0], [0, 0]])
        for bad, message in (([[1, 2, 3, 0, 0, 0]], r"one list of per-rank batch sizes per feature \(3\)"),
                             ([[1, 2], [3], [0, 0, 0]], r"feature 0 has 2, feature 1 has 1"),
                             ([[1, 2], {3, 0}, [0, 0]], r"\[1\] must be a non-empty list")):
            with pytest.raises(ValueError, match=message):
                three(indices, offsets, batch_size_per_feature_per_rank=bad)
        assert torch.equal(three(indices, offsets, batch_size_per_feature_per_rank=[[1, 2], torch.tensor([3, 0]),
                                                                                     [0, 0]]), kept)
    # offsets that do not fit the kept plan: the same errors as without one
    for bad_offsets, error, message in (
            (torch.tensor([0, 1, 2, 3, 4, 5]), ValueError, r"\(sum of all batch sizes\) \+ 1 = 7 entries"),
            (torch.tensor([0, 1, 2, 3, 4, 5, 6, 6]), ValueError, r"= 7 entries .* got shape \(8,\)"),
            (offsets.view(1, 7), ValueError, r"must be 1-D"),
            ([0, 1, 2, 3, 4, 5, 6], TypeError, r"offsets must be a torch.Tensor, got list")):
        with pytest.raises(error, match=message):
            emb(indices, bad_offsets, batch_size_per_feature_per_rank=[[1, 2], [3, 0]])
    # a kept plan of another device is not used: the module's device decides (here a plan
    # recorded as made for the meta device is replaced by a CPU one)
    plan = emb._vbe_plans[_vbe_key([[1, 2], [3, 0]], 2)]
    plan["device"] = torch.device("meta")
    built.clear()
    with torch.no_grad():
        assert torch.equal(emb(indices, offsets, batch_size_per_feature_per_rank=[[1, 2], [3, 0]]), first)
    assert len(built) == 1 and emb._vbe_plans[_vbe_key([[1, 2], [3, 0]], 2)]["device"] == torch.device("cpu")
    assert emb._vbe_plans[_vbe_key([[1, 2], [3, 0]], 2)] is not plan


@cuda
def test_cuda_vbe_plan_equals_the_cpu_plan_without_waiting_for_the_device():
    gen = torch.Generator().manual_seed(11)
    emb_cpu = make("sgd", [(5, 4), (6, 3), (7, 8)])
    emb = make("sgd", [(5, 4), (6, 3), (7, 8)], device="cuda")
    # empty ranks and features; an all-empty batch; over a million padded bags (the grid-stride loop)
    cases = [[[3, 0, 2, 5], [0, 0, 0, 0], [1, 7, 0, 2]], [[0, 0], [0, 0], [0, 0]],
             [[400_000, 0], [1, 2], [0, 3]]]
    # headers (9 + 6 R values for 3 features) on either side of the sizes the kernel takes as its
    # argument (vbe_plan_cuda.cuh: 128, 512, 2048, 4000 values), and past them (the copied header)
    cases += [torch.randint(0, 50, (3, R), generator=gen).tolist()
              for R in (1, 2, 5, 16, 19, 20, 64, 84, 85, 340, 341, 665, 666, 1400)]
    for bsfr in cases:
        want = emb_cpu._vbe_plan(bsfr)
        torch.cuda.set_sync_debug_mode("error")  # (a pageable copy or a read-back would raise here)
        try:
            got = emb._vbe_plan(bsfr)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got["pad"].is_cuda and got["bag_out"].is_cuda
        assert torch.equal(got["pad"].cpu(), want["pad"]) and torch.equal(got["bag_out"].cpu(), want["bag_out"])
        assert all(got[k] == want[k] for k in ("total_bags", "max_B", "numel"))
        # (one allocation for both tables: they must not overlap)
        bags = got["bag_out"].numel()
        assert got["pad"].numel() == bags + 1 and got["pad"].is_contiguous() and got["bag_out"].is_contiguous()
        assert got["bag_out"].data_ptr() + 8 * bags <= got["pad"].data_ptr() or \
            got["pad"].data_ptr() + 8 * (bags + 1) <= got["bag_out"].data_ptr()


# ---- a new plan with its padded offsets (vbe_plan_padded) ----------------------------------------


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=plan_sizes, int32=st.booleans())
def test_vbe_plan_padded_operator_equals_the_plan_and_the_gathered_offsets(case, int32, sgd_ops):
    # the tables of vbe_plan_tensor and offsets[pad] (what the forward gathered before), the
    # offsets' dtype kept; offsets that do not hold total + 1 entries give an empty tensor
    sizes, dims = case
    B = torch.tensor(sizes, dtype=torch.int64).reshape(-1)
    pad, bag_out, totals = sgd_ops.vbe_plan_tensor(B, len(sizes[0]), dims, torch.empty(0))
    total = totals[0]
    lengths = (torch.arange(total, dtype=torch.int64) * 7) % 5
    offsets = torch.zeros(total + 1, dtype=torch.int32 if int32 else torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    got_pad, got_bag_out, got_totals, padded = sgd_ops.vbe_plan_padded(B, len(sizes[0]), dims, offsets)
    assert torch.equal(got_pad, pad) and torch.equal(got_bag_out, bag_out) and list(got_totals) == list(totals)
    assert padded.dtype == offsets.dtype and torch.equal(padded, offsets.index_select(0, pad))
    for wrong in (offsets[:-1], torch.cat([offsets, offsets[-1:]])):
        assert sgd_ops.vbe_plan_padded(B, len(sizes[0]), dims, wrong)[3].numel() == 0


def test_vbe_plan_padded_operator_checks_its_offsets(sgd_ops):
    B = torch.tensor([1, 2, 3, 0])
    for bad, message in ((torch.zeros(7), "offsets must be a 1-D int32 or int64 tensor"),
                         (torch.zeros(7, 1, dtype=torch.int64), "offsets must be a 1-D int32 or int64 tensor")):
        with pytest.raises(RuntimeError, match=message):
            sgd_ops.vbe_plan_padded(B, 2, [4, 2], bad)
    with pytest.raises(RuntimeError, match=r"batch_size_per_feature_per_rank\[1\]\[0\] must be a non-negative"):
        sgd_ops.vbe_plan_padded(torch.tensor([1, 2, -3, 0]), 2, [4, 2], torch.zeros(1, dtype=torch.int64))
    # (a non-contiguous offsets tensor is read as its values)
    offsets = torch.arange(10, dtype=torch.int64)[::2]
    pad, _, _, padded = sgd_ops.vbe_plan_padded(torch.tensor([1, 2, 1, 0]), 2, [4, 2], offsets)
    assert not offsets.is_contiguous() and padded.numel() == 7 and torch.equal(padded, offsets.index_select(0, pad))


@pytest.mark.parametrize("route", [False, True])
@pytest.mark.parametrize("int32", [False, True])
def test_vbe_new_plan_makes_the_padded_offsets_without_a_gather(int32, route, monkeypatch):
    # every step new sizes (TorchRec's case): the forward makes each new plan with its padded
    # offsets (vbe_plan_padded) and gathers nothing; output and training the
    # padded batch's bitwise, as the kept plans' (the same sizes again: the gather). With the
    # operators reading the offsets through the plan's padding index (route: the CPU's default,
    # _vbe_pad_route) no padded offsets at all, new plan or kept (vbe_plan, never vbe_plan_padded)
    gathers = []
    index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda self, *a, **k: gathers.append(1) or index_select(self, *a, **k))
    tables = [(20, 4), (30, 3), (25, 8)]
    vbe, pad_emb = make("rowwise_adagrad", tables), make("rowwise_adagrad", tables)
    vbe.__dict__["_vbe_pad_known"] = (torch.device("cpu"), route)
    plans_padded = []
    plan_padded = vbe._ops.vbe_plan_padded
    monkeypatch.setattr(vbe, "_ops", types.SimpleNamespace(**{
        name: getattr(vbe._ops, name) for name in ("forward", "backward", "grad_per_sample_weights", "vbe_plan",
                                                   "vbe_plan_tensor")},
        vbe_plan_padded=lambda *a: plans_padded.append(1) or plan_padded(*a)), raising=False)
    gen = torch.Generator().manual_seed(4)
    steps = [[[3, 0, 2], [1, 1, 1], [0, 4, 0]], [[2, 2, 2], [0, 0, 1], [5, 0, 1]], [[1, 0, 0], [0, 3, 0], [2, 2, 0]],
             [[3, 0, 2], [1, 1, 1], [0, 4, 0]]]
    dtype = torch.int32 if int32 else torch.int64
    for k, bsfr in enumerate(steps * 2):
        indices, offsets, _ = vbe_batch([20, 30, 25], bsfr, gen, weighted=False)
        indices, offsets = indices.to(dtype), offsets.to(dtype)
        gathers.clear()
        out = vbe(indices, offsets, batch_size_per_feature_per_rank=bsfr)
        new_plan = k < 3  # (step 3 repeats step 0's sizes; then all kept)
        assert gathers == ([] if new_plan or route else [1]), (k, gathers)
        assert plans_padded == ([1] if new_plan and not route else []), (k, plans_padded)
        plans_padded.clear()
        padded = vbe_padded_by_hand(offsets, bsfr)
        out_pad = pad_emb(indices, padded)
        grad = torch.randn(out.numel(), generator=gen)
        assert torch.equal(out.detach(), rank_major(out_pad.detach(), bsfr, [4, 3, 8]))
        out.backward(grad)
        out_pad.backward(padded_grad(grad, bsfr, [4, 3, 8], out_pad.shape))
        assert torch.equal(vbe.weights, pad_emb.weights)
        assert torch.equal(vbe.optimizer_state("momentum"), pad_emb.optimizer_state("momentum"))


def vbe_padded_by_hand(offsets, bsfr):
    """The offsets of the fixed batch F x max_B in which every feature's missing bags are empty."""
    totals = [sum(row) for row in bsfr]
    max_B, pad, start = max(totals), [], 0
    for B_f in totals:
        pad += [start + min(b, B_f) for b in range(max_B)]
        start += B_f
    return offsets[torch.tensor(pad + [start])]


def rank_major(out_pad, bsfr, dims):
    """The padded output's real rows in FBGEMM's 1-D rank-major VBE order."""
    col = [sum(dims[:f]) for f in range(len(dims))]
    parts = []
    for r in range(len(bsfr[0])):
        for f in range(len(bsfr)):
            first = sum(bsfr[f][:r])
            parts.append(out_pad[first:first + bsfr[f][r], col[f]:col[f] + dims[f]].reshape(-1))
    return torch.cat(parts)


def padded_grad(grad, bsfr, dims, shape):
    """The 1-D VBE gradient placed at its rows of the padded output (zeros elsewhere)."""
    full = torch.zeros(shape)
    col = [sum(dims[:f]) for f in range(len(dims))]
    at = 0
    for r in range(len(bsfr[0])):
        for f in range(len(bsfr)):
            first, n = sum(bsfr[f][:r]), bsfr[f][r] * dims[f]
            full[first:first + bsfr[f][r], col[f]:col[f] + dims[f]] = grad[at:at + n].view(-1, dims[f])
            at += n
    return full


@cuda
def test_cuda_vbe_plan_padded_equals_the_gathered_offsets_without_waiting_for_the_device():
    # the kernel argument's header sizes and the copied header beyond them (as the plan test above),
    # int32 and int64 offsets; offsets that do not fit: an empty tensor
    gen = torch.Generator().manual_seed(12)
    emb = make("sgd", [(5, 4), (6, 3), (7, 8)], device="cuda")
    ops = emb._ops
    cases = [[[3, 0, 2, 5], [0, 0, 0, 0], [1, 7, 0, 2]], [[0, 0], [0, 0], [0, 0]], [[400_000, 0], [1, 2], [0, 3]]]
    cases += [torch.randint(0, 50, (3, R), generator=gen).tolist() for R in (1, 5, 20, 85, 341, 666, 1400)]
    for bsfr in cases:
        B = torch.tensor(bsfr, dtype=torch.int64).reshape(-1)
        total = int(B.sum())
        for dtype in (torch.int64, torch.int32):
            offsets = torch.cumsum(torch.randint(0, 4, (total + 1,), generator=gen), 0).to(dtype).cuda()
            torch.cuda.set_sync_debug_mode("error")
            try:
                pad, bag_out, totals, padded = ops.vbe_plan_padded(B, len(bsfr[0]), [4, 3, 8], offsets)
                wrong = ops.vbe_plan_padded(B, len(bsfr[0]), [4, 3, 8], offsets[:-1])[3]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = ops.vbe_plan_tensor(B, len(bsfr[0]), [4, 3, 8], offsets)
            assert torch.equal(pad, want[0]) and torch.equal(bag_out, want[1]) and list(totals) == list(want[2])
            assert padded.is_cuda and padded.dtype == dtype and torch.equal(padded, offsets.index_select(0, pad))
            assert wrong.numel() == 0


def test_fbgemm_class_vbe_forward_looks_the_plan_up_and_gathers_once(monkeypatch):
    # the FBGEMM class pads the offsets for its bounds check (WARNING, its default) and hands the
    # plan and padded offsets to the module's VBE forward: one key and one gather per forward (two
    # before), the same output and training as bounds_check_mode NONE, and nothing left behind
    import tbegen.module as module_
    from tbegen.fbgemm_compat import BoundsCheckMode, ComputeDevice, EmbeddingLocation, EmbOptimType
    from tbegen.fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen as Compat

    keys, gathers = [], []
    key, index_select = module_._vbe_key, torch.Tensor.index_select
    monkeypatch.setattr(module_, "_vbe_key", lambda *a: keys.append(1) or key(*a))
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a, **k: gathers.append(1) or index_select(self, *a, **k))
    specs = [(12, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for d in (4, 8, 12)]
    made = {mode: Compat(specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.2, eps=1e-4,
                         bounds_check_mode=getattr(BoundsCheckMode, mode)) for mode in ("WARNING", "NONE")}
    with torch.no_grad():
        for a, b in zip(made["WARNING"].split_embedding_weights(), made["NONE"].split_embedding_weights()):
            a.copy_(b)
    gen = torch.Generator().manual_seed(6)
    for bsfr in ([[2, 3], [0, 4], [1, 1]], [[2, 3], [0, 4], [1, 1]], [[5, 0], [2, 2], [0, 3]]):
        indices, offsets, _ = vbe_batch([12] * 3, bsfr, gen, weighted=False)
        grad = None
        outs = {}
        for mode, emb in made.items():
            keys.clear(), gathers.clear()
            outs[mode] = emb(indices, offsets, batch_size_per_feature_per_rank=[list(r) for r in bsfr])
            if mode == "WARNING":
                # (a kept plan: its key once and one gather; a new one: its key once, no gather)
                assert len(keys) == 1 and len(gathers) <= 1, (keys, gathers)
                assert emb._tbe.__dict__["_vbe_handed"] is None
            grad = torch.randn(outs[mode].shape, generator=gen) if grad is None else grad
            outs[mode].backward(grad)
        assert torch.equal(outs["WARNING"], outs["NONE"])
        for a, b in zip(made["WARNING"].split_embedding_weights(), made["NONE"].split_embedding_weights()):
            assert torch.equal(a, b)
    # a forward that fails leaves nothing handed either
    emb = made["WARNING"]
    handle = emb._tbe.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("hook")))
    with pytest.raises(RuntimeError, match="hook"):
        emb(indices, offsets, batch_size_per_feature_per_rank=bsfr)
    handle.remove()
    assert emb._tbe.__dict__["_vbe_handed"] is None


def test_vbe_forward_takes_a_handed_plan_only_for_the_same_objects():
    # (the FBGEMM class's hand-off: a plan handed for other offsets or sizes objects, even equal
    # ones, is not used)
    emb = make("sgd", [(5, 4), (6, 2)])
    indices, offsets = torch.tensor([1, 2, 3, 4, 0, 5]), torch.tensor([0, 1, 2, 3, 4, 5, 6])
    bsfr = [[1, 2], [3, 0]]
    with torch.no_grad():
        want = emb(indices, offsets, batch_size_per_feature_per_rank=bsfr)
        wrong_plan, wrong_padded = emb._vbe_prepare(torch.tensor([0, 1, 2, 3, 4, 5, 6]), [[2, 1], [0, 3]])
        for other_offsets, other_bsfr in ((offsets.clone(), bsfr), (offsets, [list(r) for r in bsfr])):
            emb.__dict__["_vbe_handed"] = (other_offsets, other_bsfr, (wrong_plan, wrong_padded))
            assert torch.equal(emb(indices, offsets, batch_size_per_feature_per_rank=bsfr), want)
        emb.__dict__["_vbe_handed"] = (offsets, bsfr, (wrong_plan, wrong_padded))
        assert not torch.equal(emb(indices, offsets, batch_size_per_feature_per_rank=bsfr), want)


def _pad_route_steps(device, route, monkeypatch, optimizer, tables, ftm, pooling, weighted, dtype, dims):
    """Three steps (new sizes, new sizes, the first again: a kept plan) of one module whose VBE
    operators read the offsets through the plan's padding index (`route`) or take them padded:
    each step's output, per-sample-weight gradient and the weights and states after it. Counts
    the offsets' gathers (index_select) and asserts which way the forward went."""
    gathers = []
    index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a, **k: gathers.append(1) or index_select(self, *a, **k))
    if device == "cuda":
        monkeypatch.setenv("TBEGEN_VBE_PAD_IN_KERNELS", "1" if route else "0")
    emb = make(optimizer, tables, ftm, device=device, pooling=pooling)
    if device == "cpu":
        emb.__dict__["_vbe_pad_known"] = (torch.device("cpu"), route)
    gen = torch.Generator().manual_seed(11)
    rows = [tables[t][0] for t in (ftm or range(len(tables)))]
    results = []
    for k, bsfr in enumerate(([[3, 0, 2], [1, 1, 1], [0, 4, 0]], [[2, 2, 2], [0, 0, 1], [5, 0, 1]],
                              [[3, 0, 2], [1, 1, 1], [0, 4, 0]])):
        indices, offsets, psw = vbe_batch(rows, bsfr, gen, weighted=weighted)
        indices, offsets = indices.to(dtype).to(device), offsets.to(dtype).to(device)
        if psw is not None:
            psw = psw.to(device).requires_grad_(True)
        gathers.clear()
        out = emb(indices, offsets, psw, batch_size_per_feature_per_rank=bsfr)
        plan = emb.__dict__["_vbe_plans"].last
        assert (plan["vbe_pad"] is not plan["vbe"]) == route
        # (the route: no gather; else new plans (steps 0, 1) pad in vbe_plan_padded, the kept one gathers)
        assert gathers == ([] if route or k < 2 else [1]), (k, gathers)
        grad = torch.randn(out.shape, generator=gen).to(device)
        out.backward(grad)
        results.append((out.detach().cpu(), None if psw is None else psw.grad.cpu(), emb.weights.detach().cpu().clone(),
                        [s.detach().cpu().clone() for s in emb.states.buffers()]))
    return results


def _assert_pad_route_bitwise(device, monkeypatch, optimizer, tables, ftm, pooling, weighted, dtype, dims=None):
    a = _pad_route_steps(device, True, monkeypatch, optimizer, tables, ftm, pooling, weighted, dtype, dims)
    monkeypatch.undo()
    b = _pad_route_steps(device, False, monkeypatch, optimizer, tables, ftm, pooling, weighted, dtype, dims)
    monkeypatch.undo()
    for k, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x[0], y[0]), k
        assert (x[1] is None) == (y[1] is None) and (x[1] is None or torch.equal(x[1], y[1])), k
        assert torch.equal(x[2], y[2]), k
        assert all(torch.equal(s, t) for s, t in zip(x[3], y[3])), k


@pytest.mark.parametrize("optimizer,pooling,weighted,dtype", [
    ("sgd", "sum", False, torch.int64), ("rowwise_adagrad", "sum", True, torch.int32),
    ("rowwise_adagrad", "mean", False, torch.int64), ("sgd", "mean", True, torch.int32)])
def test_vbe_offsets_through_the_padding_index_are_the_gathered_offsets_bitwise(optimizer, pooling, weighted, dtype,
                                                                                monkeypatch):
    # the operators reading each padded bag's bounds at offsets[pad[b]] (bag_pad: the CPU's default)
    # give the output, the per-sample-weight gradient and the update of the gathered offsets', bit
    # for bit; no gather on that route, new plan or kept
    _assert_pad_route_bitwise("cpu", monkeypatch, optimizer, [(20, 4), (30, 3), (25, 8)], None, pooling, weighted,
                              dtype)


def test_vbe_bag_pad_is_checked_by_the_operators():
    emb = make("sgd", [(6, 4), (5, 2)])
    indices, offsets = torch.tensor([1, 2, 0, 3, 4]), torch.tensor([0, 1, 2, 3, 4, 5])  # 5 VBE bags
    plan = emb._vbe_plan([[1, 2], [2, 0]])
    args = op_args(emb, indices, offsets)
    for pad, message in ((torch.tensor([0, 1, 3, 3, 4, 9, 5]), r"bag_pad\[5\] = 9 is not an entry of the 6 offsets"),
                         (torch.tensor([0, 1, 3, 3, 4, 5], dtype=torch.int32), "bag_pad must be int64"),
                         (torch.tensor([0, 1, 3, 3, 4, 5]), "F \\* B \\+ 1 entries")):
        with pytest.raises(RuntimeError, match=message):
            emb._ops.forward(*args, None, 0, None, False, plan["bag_out"], plan["numel"], pad)
    out = emb._ops.forward(*args, None, 0, None, False, plan["bag_out"], plan["numel"], plan["pad"])
    ref = emb._ops.forward(*op_args(emb, indices, offsets.index_select(0, plan["pad"])), None, 0, None, False,
                           plan["bag_out"], plan["numel"])
    assert torch.equal(out, ref)


@cuda
@pytest.mark.parametrize("dims", [(4, 8), (3, 6), (64, 128), (128, 256)])
@pytest.mark.parametrize("pooling,dtype", [("sum", torch.int64), ("mean", torch.int32)])
def test_cuda_bag_pad_of_another_layout_reads_the_offsets_it_names(dims, pooling, dtype):
    # The kPad kernels read a bag's offsets where the plan's layout puts its pad entries
    # (pad_bag_bounds, cuda_kernels.cuh: predicted from the feature's first and last entries) and,
    # where the bag's own entries say otherwise (a padding index of another layout), again where they
    # name: the forward, per-sample-weight gradient and update of the gathered offsets offsets[pad],
    # bit for bit, for the plan's index and for two others (4-wide, bag-group and any-width kernels)
    tables = [(6, dims[0]), (5, dims[1])]
    emb, twin = (make("sgd", tables, device="cuda", pooling=pooling) for _ in range(2))
    assert torch.equal(emb.weights, twin.weights)
    indices = torch.tensor([1, 2, 0, 3, 4], dtype=dtype, device="cuda")
    offsets = torch.tensor([0, 1, 2, 3, 4, 5], dtype=dtype, device="cuda")  # 5 VBE bags
    plan = emb._vbe_plan([[1, 2], [2, 0]])  # 2 x 3 padded bags, bag 5 padding
    bag_out, numel = plan["bag_out"].cuda(), plan["numel"]
    gen = torch.Generator().manual_seed(3)
    psw = (torch.rand(5, generator=gen) + 0.5).cuda()
    for pad in (plan["pad"].cuda(), torch.tensor([0, 1, 1, 2, 3, 5, 5], device="cuda"),
                torch.tensor([0, 0, 1, 2, 3, 5, 5], device="cuda")):
        padded = offsets.index_select(0, pad)
        out = emb._ops.forward(*op_args(emb, indices, offsets), psw, emb._pooling_id, None, False, bag_out, numel, pad)
        ref = twin._ops.forward(*op_args(twin, indices, padded), psw, twin._pooling_id, None, False, bag_out, numel)
        assert torch.equal(out, ref), pad
        grad = torch.randn(numel, generator=gen).cuda()
        got = emb._ops.grad_per_sample_weights(grad, emb.weights.detach(), emb.features, emb.layout.total_D,
                                               emb.layout.max_D, indices, offsets, emb._pooling_id, None, False,
                                               bag_out, pad)
        want = twin._ops.grad_per_sample_weights(grad, twin.weights.detach(), twin.features, twin.layout.total_D,
                                                 twin.layout.max_D, indices, padded, twin._pooling_id, None, False,
                                                 bag_out)
        assert torch.equal(got, want), pad
        emb._run_backward(grad, emb.weights, indices, offsets, psw, bag_output_offsets=bag_out, bag_pad=pad)
        twin._run_backward(grad, twin.weights, indices, padded, psw, bag_output_offsets=bag_out)
        assert torch.equal(emb.weights, twin.weights), pad


@cuda
@pytest.mark.parametrize("optimizer,pooling,weighted,dtype,dims", [
    ("sgd", "sum", False, torch.int64, (4, 8, 12)), ("rowwise_adagrad", "sum", True, torch.int32, (4, 8, 12)),
    ("rowwise_adagrad", "mean", False, torch.int64, (3, 5, 130)), ("sgd", "mean", True, torch.int32, (3, 5, 7)),
    ("adam", "sum", False, torch.int64, (64, 128, 256))])
def test_cuda_vbe_offsets_through_the_padding_index_are_the_gathered_offsets_bitwise(optimizer, pooling, weighted,
                                                                                     dtype, dims, monkeypatch):
    # TBEGEN_VBE_PAD_IN_KERNELS=1: the forward, per-sample-weight gradient and linearize kernels
    # read bag b's bounds at offsets[pad[b]] (ForwardArgs::pad; 4-wide and any-width widths), no
    # index_select: the same bits as the gathered offsets (the default)
    tables = [(20, dims[0]), (30, dims[1]), (25, dims[2])]
    _assert_pad_route_bitwise("cuda", monkeypatch, optimizer, tables, None, pooling, weighted, dtype, dims)
