"""The default weight initialisation (tbegen/init.py): a pure function of (seed, table, element),
the same from the numpy (CPU), torch int64 (GPU) and Python-int implementations, uniform on
[-sqrt(1/dim), sqrt(1/dim)), and bitwise the same on CPU and CUDA modules."""

import math

import numpy as np
import pytest
import torch

from tbegen import init


def _expected(seed, table, dim, elements):
    """The reference: Python ints and one float32 multiplication per element."""
    scale = np.float32(init._float32(math.sqrt(1.0 / dim)) * 2.0**-23)
    centred = [(init.element_bits(seed, table, e) >> 8) - (1 << 23) for e in elements]
    return torch.from_numpy(np.array(centred, dtype=np.float32) * scale)


def _pieces(first, n):
    """[first, first + n) cut at multiples of 2**32 (a chunk of fill_uniform_ never straddles one)."""
    while n > 0:
        m = min(n, ((first >> 32) + 1 << 32) - first)
        yield first, m
        first, n = first + m, n - m


def _via_torch_int64(first, n, seed, table, scale):
    out = []
    for lo, m in _pieces(first, n):
        k1, k2 = init.block_keys(seed, table, lo >> 32)
        x = torch.arange(lo & init._MASK32, (lo & init._MASK32) + m, dtype=torch.int64)
        out.append(init._centred_torch(x, k1, k2).to(torch.float32) * scale)
    return torch.cat(out)


def _via_numpy(first, n, seed, table, scale):
    out = torch.empty(n)
    for lo, m in _pieces(first, n):
        init._fill_chunk_(out[lo - first : lo - first + m], lo, seed, table, scale)
    return out


@pytest.mark.parametrize("seed", [0, 7, -3, 2**63 - 1])
def test_numpy_and_torch_int64_paths_match_the_python_reference(seed):
    scale = init._float32(math.sqrt(1.0 / 24)) * 2.0**-23
    # across a 2**32 element boundary too: the high word of the index selects the keys
    for first in (0, 12345, 2**32 - 1000):
        n = 2000
        via_numpy = _via_numpy(first, n, seed, 3, scale)
        assert torch.equal(via_numpy, _via_torch_int64(first, n, seed, 3, scale))
        sample = list(range(0, n, 97)) + [999, 1000, n - 1]
        assert torch.equal(via_numpy[sample], _expected(seed, 3, 24, [first + i for i in sample]))


def test_fill_is_a_pure_function_of_seed_table_and_element():
    a = init.fill_uniform_(torch.empty(300_000), seed=5, table=2, dim=64)
    # the same elements, filled with a different chunking and thread count
    old_chunk, old_threads = init._CHUNK["cpu"], torch.get_num_threads()
    try:
        init._CHUNK["cpu"] = 1 << 12
        torch.set_num_threads(1)
        b = init.fill_uniform_(torch.empty(300_000), seed=5, table=2, dim=64)
    finally:
        init._CHUNK["cpu"] = old_chunk
        torch.set_num_threads(old_threads)
    assert torch.equal(a, b)
    assert torch.equal(a[[0, 1, 65535, 65536, 299_999]], _expected(5, 2, 64, [0, 1, 65535, 65536, 299_999]))
    # another seed or table gives other weights (and not a permutation of the same values)
    for other in (init.fill_uniform_(torch.empty(300_000), seed=6, table=2, dim=64),
                  init.fill_uniform_(torch.empty(300_000), seed=5, table=3, dim=64)):
        assert not torch.equal(a.sort().values, other.sort().values)


def test_distribution_is_uniform_within_the_bound():
    dim = 32
    bound = math.sqrt(1.0 / dim)
    w = init.fill_uniform_(torch.empty(1 << 20), seed=1, table=0, dim=dim).double()
    assert w.min() >= -bound and w.max() < bound
    assert abs(w.mean()) < 3 * bound / math.sqrt(3 * w.numel()) * 2
    assert abs(w.std() - bound / math.sqrt(3)) < 1e-3 * bound
    counts = torch.histc(w, bins=16, min=-bound, max=bound)
    expected = w.numel() / 16
    # chi-square with 15 degrees of freedom: 40 is beyond its 99.9th percentile
    assert ((counts - expected) ** 2 / expected).sum() < 40
    # neighbouring elements are uncorrelated
    assert abs(torch.corrcoef(torch.stack([w[:-1], w[1:]]))[0, 1]) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_module_weights_are_the_counter_based_init(dtype):
    import tbegen

    emb = tbegen.TableBatchedEmbeddingBags([(50, 8), (30, 16)], optimizer="sgd", weights_dtype=dtype, seed=9)
    for t, (E, D) in enumerate(emb.tables):
        expected = init.fill_uniform_(torch.empty(E * D), 9, t, D).to(dtype).view(E, D)
        assert torch.equal(emb.split_embedding_weights()[t], expected)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_and_cuda_modules_start_bitwise_identical(dtype):
    import tbegen

    tables = [(1000, 128), (3, 4), (70_001, 64)]
    for seed in (0, 123, -5):
        cpu = tbegen.TableBatchedEmbeddingBags(tables, optimizer="sgd", weights_dtype=dtype, seed=seed, device="cpu")
        gpu = tbegen.TableBatchedEmbeddingBags(tables, optimizer="sgd", weights_dtype=dtype, seed=seed, device="cuda")
        assert gpu.weights.is_cuda
        assert torch.equal(cpu.weights.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           gpu.weights.cpu().view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.cuda
def test_cuda_init_crosses_a_block_boundary_like_the_cpu():
    # elements around 2**32 of a table, through the torch int64 path on the GPU
    n, first = 4096, 2**32 - 2048
    scale = init._float32(math.sqrt(1.0 / 8)) * 2.0**-23
    on_gpu = torch.empty(n, device="cuda")
    on_cpu = torch.empty(n)
    for lo in (first, 2**32):
        init._fill_chunk_(on_gpu[lo - first : lo - first + 2048], lo, 4, 1, scale)
        init._fill_chunk_(on_cpu[lo - first : lo - first + 2048], lo, 4, 1, scale)
    assert torch.equal(on_gpu.cpu(), on_cpu)
