"""Triton: group scaling's stage 1 -- an elementwise op fused with one amax per 1xG group of its output.

`store_group_amax` is the building block other kernels (the FP8 activation ops) call on the tile they are
about to store (`store_tile_amax`: one amax per program, when only the per-tensor amax is consumed -- the FP8
activation kernels in ops/swiglu.py and ops/rmsnorm.py already do that); `elementwise_group_amax` is a ready
kernel for a few ops, and `group_amax` is stage 1 alone.
Cost: the amax is an integer max over the bits of |y| (NaN sorts above inf). Static SASS, silu bf16 -> bf16,
8192 x 8 warps, Triton 3.6: op alone 17.5 instructions per element; + per-group amax 27.9 with the float form
(NaN select, abs, float max, masked) of session 2, 22.3 now, 21.2 per tile. The op alone is memory-bound with
~32 per element of issue budget (bf16 in and out at copy speed), so 27.9 ate most of it (measured: +11.7%).
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
def _abs_bits(y, mask):
    """Bits of |y| as uint32 (0 where masked off; mask None: y is already 0 there): for non-negative floats the
    integer order is the float order and NaN patterns sort above inf's, so an integer max finds max|y| and flags
    NaN in 2 instructions per element (the float form, NaN -> inf select then max, takes about 4)."""
    bits = y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    if mask is not None:
        bits = tl.where(mask, bits, 0)
    return bits


@triton.jit
def _amax_from_bits(bits):
    """float32 amax from max |y| bits; NaN -> inf (a non-finite output must give a non-finite amax)."""
    return tl.where(bits > 0x7F800000, float("inf"), bits.to(tl.float32, bitcast=True))


@triton.jit
def store_group_amax(y, mask, amax_ptr, row, g, n_groups):
    """Store max|y| over axis 1 of a [BLOCK_G, G] float32 tile (masked entries ignored, NaN -> inf)."""
    bits = tl.max(_abs_bits(y, mask), axis=1)
    tl.store(amax_ptr + row * n_groups + g, _amax_from_bits(bits), mask=g < n_groups)


@triton.jit
def store_tile_amax(y, mask, amax_ptr, pid):
    """Store max|y| over a whole float32 tile (masked entries ignored, NaN -> inf) at amax_ptr[pid]: one value
    per program, for when only the per-tensor amax is consumed (stage 2 then reads 1/(tile size) of the bytes)."""
    bits = _abs_bits(y, mask)
    tl.store(amax_ptr + pid, _amax_from_bits(tl.max(tl.reshape(bits, [bits.numel]), axis=0)))


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
                                   WITH_AMAX: tl.constexpr, PER_TILE: tl.constexpr, WRITE_Y: tl.constexpr,
                                   G: tl.constexpr, BLOCK_G: tl.constexpr):
    row, g, base, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    y = _apply(x, OP)  # every op maps the masked-off 0 to 0, so the amax needs no mask
    if WRITE_Y:
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + base + offs, y, mask=mask)
    if WITH_AMAX:
        if PER_TILE:
            store_tile_amax(y.to(tl.float32), None, amax_ptr, tl.program_id(0))
        else:
            store_group_amax(y.to(tl.float32), None, amax_ptr, row, g, n_groups)


def _launch(x, op, group_size, out_dtype, with_amax, per_tile, write_y, block, num_warps):
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device) if write_y else None
    lay = group_layout(x.shape, group_size, block, num_warps, TILE)
    amax = None
    if with_amax:
        shape = (lay.grid[0],) if per_tile else group_scale_shape(x.shape, group_size)
        amax = torch.empty(shape, dtype=torch.float32, device=x.device)
    if x.numel():
        _elementwise_group_amax_kernel[lay.grid](x, y if write_y else x, amax if with_amax else x, lay.cols,
                                                 lay.n_groups, lay.blocks_per_row, OP=OPS[op],
                                                 WITH_AMAX=with_amax, PER_TILE=per_tile, WRITE_Y=write_y,
                                                 G=group_size, BLOCK_G=lay.block_g, num_warps=lay.num_warps)
    return y, amax


def elementwise_group_amax(x: torch.Tensor, op: str, group_size: int, out_dtype: torch.dtype, *,
                           with_amax: bool = True, per_tile: bool = False, block: int | None = None,
                           num_warps: int | None = None):
    """(y = op(x) in out_dtype, float32 amax of y per group, shape (*lead, ceil(C/G))); with_amax=False gives
    the plain elementwise kernel (amax None), the baseline the benchmark compares against. per_tile=True: one
    amax per program instead (shape (programs,), each over whole groups), for when only the per-tensor amax is
    consumed -- reduce_group_amax gives the same value from either."""
    return _launch(x, op, group_size, out_dtype, with_amax, per_tile, True, block, num_warps)


def group_amax(x: torch.Tensor, group_size: int, *, block: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """Stage 1 alone (reads x, writes only the per-group amax)."""
    return _launch(x, "identity", group_size, x.dtype, True, False, False, block, num_warps)[1]


def reduce_group_amax(amax: torch.Tensor) -> torch.Tensor:
    """Stage 2: 0-d float32 max of the per-group amaxes (inf, i.e. a non-finite input, propagates)."""
    return amax.amax() if amax.numel() else torch.zeros((), device=amax.device)
