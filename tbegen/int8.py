"""int8 rows: the layout and arithmetic of `weights_dtype="int8"` tables, in torch.

A table of int8 rows is stored as uint8: each row is its D codes q (one byte each) followed by its
quantization parameters, a float32 scale and a float32 bias (8 bytes, little-endian), D + 8 bytes
in all; the row's values are w = scale * q + bias. Rows are packed, so in the module's flat buffer
the row of linear key k whose per-element states start at element offset o starts at byte
o + 8 * k (docs/layout.md, "int8 rows"; templates/include/tbegen/common.h).

The kernels quantize a row after every update, from its min and max:
scale = (max - min) / 255, bias = min, q = round-to-nearest-even((w - bias) / scale) clamped to
0..255 (all codes 0 when max == min). `quantize_rows` does the same float32 arithmetic, so that
the module's initial weights, loaded float weights and the references of the tests are quantized
exactly as the kernels quantize.
"""

from __future__ import annotations

import torch

QPARAM_BYTES = 8  # float32 scale, float32 bias, after each row's codes


def quantize_rows(w: torch.Tensor) -> torch.Tensor:
    """float [E, D] -> uint8 [E, D + 8]: each row's codes, then its scale and bias (float32)."""
    if w.dim() != 2 or w.size(1) < 1:
        raise ValueError(f"tbegen: quantize_rows takes a [rows, dim] tensor, got shape {tuple(w.shape)}")
    w = w.to(torch.float32)
    lo = w.amin(dim=1, keepdim=True) if w.size(0) else w[:, :1]
    hi = w.amax(dim=1, keepdim=True) if w.size(0) else w[:, :1]
    # (divided by a tensor, not the number 255: torch on CUDA divides by a Python number as a
    # multiplication by its reciprocal, which can differ from the kernels' division by one ulp)
    scale = (hi - lo) / torch.full_like(hi, 255.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((w - lo) / safe).clamp_(0, 255)  # torch.round: ties to even
    codes = torch.where(scale > 0, codes, torch.zeros_like(codes))
    return torch.cat([codes.to(torch.uint8), scale.contiguous().view(torch.uint8), lo.contiguous().view(torch.uint8)], dim=1)


def qparams(rows: torch.Tensor) -> tuple:
    """uint8 [E, D + 8] -> (scale [E], bias [E]), float32."""
    D = rows.size(1) - QPARAM_BYTES
    scale = rows[:, D : D + 4].contiguous().view(torch.float32).reshape(-1)
    bias = rows[:, D + 4 :].contiguous().view(torch.float32).reshape(-1)
    return scale, bias


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [E, D + 8] -> [E, D]: scale * q + bias, computed in float64 (exact product; the
    kernels' fused multiply-add agrees with its rounding to float32 but for rare double-rounding
    ties) and returned in `dtype`."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.size(1) <= QPARAM_BYTES:
        raise ValueError(f"tbegen: dequantize_rows takes uint8 [rows, dim + 8], got {rows.dtype} {tuple(rows.shape)}")
    D = rows.size(1) - QPARAM_BYTES
    scale, bias = qparams(rows)
    w = scale.double()[:, None] * rows[:, :D].double() + bias.double()[:, None]
    return w.to(dtype)
