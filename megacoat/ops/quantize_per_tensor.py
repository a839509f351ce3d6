"""Triton: per-tensor FP8 quantization with the amax from group scaling's two stages.

Reference: megacoat.fp8.quantize.quantize_per_tensor. Without a given amax, stage 1 (group_amax, 1x256 groups,
1/256 of the bytes written) and stage 2 (a torch max over that) find it; the amax stays on the device, so
nothing syncs with the host. q = fp8(clamp(x * (F.max / amax))); a non-finite amax gives scale NaN and q 0; a
positive amax is raised to amax_floor first (the reference's contract).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.group_amax import group_amax, reduce_group_amax
from megacoat.ops.quantize_cast import cast_fp8
from megacoat.ops.quantize_layout import DEFAULT_BLOCK, DEFAULT_WARPS, amax_floor, fp8_max

_STAGE1_GROUP = 256


@triton.jit
def _quantize_per_tensor_kernel(x_ptr, q_ptr, amax_ptr, n, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                                BLOCK: tl.constexpr):
    amax = tl.load(amax_ptr)
    finite = amax < float("inf")  # false for inf and NaN
    amax = tl.where(amax > 0, tl.maximum(amax, AMAX_FLOOR), amax)  # F.max / amax must not overflow
    inv = tl.where(finite & (amax > 0), tl.div_rn(FP8_MAX, tl.where(amax > 0, amax, 1.0)), 0.0)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(finite, tl.clamp(x * inv, -FP8_MAX, FP8_MAX), 0.0)
    tl.store(q_ptr + offs, cast_fp8(y, q_ptr.dtype.element_ty), mask=mask)


def quantize_per_tensor(x: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None = None, *,
                        block: int | None = None, num_warps: int | None = None):
    """(q: fp8 with x's shape, scale: 0-d float32 = amax / F.max, NaN for a non-finite amax)."""
    x = x.contiguous()
    fmax = fp8_max(fp8_dtype)
    if amax is None:
        amax = reduce_group_amax(group_amax(x.reshape(-1), _STAGE1_GROUP)) if x.numel() else \
            torch.zeros((), device=x.device)
    amax = amax.reshape(()).float().contiguous()
    finite = torch.isfinite(amax)
    amax_c = torch.where(amax > 0, amax.clamp(min=amax_floor(fp8_dtype)), amax)
    scale = torch.where(finite, amax_c / torch.full_like(amax, fmax), torch.full_like(amax, float("nan")))
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    if x.numel():
        block = block or DEFAULT_BLOCK
        _quantize_per_tensor_kernel[(triton.cdiv(x.numel(), block),)](
            x, q, amax, x.numel(), FP8_MAX=fmax, AMAX_FLOOR=amax_floor(fp8_dtype), BLOCK=block,
            num_warps=num_warps or DEFAULT_WARPS)
    return q, scale
