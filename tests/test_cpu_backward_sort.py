"""The CPU backward's two ways of sorting a batch give the same step, bit for bit.

When every feature has its own table, the tables in feature order, and no index is bad, the CPU
backward sorts each feature's items on its own (cpu_kernels.h, `radix_sort_range`); otherwise, and
whenever there are fewer features than threads, it sorts the whole batch at once. Unweighted pooled
bags carry the bag in the sorted item instead of the position. These tests run the same batch down
both paths (one thread: by feature; three threads and two features: the whole batch) and compare
the results bitwise, then against the float64 reference."""

import pytest
import torch

from tbegen import harness
from tbegen.layout import POOLING, make_layout


def _step(ops, layout, B, batch, go, momentum, weights, pooling, threads, **kw):
    w, m = weights.clone(), momentum.clone()
    torch.set_num_threads(threads)
    try:
        ops.backward(go, w, layout.features_tensor(), layout.total_D, layout.max_D, layout.total_hash_size,
                     batch.indices, batch.offsets, batch.per_sample_weights, POOLING[pooling], 32, False, 0, m,
                     0.1, 1e-8, 0.0, 0, 0.0, 1, **kw)
    finally:
        torch.set_num_threads(2)
    return w, m


def _batch(layout, ftm, tables, B, L, gen, weighted):
    """Bags of 0 to 2L - 1 indices; a third of each feature's indices on one hot row (long runs
    beside single occurrences)."""
    lengths = torch.randint(0, 2 * L, (len(ftm) * B,), generator=gen)
    idx = []
    for f in range(len(ftm)):
        E = tables[ftm[f]][0]
        n = int(lengths[f * B:(f + 1) * B].sum())
        x = torch.randint(0, E, (n,), generator=gen)
        x[torch.rand(n, generator=gen) < 0.3] = E // 2
        idx.append(x)
    indices = torch.cat(idx)
    offsets = torch.zeros(len(ftm) * B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    psw = torch.rand(indices.numel(), generator=gen) if weighted else None
    return harness.Batch(indices, offsets, psw)


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ftm", [(0, 1), (1, 0), (0, 0)])
def test_by_feature_and_whole_batch_sorts_agree(load_ops, pooling, weighted, ftm):
    spec, ops = load_ops("rowwise_adagrad")
    tables = ((3000, 16), (700, 16))
    layout = make_layout(tables, ftm)
    gen = torch.Generator().manual_seed(5 + len(pooling) + weighted)
    B, L = 64, 20
    batch = _batch(layout, ftm, tables, B, L, gen, weighted)
    weights = torch.rand(layout.weights_numel, generator=gen) - 0.5
    momentum = torch.rand(layout.total_hash_size, generator=gen)
    rows = batch.indices.numel() if pooling == "none" else B
    go = torch.randn(rows, layout.max_D if pooling == "none" else layout.total_D, generator=gen)
    w1, m1 = _step(ops, layout, B, batch, go, momentum, weights, pooling, 1)   # by feature where allowed
    w3, m3 = _step(ops, layout, B, batch, go, momentum, weights, pooling, 3)   # 2 features < 3 threads: whole batch
    assert torch.equal(w1, w3) and torch.equal(m1, m3)
    assert not torch.equal(w1, weights)
    hyper = dict(harness.default_hyperparameters(spec, {}), learning_rate=0.1, eps=1e-8)
    ref_w, ref_states, _ = harness.reference_step(spec, layout, B, pooling, weights, {"momentum": momentum}, batch,
                                                  go, hyper, 1)
    scale = (ref_w - weights.double()).abs().max()
    assert ((w1.double() - ref_w).abs().max() / scale).item() < harness.TOLERANCE[torch.float32]
    assert torch.allclose(m1.double(), ref_states["momentum"], rtol=1e-5, atol=1e-7)


def test_skipped_bad_index_takes_the_whole_batch_sort(load_ops):
    """A bad index (skipped) sends the batch down the whole-batch sort; the step equals that of the
    same batch without it (sum pooling), sorted feature by feature."""
    _, ops = load_ops("rowwise_adagrad")
    tables = ((500, 8), (400, 8), (300, 8))
    ftm = (0, 1, 2)
    layout = make_layout(tables, ftm)
    gen = torch.Generator().manual_seed(11)
    B, L = 16, 6
    batch = _batch(layout, ftm, tables, B, L, gen, False)
    weights = torch.rand(layout.weights_numel, generator=gen) - 0.5
    momentum = torch.zeros(layout.total_hash_size)
    go = torch.randn(B, layout.total_D, generator=gen)
    # feature 1's first index made bad (past its table's 400 rows)
    start = int(batch.offsets[B])
    bad = batch.indices.clone()
    bad[start] = 400
    keep = torch.ones(bad.numel(), dtype=torch.bool)
    keep[start] = False
    bag = int(torch.searchsorted(batch.offsets, torch.tensor(start), right=True)) - 1
    offsets_without = batch.offsets.clone()
    offsets_without[bag + 1:] -= 1
    with_bad = harness.Batch(bad, batch.offsets, None)
    without = harness.Batch(bad[keep], offsets_without, None)
    w_bad, m_bad = _step(ops, layout, B, with_bad, go, momentum, weights, "sum", 1, skip_bad_indices=True)
    w_ok, m_ok = _step(ops, layout, B, without, go, momentum, weights, "sum", 1)
    assert torch.equal(w_bad, w_ok) and torch.equal(m_bad, m_ok)
