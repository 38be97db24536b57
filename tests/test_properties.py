"""Property tests (hypothesis) of the CPU kernels over random layouts (odd widths included) and
batches: the forward matches the float64 reference, and the fused backward is bitwise
deterministic, whatever the number of threads, and leaves rows outside the batch untouched."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tbegen import harness
from tbegen.layout import POOLING, make_layout

tables_st = st.lists(
    st.tuples(st.integers(1, 40), st.sampled_from([1, 3, 4, 5, 8, 12, 17, 32, 64, 132])), min_size=1, max_size=3
)


@st.composite
def problems(draw):
    tables = tuple(draw(tables_st))
    pooling = draw(st.sampled_from(["sum", "mean", "none"]))
    if pooling == "none":
        D = tables[0][1]
        tables = tuple((E, D) for E, _ in tables)
    F = draw(st.integers(1, 4))
    ftm = tuple(draw(st.lists(st.integers(0, len(tables) - 1), min_size=F, max_size=F)))
    B = draw(st.integers(1, 6))
    bags = []
    for f in range(F):
        E = tables[ftm[f]][0]
        for _ in range(B):
            bags.append(draw(st.lists(st.integers(0, E - 1), max_size=7)))
    weighted = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return tables, ftm, B, bags, pooling, weighted, dtype, seed


def _batch(bags, weighted, gen):
    lengths = torch.tensor([len(b) for b in bags], dtype=torch.int64)
    offsets = torch.zeros(len(bags) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    indices = torch.tensor([i for b in bags for i in b], dtype=torch.int64)
    psw = torch.rand(len(indices), generator=gen) if weighted else None
    return harness.Batch(indices, offsets, psw)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problems())
def test_forward_and_deterministic_backward(load_ops, problem):
    tables, ftm, B, bags, pooling, weighted, dtype, seed = problem
    spec, ops = load_ops("rowwise_adagrad")
    layout = make_layout(tables, ftm)
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(bags, weighted, gen)
    weights = (torch.rand(layout.weights_numel, generator=gen) - 0.5).to(dtype)
    feats = layout.features_tensor()
    args = (feats, layout.total_D, layout.max_D)

    out = ops.forward(weights, *args, batch.indices, batch.offsets, batch.per_sample_weights, POOLING[pooling])
    ref = harness.reference_forward(layout, B, pooling, weights, batch)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)

    go = torch.randn(out.shape, generator=gen)
    results = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        w = weights.clone()
        momentum = torch.rand(layout.total_hash_size, generator=torch.Generator().manual_seed(seed))
        ops.backward(go, w, *args, layout.total_hash_size, batch.indices, batch.offsets, batch.per_sample_weights,
                     POOLING[pooling], 32, dtype != torch.float32, seed, momentum, 0.1, 1e-8, 0.0, 0, 0.0, 3)
        results.append((w, momentum))
    torch.set_num_threads(2)
    for w, m in results[1:]:
        assert torch.equal(w, results[0][0]) and torch.equal(m, results[0][1])
    _, _, touched = harness.reference_step(
        spec, layout, B, pooling, weights, {"momentum": torch.zeros(layout.total_hash_size)}, batch, go,
        harness.default_hyperparameters(spec, {}), 1,
    )
    assert torch.equal(results[0][0][~touched], weights[~touched])


def test_large_batch_backward_is_the_same_whatever_the_threads(load_ops):
    """A batch of over 100,000 indices, with a hot row of 5000 occurrences (the hypothesis test
    above draws small ones): 1, 3 and 2 threads give bitwise the same step, and that step matches
    the float64 reference."""
    spec, ops = load_ops("adagrad")
    case = harness.Case(tables=((3000, 16), (500, 8), (40000, 4)), B=8192, max_L=12, hot=5000, steps=1, seed=77)
    layout = make_layout(case.tables, case.feature_table_map)
    gen = torch.Generator().manual_seed(case.seed)
    weights, states = harness.initial_state(spec, layout, case, gen)
    batch = harness.random_batch(case, layout, gen)
    assert batch.indices.numel() > 3 * 32768
    go = torch.randn(case.B, layout.total_D, generator=gen)
    hyper = harness.default_hyperparameters(spec, {})
    results = []
    try:
        for threads in (1, 3, 2):
            torch.set_num_threads(threads)
            w, acc = weights.clone(), states["accumulator"].clone()
            ops.backward(go, w, layout.features_tensor(), layout.total_D, layout.max_D, layout.total_hash_size,
                         batch.indices, batch.offsets, None, POOLING["sum"], 32, False, 0, acc,
                         *[hyper[h.name] for h in spec.hyperparameters], 1)
            results.append((w, acc))
    finally:
        torch.set_num_threads(2)
    for w, acc in results[1:]:
        assert torch.equal(w, results[0][0]) and torch.equal(acc, results[0][1])
    ref_w, ref_states, _ = harness.reference_step(spec, layout, case.B, "sum", weights, states, batch, go, hyper, 1)
    scale = (ref_w - weights.double()).abs().max()
    assert ((results[1][0].double() - ref_w).abs().max() / scale).item() < harness.TOLERANCE[torch.float32]


def test_rows_longer_than_a_threads_share_are_updated_once(load_ops):
    """Three rows take all 60,000 occurrences, so with 2 or 3 threads each row's run crosses the
    boundary between two threads' shares of the sorted indices: the row is still summed and
    updated once, by one thread (the same bits for 1, 2 and 3 threads, and sgd's exact result)."""
    spec, ops = load_ops("sgd")
    layout = make_layout(((3, 16),))
    gen = torch.Generator().manual_seed(5)
    B, L = 3000, 20
    indices = torch.randint(0, 3, (B * L,), generator=gen)
    offsets = torch.arange(0, B * L + 1, L)
    go = torch.randn(B, 16, generator=gen)
    weights = torch.randn(layout.weights_numel, generator=gen)
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            w = weights.clone()
            ops.backward(go, w, layout.features_tensor(), 16, 16, 3, indices, offsets, None, POOLING["sum"],
                         32, False, 0, 0.5, 1)
            results.append(w)
    finally:
        torch.set_num_threads(2)
    assert all(torch.equal(w, results[0]) for w in results[1:])
    bag = torch.arange(B).repeat_interleave(L)
    grad = torch.zeros(3, 16, dtype=torch.float64).index_add_(0, indices, go.double()[bag])
    expected = weights.double().view(3, 16) - 0.5 * grad
    err = (results[0].double().view(3, 16) - expected).abs().max().item()
    assert err < 1e-2, err  # float32 sums of 20,000 terms of size 1 (the changes are about 70)


def test_keys_and_positions_beyond_64_bits_are_refused(load_ops):
    """The CPU backward sorts (key, position) packed in 64 bits: a key space too large for that
    is an error naming the sizes, and nothing is written."""
    spec, ops = load_ops("sgd")
    layout = make_layout(((4, 4),))
    w = torch.ones(layout.weights_numel)
    indices, offsets = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 4])
    with pytest.raises(RuntimeError, match="64-bit"):
        ops.backward(torch.ones(1, 4), w, layout.features_tensor(), 4, 4, 2**63 - 1, indices, offsets, None,
                     POOLING["sum"], 32, False, 0, 0.5, 1)
    assert torch.equal(w, torch.ones(layout.weights_numel))
