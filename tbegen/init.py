"""The module's default weight initialisation: a counter-based generator.

Every weight is a pure function of (seed, table, element index): a keyed integer hash of the
element index, turned into a float by one correctly rounded step. It is computed on the module's
device (no weights are drawn on the CPU and copied), and CPU and CUDA give bitwise the same
weights by construction:

- the hash is exact integer arithmetic modulo 2**32. On a GPU it runs as torch int64 operations
  whose values stay in [0, 2**49), so none overflows (a 32 x 32-bit product that would not fit in
  int64 is split into 16-bit halves); on the CPU it runs as numpy uint32 operations, which wrap
  modulo 2**32 by definition (and are faster there). Both equal the Python-int reference
  `element_bits` (tests/test_init.py checks all three against each other);
- the float is (a 24-bit integer - 2**23) converted to float32, which is exact, times
  float32(sqrt(1/dim)) * 2**-23: a single IEEE multiplication, correctly rounded on every device;
- rounding to float16/bfloat16 is a correctly rounded conversion on every device.

The values are uniform on [-sqrt(1/dim), sqrt(1/dim)) in steps of sqrt(1/dim) * 2**-23.

The hash is Chris Wellons' "lowbias32" 32-bit mixer, applied twice with keys derived from (seed,
table, the element index's high 32 bits) by splitmix64's finaliser (computed in Python).
"""

from __future__ import annotations

import math
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# lowbias32's multipliers: the first is below 2**31 (x * it < 2**63 for x < 2**32), the second
# is not and is multiplied in two 16-bit halves
_M1 = 0x7FEB352D
_M2_LO, _M2_HI = 0x846CA68B & 0xFFFF, 0x846CA68B >> 16
# elements per chunk: large enough that per-operation overhead vanishes on a GPU, small enough
# that a CPU chunk's temporaries stay in cache
_CHUNK = {"cpu": 1 << 16, "cuda": 1 << 24}


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def block_keys(seed: int, table: int, block: int) -> tuple:
    """The two 32-bit keys of elements [block * 2**32, (block + 1) * 2**32) of one table."""
    z = _splitmix64(seed & _MASK64)
    z = _splitmix64(z ^ table)
    z = _splitmix64(z ^ block)
    return z & _MASK32, z >> 32


def lowbias32(x: int) -> int:
    """The 32-bit mixer on a Python int (the reference the tensor version is tested against)."""
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * (_M2_HI << 16 | _M2_LO)) & _MASK32
    return x ^ (x >> 16)


def element_bits(seed: int, table: int, element: int) -> int:
    """The 32 random bits of one element (Python ints; the reference of `_hash_`)."""
    k1, k2 = block_keys(seed, table, element >> 32)
    return lowbias32(lowbias32((element & _MASK32) ^ k1) ^ k2)


def _lowbias32_torch_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """x = lowbias32(x), in place, for int64 x in [0, 2**32); tmp is scratch of x's shape."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(_M1).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    # x * M2 mod 2**32 = x * lo + ((x * hi) mod 2**16) * 2**16, every term below 2**49
    torch.mul(x, _M2_HI, out=tmp).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    x.mul_(_M2_LO).add_(tmp).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def _centred_torch(x: torch.Tensor, k1: int, k2: int) -> torch.Tensor:
    """The top 24 random bits - 2**23 of int64 element indices x in [0, 2**32), in place."""
    tmp = torch.empty_like(x)
    x.bitwise_xor_(k1)
    _lowbias32_torch_(x, tmp)
    x.bitwise_xor_(k2)
    _lowbias32_torch_(x, tmp)
    return x.bitwise_right_shift_(8).sub_(1 << 23)


def _lowbias32_numpy_(x: np.ndarray, tmp: np.ndarray) -> None:
    """x = lowbias32(x), in place, for uint32 x (numpy's uint32 arithmetic is exact mod 2**32)."""
    x ^= np.right_shift(x, 16, out=tmp)
    np.multiply(x, np.uint32(_M1), out=x)
    x ^= np.right_shift(x, 15, out=tmp)
    np.multiply(x, np.uint32(_M2_HI << 16 | _M2_LO), out=x)
    x ^= np.right_shift(x, 16, out=tmp)


def _centred_numpy(x: np.ndarray, k1: int, k2: int) -> np.ndarray:
    """The same for uint32 element indices x, in place; returns them as int32."""
    tmp = np.empty_like(x)
    x ^= np.uint32(k1)
    _lowbias32_numpy_(x, tmp)
    x ^= np.uint32(k2)
    _lowbias32_numpy_(x, tmp)
    np.right_shift(x, 8, out=x)
    centred = x.view(np.int32)
    centred -= np.int32(1 << 23)
    return centred


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _fill_chunk_(out: torch.Tensor, first: int, seed: int, table: int, scale: float) -> None:
    """Elements first .. first+len(out)-1 of one table (inside one 2**32 block)."""
    k1, k2 = block_keys(seed, table, first >> 32)
    low, n = first & _MASK32, out.numel()
    if out.device.type == "cpu":
        centred = _centred_numpy(np.arange(low, low + n, dtype=np.uint32), k1, k2)
        values = torch.from_numpy(centred.astype(np.float32) * np.float32(scale))
    else:
        centred = _centred_torch(torch.arange(low, low + n, dtype=torch.int64, device=out.device), k1, k2)
        values = centred.to(torch.float32).mul_(scale)
    out.copy_(values)


def fill_uniform_(out: torch.Tensor, seed: int, table: int, dim: int, first: int = 0) -> torch.Tensor:
    """Fills the flat tensor `out` (one table, dim columns; or its elements first, first + 1, ...:
    int8 tables are filled a few rows at a time) with its initial weights:
    uniform(-sqrt(1/dim), sqrt(1/dim)), a pure function of (seed, table, element index).

    On the CPU the work is split over torch's intra-op thread count (numpy releases the GIL)."""
    n = out.numel()
    # float32(bound) * 2**-23 is exact, so the multiplication below rounds once, in float32
    scale = _float32(math.sqrt(1.0 / dim)) * 2.0**-23
    chunk = _CHUNK.get(out.device.type, _CHUNK["cuda"])  # a power of two below 2**32
    starts = range(0, n, chunk)

    def fill(s: int) -> None:
        end = min(s + chunk, n)
        # (a chunk that straddles a 2**32 block of element indices, possible when first > 0, is
        # filled in its two parts)
        cut = min(end, (((first + s) >> 32) + 1 << 32) - first)
        _fill_chunk_(out[s:cut], first + s, seed, table, scale)
        if cut < end:
            _fill_chunk_(out[cut:end], first + cut, seed, table, scale)

    threads = torch.get_num_threads() if out.device.type == "cpu" else 1
    if threads > 1 and len(starts) > 1:
        with ThreadPoolExecutor(min(threads, len(starts))) as pool:
            list(pool.map(fill, starts))
    else:
        for s in starts:
            fill(s)
    return out
