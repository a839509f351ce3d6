"""Triton: per-group (1xG) FP8 quantization. Reference: megacoat.fp8.quantize.quantize_per_group.

One pass: read a tile of groups, amax per group, scale = amax / F.max, q = fp8(clamp(x * (F.max / amax))), a
positive amax raised to amax_floor first (the reference's contract).
NaN/Inf in a group: scale NaN, q 0 (the reference's contract). Divisions are tl.div_rn (IEEE), as in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.quantize_cast import cast_fp8
from megacoat.ops.quantize_layout import amax_floor, fp8_max, group_layout, group_scale_shape

TILE = (4096, 4)  # (elements, warps) per program: the best of benchmarks/bench_quant.py's sweep on an H200


@triton.jit
def group_tile(pid, blocks_per_row, cols, G: tl.constexpr, BLOCK_G: tl.constexpr):
    """The [BLOCK_G, G] tile program `pid` owns: (row, its group indices in the row (int64), base offset (int64
    scalar), in-tile offsets (int32), mask). 64-bit math once per program, 32-bit per element."""
    row = (pid // blocks_per_row).to(tl.int64)
    start = (pid % blocks_per_row).to(tl.int64) * (BLOCK_G * G)
    g = start // G + tl.arange(0, BLOCK_G)
    local = tl.arange(0, BLOCK_G)[:, None] * G + tl.arange(0, G)[None, :]
    remaining = tl.minimum(cols - start, BLOCK_G * G).to(tl.int32)
    return row, g, row * cols + start, local, local < remaining


@triton.jit
def group_tile_vec(pid, blocks_per_row, cols, G: tl.constexpr, BLOCK_G: tl.constexpr, VEC: tl.constexpr,
                   LANES: tl.constexpr):
    """group_tile with the tile shaped [LANES, BLOCK_G, G / (VEC * LANES), VEC]: a group is split in chunks of
    VEC contiguous elements, LANES consecutive chunks side by side across lanes and the rest repeated in each
    thread. Memory ops then move VEC elements per thread at a time, so an FP8 load and a store of 16-byte
    vectors (VEC 8 for bf16, 4 for float32) share one register layout instead of exchanging the tile through
    shared memory, and each thread's elements lie in one group (its per-group scalars are computed once for
    G / LANES elements). Lanes come first because Triton orders equally-contiguous dims as given. Per-group
    values broadcast as v[None, :, None, None]."""
    row = (pid // blocks_per_row).to(tl.int64)
    start = (pid % blocks_per_row).to(tl.int64) * (BLOCK_G * G)
    g = start // G + tl.arange(0, BLOCK_G)
    REPS: tl.constexpr = G // (VEC * LANES)
    local = (tl.arange(0, LANES)[:, None, None, None] * VEC + tl.arange(0, BLOCK_G)[None, :, None, None] * G
             + tl.arange(0, REPS)[None, None, :, None] * (LANES * VEC) + tl.arange(0, VEC)[None, None, None, :])
    remaining = tl.minimum(cols - start, BLOCK_G * G).to(tl.int32)
    return row, g, row * cols + start, local, local < remaining


@triton.jit
def _quantize_per_group_kernel(x_ptr, q_ptr, scale_ptr, cols, n_groups, blocks_per_row,
                               FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, G: tl.constexpr,
                               BLOCK_G: tl.constexpr):
    row, g, base, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=1)
    finite = amax < float("inf")
    amax = tl.where(amax > 0, tl.maximum(amax, AMAX_FLOOR), amax)  # F.max / amax must not overflow
    fmax = tl.full(amax.shape, FP8_MAX, tl.float32)
    scale = tl.where(finite, tl.div_rn(amax, fmax), float("nan"))
    inv = tl.where(finite & (amax > 0), tl.div_rn(fmax, tl.where(amax > 0, amax, 1.0)), 0.0)
    y = tl.clamp(x * inv[:, None], -FP8_MAX, FP8_MAX)
    y = tl.where(finite[:, None], y, 0.0)
    tl.store(q_ptr + base + offs, cast_fp8(y, q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * n_groups + g, scale, mask=g < n_groups)


def quantize_per_group(x: torch.Tensor, fp8_dtype: torch.dtype, group_size: int, *, block: int | None = None,
                       num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q: fp8 with x's shape, scale: float32 (*lead, ceil(C/G)))."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale = torch.empty(group_scale_shape(x.shape, group_size), dtype=torch.float32, device=x.device)
    lay = group_layout(x.shape, group_size, block, num_warps, TILE)
    if x.numel():
        _quantize_per_group_kernel[lay.grid](x, q, scale, lay.cols, lay.n_groups, lay.blocks_per_row,
                                             FP8_MAX=fp8_max(fp8_dtype), AMAX_FLOOR=amax_floor(fp8_dtype),
                                             G=group_size, BLOCK_G=lay.block_g,
                                             num_warps=lay.num_warps)
    return q, scale
