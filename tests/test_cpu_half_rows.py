"""fp16 and bf16 rows on the CPU: the vector paths widen them as they load them.

The CPU forward pools fp16/bf16 rows in float vectors (cpu_simd.h, load_floats: F16C's conversion
for fp16, a 16-bit shift for bf16) and the backward makes a row's float copy the same way
(to_floats). Both conversions are exact, so a module with fp16 (bf16) weights must give, bit for
bit, what a float32 module holding the same values gives: the same pooled output, and after a
training step (rounding to nearest, no stochastic rounding) the float32 module's weights rounded
to fp16 (bf16). Row widths cover each vector width (16, 8, 4 floats), chunks of 1-4 vectors, and
widths that take the plain loop (not a multiple of 4).
"""

import pytest
import torch

import tbegen

TABLES = [(300, 64), (200, 16), (150, 8), (120, 4), (100, 80), (90, 24), (80, 7), (60, 12)]


def _batch(B, gen):
    bags = []
    for rows, _ in TABLES:
        for b in range(B):
            L = 0 if b % 7 == 3 else int(torch.randint(1, 30, (1,), generator=gen))
            bags.append(torch.randint(0, rows, (L,), generator=gen))
    offsets = torch.tensor([0] + [len(x) for x in bags]).cumsum(0)
    indices = torch.cat(bags)
    psw = torch.rand(indices.numel(), generator=gen) + 0.5
    return indices, offsets, psw


def _pair(dtype, optimizer, pooling):
    """A dtype module and a float32 module with the same (exactly widened) weights."""
    hp = dict(learning_rate=0.05) if optimizer == "sgd" else dict(learning_rate=0.05, eps=1e-8)
    half = tbegen.TableBatchedEmbeddingBags(TABLES, optimizer=optimizer, pooling=pooling, weights_dtype=dtype,
                                            stochastic_rounding=False, device="cpu", **hp)
    full = tbegen.TableBatchedEmbeddingBags(TABLES, optimizer=optimizer, pooling=pooling, weights_dtype=torch.float32,
                                            device="cpu", **hp)
    gen = torch.Generator().manual_seed(5)
    for wh, wf in zip(half.split_embedding_weights(), full.split_embedding_weights()):
        values = (torch.rand(wh.shape, generator=gen) - 0.5).to(dtype)
        wh.copy_(values)
        wf.copy_(values.float())
    return half, full


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_rows_forward_and_step_match_float32_bitwise(dtype, pooling, weighted):
    B = 37
    half, full = _pair(dtype, "rowwise_adagrad", pooling)
    gen = torch.Generator().manual_seed(11)
    for step in range(3):
        indices, offsets, psw = _batch(B, gen)
        psw = psw if weighted else None
        out_h = half(indices, offsets, psw)
        out_f = full(indices, offsets, psw)
        assert out_h.dtype == torch.float32
        assert torch.equal(out_h, out_f), (
            f"step {step}: the {dtype} forward differs from float32's on the same values "
            f"(max diff {(out_h - out_f).abs().max().item():.3g})")
        grad = torch.randn(out_h.shape, generator=gen)
        out_h.backward(grad)
        out_f.backward(grad)
        half.check_errors()
        full.check_errors()
        # the float32 module's new weights, rounded to nearest, become the dtype module's weights
        for t, (wh, wf) in enumerate(zip(half.split_embedding_weights(), full.split_embedding_weights())):
            assert torch.equal(wh, wf.to(dtype)), f"step {step}, table {t} (dim {TABLES[t][1]}): updated rows differ"
            wf.copy_(wh.float())  # (both continue from the same values)
        momentum_h = dict(half.named_buffers())["states.momentum"]
        momentum_f = dict(full.named_buffers())["states.momentum"]
        assert torch.equal(momentum_h, momentum_f), f"step {step}: the per-row states differ"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_rows_forward_no_grad_across_threads(dtype):
    """The vector path gives the same pooled rows at 1 and 2 threads (each bag summed by one thread)."""
    half, _ = _pair(dtype, "sgd", "sum")
    indices, offsets, psw = _batch(53, torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = half(indices, offsets, psw)
            torch.set_num_threads(2)
            two = half(indices, offsets, psw)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


# ---- stochastic rounding: the vector form against the scalar formula (common.h) -------------------

_M64 = (1 << 64) - 1


def _random_bits(seed, step, keys, D):
    """common.h's random_bits(seed, step, key, d) for keys (numpy int64, one per row) and d < D."""
    import numpy as np

    z = (seed * 0x9E3779B97F4A7C15) & _M64
    z ^= (step + 0x632BE59BD9B4E019 + ((z << 6) & _M64) + (z >> 2)) & _M64
    with np.errstate(over="ignore"):
        k = keys.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
        zz = np.uint64(z) ^ (k + np.uint64(((z << 6) & _M64)) + np.uint64(z >> 2))
        zz = (zz ^ (zz >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        zz = (zz ^ (zz >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        zz ^= zz >> np.uint64(31)
        row = ((zz >> np.uint64(32)) ^ (zz & np.uint64(0xFFFFFFFF))).astype(np.uint32)
        d = np.arange(D, dtype=np.uint32) * np.uint32(0x9E3779B9)
        h = row[:, None] ^ d[None, :]
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def _stochastic_round(x, bits, dtype):
    """Half16Traits<dtype>::round(x, bits, true) (common.h), elementwise, in torch."""
    nearest = x.to(dtype)
    n = nearest.float()
    nb = nearest.view(torch.int16).to(torch.int32) & 0xFFFF
    up = n < x
    negative = (nb & 0x8000) != 0
    zero = (nb & 0x7FFF) == 0
    ob = torch.where(zero, torch.where(up, 0x0001, 0x8001), torch.where(up != negative, nb + 1, nb - 1)) & 0xFFFF
    other = ob.to(torch.int16).view(dtype)
    o = other.float()
    u = torch.from_numpy((bits >> 8).astype("float32")) * (1.0 / 16777216.0)
    take = u * (o - n).abs() < (x - n).abs()
    keep = (n == x) | ~(n.abs() <= 3.0e38) | ~(o.abs() <= 3.0e38) | ~take
    return torch.where(keep, nearest, other)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_rows_stochastic_rounding_matches_the_scalar_formula(dtype):
    """With stochastic rounding, each updated row is rounded as common.h's scalar formula rounds it,
    bit for bit, for columns in vectors of 16 and for the columns after them (rows of 4-80)."""
    import numpy as np

    hp = dict(learning_rate=0.05, eps=1e-8)
    half = tbegen.TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", weights_dtype=dtype,
                                            stochastic_rounding=True, device="cpu", seed=1234, **hp)
    full = tbegen.TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", weights_dtype=torch.float32,
                                            device="cpu", **hp)
    gen = torch.Generator().manual_seed(9)
    for wh, wf in zip(half.split_embedding_weights(), full.split_embedding_weights()):
        values = (torch.rand(wh.shape, generator=gen) - 0.5).to(dtype)
        wh.copy_(values)
        wf.copy_(values.float())
    key_base = np.cumsum([0] + [rows for rows, _ in TABLES])
    rounded_up = 0
    for step in range(2):
        indices, offsets, _ = _batch(29, gen)
        out_h = half(indices, offsets)
        out_f = full(indices, offsets)
        grad = torch.randn(out_h.shape, generator=gen)
        out_h.backward(grad)
        out_f.backward(grad)
        for t, (wh, wf) in enumerate(zip(half.split_embedding_weights(), full.split_embedding_weights())):
            rows, D = TABLES[t]
            bits = _random_bits(half.seed, half.step, np.arange(rows) + key_base[t], D)
            expected = _stochastic_round(wf.detach(), bits, dtype)
            assert torch.equal(wh.view(torch.int16), expected.view(torch.int16)), (
                f"step {step + 1}, table {t} (dim {D}): {int((wh.view(torch.int16) != expected.view(torch.int16)).sum())} "
                f"weights rounded differently from the scalar formula")
            rounded_up += int((expected != wf.detach().to(dtype)).sum())
            wf.copy_(wh.float())
    assert rounded_up > 0, "no weight was rounded away from nearest: the test would not see a wrong draw"
