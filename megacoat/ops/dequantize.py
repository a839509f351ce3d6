"""Triton: FP8 dequantization, per tensor and per group. Reference: megacoat.fp8.quantize.dequantize.

x = float32(q) * scale, written in the requested dtype. A NaN scale (non-finite group) gives NaN, scale 0 gives 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.quantize_layout import DEFAULT_BLOCK, DEFAULT_WARPS, group_layout
from megacoat.ops.quantize_per_group import group_tile

TILE = (2048, 4)  # (elements, warps) per program: the best of benchmarks/bench_quant.py's sweep on an H200


@triton.jit
def _dequantize_per_group_kernel(q_ptr, scale_ptr, out_ptr, cols, n_groups, blocks_per_row,
                                 G: tl.constexpr, BLOCK_G: tl.constexpr):
    row, g, base, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
    s = tl.load(scale_ptr + row * n_groups + g, mask=g < n_groups, other=0.0)
    q = tl.load(q_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_per_tensor_kernel(q_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (q * tl.load(scale_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int | None, out_dtype: torch.dtype, *,
               block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """group_size None: one scale for the tensor; else scale (*lead, ceil(C/G)) as made by quantize_per_group."""
    q, scale = q.contiguous(), scale.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if not q.numel():
        return out
    if group_size is None:
        block = block or DEFAULT_BLOCK
        _dequantize_per_tensor_kernel[(triton.cdiv(q.numel(), block),)](
            q, scale, out, q.numel(), BLOCK=block, num_warps=num_warps or DEFAULT_WARPS)
    else:
        lay = group_layout(q.shape, group_size, block, num_warps, TILE)
        _dequantize_per_group_kernel[lay.grid](q, scale, out, lay.cols, lay.n_groups, lay.blocks_per_row,
                                               G=group_size, BLOCK_G=lay.block_g, num_warps=lay.num_warps)
    return out
