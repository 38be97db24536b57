"""The pooled forward of narrow rows on CUDA (`pytest -m cuda`; skipped without a GPU).

When no row of a module is wider than 64 columns, the forward pools a bag per group of lanes
(forward_bag_groups_kernel, templates/include/tbegen/cuda_kernels.cuh) instead of a warp per bag
(forward_kernel, which TBEGEN_FORWARD_BAG_GROUPS=0 keeps). Both must give the float64 reference's
sums to rounding, the same output from run to run (bitwise), zeros for empty bags, and the same
error for a bad index; the group widths 1 to 16 lanes (rows of 4 to 64 columns) are each covered.
"""

import pytest
import torch

import tbegen

pytestmark = pytest.mark.cuda

SHAPES = [
    # (tables, batch, longest bag): one group width each, then mixed widths in one module
    ([(50, 4), (70, 4)], 65, 9),  # 1 lane per bag: 32 bags a warp
    ([(90, 8)], 33, 40),  # 2 lanes
    ([(300, 16), (40, 12)], 31, 17),  # 4 lanes
    ([(200, 32), (30, 20)], 70, 100),  # 8 lanes, bags of up to 100 indices
    ([(100, 64), (100, 36), (8, 4)], 17, 33),  # 16 lanes
    ([(300, 8), (100, 20), (50, 64), (40, 4)], 129, 25),
]


def _batch(tables, B, max_L, gen, index_dtype):
    bags, weights = [], []
    for rows, _ in tables:
        for b in range(B):
            L = 0 if b % 5 == 3 else int(torch.randint(0, max_L + 1, (1,), generator=gen))  # some empty bags
            bags.append(torch.randint(0, rows, (L,), generator=gen))
    offsets = torch.tensor([0] + [len(x) for x in bags]).cumsum(0)
    indices = torch.cat(bags)
    psw = torch.rand(indices.numel(), generator=gen) + 0.5
    return indices.to(index_dtype), offsets.to(index_dtype), psw


def _reference(emb, tables, B, indices, offsets, psw, mean):
    """float64 pooled sums per (bag, table), from the module's own weights."""
    out = torch.zeros(B, sum(d for _, d in tables), dtype=torch.float64)
    weights = [w.detach().to("cpu", torch.float64) for w in emb.split_embedding_weights()]
    col = 0
    for t, (_, d) in enumerate(tables):
        for b in range(B):
            lo, hi = int(offsets[t * B + b]), int(offsets[t * B + b + 1])
            if hi > lo:
                rows = weights[t][indices[lo:hi].long()]
                s = (rows * (psw[lo:hi, None].double() if psw is not None else 1.0)).sum(0)
                out[b, col:col + d] = s / (hi - lo) if mean else s
        col += d
    return out


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_bag_groups_forward_matches_reference_and_warp_kernel(monkeypatch, shape, dtype, pooling, weighted):
    tables, B, max_L = SHAPES[shape]
    gen = torch.Generator().manual_seed(100 + shape)
    emb = tbegen.TableBatchedEmbeddingBags(tables, optimizer="sgd", pooling=pooling, weights_dtype=dtype,
                                           device="cuda", learning_rate=0.1, seed=shape)
    index_dtype = torch.int32 if shape % 2 else torch.int64
    indices, offsets, psw = _batch(tables, B, max_L, gen, index_dtype)
    psw = psw if weighted else None
    args = (indices.cuda(), offsets.cuda(), None if psw is None else psw.cuda())
    with torch.no_grad():
        groups = emb(*args).cpu()
        again = emb(*args).cpu()
        monkeypatch.setenv("TBEGEN_FORWARD_BAG_GROUPS", "0")
        warp = emb(*args).cpu()
    emb.check_errors()
    assert torch.equal(groups, again), "the bag-groups forward is not deterministic"
    ref = _reference(emb, tables, B, indices, offsets, psw, pooling == "mean")
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    scale = ref.abs().max().item() + 1e-12
    assert (groups.double() - ref).abs().max().item() / scale < tol
    assert (warp.double() - ref).abs().max().item() / scale < tol
    # the empty bags are zeros in both
    col = 0
    for t, (_, d) in enumerate(tables):
        for b in range(B):
            if int(offsets[t * B + b]) == int(offsets[t * B + b + 1]):
                assert not groups[b, col:col + d].any() and not warp[b, col:col + d].any()
        col += d


def test_bag_groups_forward_reports_a_bad_index():
    tables = [(40, 8), (30, 16)]
    emb = tbegen.TableBatchedEmbeddingBags(tables, optimizer="sgd", device="cuda", learning_rate=0.1)
    gen = torch.Generator().manual_seed(5)
    indices, offsets, _ = _batch(tables, 20, 6, gen, torch.int64)
    indices[int(offsets[25])] = 40_000  # in table 1's bags: out of range
    with pytest.raises(RuntimeError, match="out of range"):
        emb(indices.cuda(), offsets.cuda())
        emb.check_errors()
