"""COAT's dynamic range expansion of the optimizer moments: the idea, and the one entry to its arithmetic.

Per 1xG group of a moment (megacoat.coat.group_scaling), with amax and amin over its non-zero magnitudes and F the
FP8 format, each value is stored as f(x) = sign(x) |x|^k scaled by max|f| / F.max, with
    k = log2(F.max / F.min_subnormal) / log2(amax / amin), clamped to [K_MIN, K_MAX] and rounded to bf16,
so that the group's range fills F's; k = 1 (plain group scaling) where a group has no spread, and everywhere with
CoatAdamW(expand=False). The arithmetic runs fused in the optimizer step (megacoat.ops.coat_adamw), tested against
its torch reference (megacoat.ops.coat_adamw_ref, which states the exact rounding); quantize_moment and
dequantize_moment are that reference for one flat tensor (a checkpoint's conversion to or from AdamW).
"""
from __future__ import annotations

import torch

from megacoat.ops.coat_adamw_ref import dequantize_moment_ref, quantize_moment_ref
from megacoat.ops.numerics import K_MAX, K_MIN

__all__ = ["K_MAX", "K_MIN", "dequantize_moment", "quantize_moment"]


def quantize_moment(x: torch.Tensor, fp8_dtype: torch.dtype, group_size: int, expand: bool = True):
    """Flat x → (q FP8, scale float32 per group, k bf16 per group, number of non-finite groups)."""
    return quantize_moment_ref(x, fp8_dtype, group_size, expand)


def dequantize_moment(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 moment that quantize_moment's (q, scale, k) store."""
    return dequantize_moment_ref(q, scale, k, group_size)
