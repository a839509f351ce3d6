"""Launch geometry shared by the FP8 quantization kernels: 1xG groups along the last dim, in tiles of groups.

A program handles a tile of BLOCK_G groups x G elements of one row. When G divides the last dim, groups never
straddle rows, so the whole tensor is treated as one flat row (fewer, fuller tiles, no per-row tails); else
each row ends in a short tail group, masked in the kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

# Elements per program and warps when a kernel file names none; each kernel file sets its own from the sweep in
# benchmarks/bench_quant.py (results in benchmarks/results/bench_quant*.json).
DEFAULT_BLOCK = 8192
DEFAULT_WARPS = 8


def fp8_max(fp8_dtype: torch.dtype) -> float:
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"not an FP8 dtype: {fp8_dtype}")
    return float(torch.finfo(fp8_dtype).max)


def amax_floor(fp8_dtype: torch.dtype) -> float:
    """Smallest amax the quantizers scale by: 2^(ceil(log2 F.max) - 128), so that F.max / amax stays finite in
    float32 (exactly 1.75 * 2^127 for E4M3 and E5M2); a positive amax below it is raised to it."""
    return 2.0 ** (math.ceil(math.log2(fp8_max(fp8_dtype))) - 128)


@dataclass(frozen=True)
class GroupLayout:
    rows: int
    cols: int  # elements per row
    n_groups: int  # groups per row (the last one may be short)
    block_g: int  # groups per program
    num_warps: int

    @property
    def blocks_per_row(self) -> int:
        return triton.cdiv(self.n_groups, self.block_g)

    @property
    def grid(self) -> tuple:
        return (self.rows * self.blocks_per_row,)


def group_layout(shape: torch.Size, group_size: int, block: int | None = None, num_warps: int | None = None,
                 default: tuple = (DEFAULT_BLOCK, DEFAULT_WARPS)) -> GroupLayout:
    cols = shape[-1] if len(shape) else 1
    numel = 1
    for s in shape:
        numel *= s
    rows = numel // cols if cols else 0
    if cols and cols % group_size == 0:
        rows, cols = (1, numel) if numel else (0, 0)
    n_groups = triton.cdiv(cols, group_size) if cols else 0
    block_g = max(1, (block or default[0]) // group_size)
    return GroupLayout(rows, cols, n_groups, block_g, num_warps or default[1])


def vector_tile(out_dtype: torch.dtype, group_size: int, vec: int | None = None, lanes: int = 4) -> tuple:
    """(VEC, LANES) for quantize_per_group.group_tile_vec: VEC elements = 16 bytes of out_dtype (capped at G) unless
    given, 0 = the plain [BLOCK_G, G] tile; LANES lanes per group (4: 64 contiguous bytes per group and store)."""
    if vec is None:
        vec = min(16 // torch.empty((), dtype=out_dtype).element_size(), group_size)
    return vec, (max(1, min(lanes, group_size // vec)) if vec else 1)


def group_scale_shape(shape: torch.Size, group_size: int) -> torch.Size:
    if len(shape) == 0:
        return torch.Size([1])
    return torch.Size([*shape[:-1], triton.cdiv(shape[-1], group_size)])
