"""Triton: FP8 dequantization, per tensor and per group. Reference: megacoat.fp8.quantize.dequantize.

x = float32(q) * scale, written in the requested dtype. A NaN scale (non-finite group) gives NaN, scale 0 gives 0.
Per group, the tile is cut in 16-byte output vectors (quantize_per_group.group_tile_vec) so the FP8 load and the
store share a layout: the plain tile (`vec=0`, session 2) exchanged it through shared memory (2-8 KB per program).
Static SASS (Triton 3.6, 4096 x 4): 5.9 / 5.7 instructions per element for float32 / bf16 out, was 7.4 / 7.1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.quantize_layout import DEFAULT_BLOCK, DEFAULT_WARPS, group_layout, vector_tile
from megacoat.ops.quantize_per_group import group_tile, group_tile_vec

TILE = (2048, 4)  # (elements, warps) per program: the best of benchmarks/bench_quant.py's sweep on an H200


@triton.jit
def _dequantize_per_group_kernel(q_ptr, scale_ptr, out_ptr, cols, n_groups, blocks_per_row,
                                 G: tl.constexpr, BLOCK_G: tl.constexpr, VEC: tl.constexpr, LANES: tl.constexpr):
    if VEC:  # see expand_dequantize: load and store in one layout, no shared-memory exchange of the tile
        row, g, base, offs, mask = group_tile_vec(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G, VEC, LANES)
        s = tl.load(scale_ptr + row * n_groups + g, mask=g < n_groups, other=0.0)[None, :, None, None]
    else:
        row, g, base, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
        s = tl.load(scale_ptr + row * n_groups + g, mask=g < n_groups, other=0.0)[:, None]
    q = tl.load(q_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + offs, (q * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_per_tensor_kernel(q_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (q * tl.load(scale_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int | None, out_dtype: torch.dtype, *,
               vec: int | None = None, block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """group_size None: one scale for the tensor; else scale (*lead, ceil(C/G)) as made by quantize_per_group.
    vec (per group): elements per vector of the tile, default 16 bytes of out_dtype; 0 = the session-2 tile."""
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
        vec, lanes = vector_tile(out_dtype, group_size, vec)
        _dequantize_per_group_kernel[lay.grid](q, scale, out, lay.cols, lay.n_groups, lay.blocks_per_row,
                                               G=group_size, BLOCK_G=lay.block_g, VEC=vec, LANES=lanes,
                                               num_warps=lay.num_warps)
    return out
