"""Triton: group scaling's stage 1 -- an elementwise op fused with one amax per 1xG group of its output.

`store_group_amax` is the building block other kernels (the FP8 activation ops) call on the tile they are
about to store; `elementwise_group_amax` is a ready kernel for a few ops, and `group_amax` is stage 1 alone.
Stage 2 (one amax from the G-times smaller tensor) is a plain torch reduction: it reads 1/G of the bytes.
Reference: megacoat.fp8.group_scaling. The amax is of y *as stored* (rounded to the output dtype), so a
per-tensor scale built from it never saturates y. NaN counts as +inf, so non-finite outputs are flagged.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.quantize_layout import group_layout, group_scale_shape
from megacoat.ops.quantize_per_group import group_tile

OPS = {"identity": 0, "relu": 1, "silu": 2, "square": 3}

TILE = (8192, 8)  # (elements, warps) per program; 95% of copy bandwidth for silu bf16 on an H200 (not swept)


@triton.jit
def store_group_amax(y, mask, amax_ptr, row, g, n_groups):
    """Store max|y| over axis 1 of a [BLOCK_G, G] float32 tile (masked entries ignored, NaN -> inf)."""
    a = tl.where(mask, tl.where(y != y, float("inf"), tl.abs(y)), 0.0)
    tl.store(amax_ptr + row * n_groups + g, tl.max(a, axis=1), mask=g < n_groups)


@triton.jit
def _apply(x, OP: tl.constexpr):
    if OP == 1:
        x = tl.maximum(x, 0.0)
    elif OP == 2:
        x = x * tl.sigmoid(x)
    elif OP == 3:
        x = x * x
    return x


@triton.jit
def _elementwise_group_amax_kernel(x_ptr, y_ptr, amax_ptr, cols, n_groups, blocks_per_row, OP: tl.constexpr,
                                   WITH_AMAX: tl.constexpr, WRITE_Y: tl.constexpr, G: tl.constexpr,
                                   BLOCK_G: tl.constexpr):
    row, g, base, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    y = _apply(x, OP)
    if WRITE_Y:
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + base + offs, y, mask=mask)
    if WITH_AMAX:
        store_group_amax(y.to(tl.float32), mask, amax_ptr, row, g, n_groups)


def _launch(x, op, group_size, out_dtype, with_amax, write_y, block, num_warps):
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device) if write_y else None
    amax = (torch.empty(group_scale_shape(x.shape, group_size), dtype=torch.float32, device=x.device)
            if with_amax else None)
    lay = group_layout(x.shape, group_size, block, num_warps, TILE)
    if x.numel():
        _elementwise_group_amax_kernel[lay.grid](x, y if write_y else x, amax if with_amax else x, lay.cols,
                                                 lay.n_groups, lay.blocks_per_row, OP=OPS[op],
                                                 WITH_AMAX=with_amax, WRITE_Y=write_y, G=group_size,
                                                 BLOCK_G=lay.block_g, num_warps=lay.num_warps)
    return y, amax


def elementwise_group_amax(x: torch.Tensor, op: str, group_size: int, out_dtype: torch.dtype, *,
                           with_amax: bool = True, block: int | None = None, num_warps: int | None = None):
    """(y = op(x) in out_dtype, float32 amax of y per group, shape (*lead, ceil(C/G))); with_amax=False gives
    the plain elementwise kernel (amax None), the baseline the benchmark compares against."""
    return _launch(x, op, group_size, out_dtype, with_amax, True, block, num_warps)


def group_amax(x: torch.Tensor, group_size: int, *, block: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """Stage 1 alone (reads x, writes only the per-group amax)."""
    return _launch(x, "identity", group_size, x.dtype, True, False, block, num_warps)[1]


def reduce_group_amax(amax: torch.Tensor) -> torch.Tensor:
    """Stage 2: 0-d float32 max of the per-group amaxes (inf, i.e. a non-finite input, propagates)."""
    return amax.amax() if amax.numel() else torch.zeros((), device=amax.device)
