"""Triton: FP8 dequantization with dynamic range expansion's inverse. Reference: megacoat.fp8.expansion.

x = sign(q) * (F.max * scale) * exp2(log2(|q| * fp32(1/F.max)) * (1/k)), 1/k once per group, libdevice
log2/exp2, the reference's float32 operation order. k == 1 skips the pow. A NaN scale gives NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from megacoat.ops import expand_math

from megacoat.ops.quantize_layout import fp8_max, group_layout
from megacoat.ops.quantize_per_group import group_tile


@triton.jit
def _expand_dequantize_kernel(q_ptr, scale_ptr, k_ptr, out_ptr, cols, n_groups, blocks_per_row,
                              FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, G: tl.constexpr,
                              BLOCK_G: tl.constexpr):
    row, g, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
    gmask = g < n_groups
    s = tl.load(scale_ptr + row * n_groups + g, mask=gmask, other=0.0)
    kf = tl.load(k_ptr + row * n_groups + g, mask=gmask, other=1.0).to(tl.float32)
    inv_k = tl.div_rn(tl.full(kf.shape, 1.0, tl.float32), kf)
    m = s * FP8_MAX
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rq = tl.abs(q) * INV_FP8_MAX
    e = tl.where(kf[:, None] == 1.0, rq, expand_math.exp2(expand_math.log2(rq) * inv_k[:, None]))
    out = e * m[:, None]
    out = tl.where(q < 0, -out, out)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def expand_dequantize(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, group_size: int,
                      out_dtype: torch.dtype, *, block: int | None = None, num_warps: int | None = None):
    q, scale, k = q.contiguous(), scale.contiguous(), k.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lay = group_layout(q.shape, group_size, block, num_warps)
    if q.numel():
        fmax = fp8_max(q.dtype)
        _expand_dequantize_kernel[lay.grid](q, scale, k, out, lay.cols, lay.n_groups, lay.blocks_per_row,
                                            FP8_MAX=fmax, INV_FP8_MAX=1.0 / fmax, G=group_size,
                                            BLOCK_G=lay.block_g, num_warps=lay.num_warps)
    return out
