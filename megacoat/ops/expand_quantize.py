"""Triton: FP8 quantization with per-group dynamic range expansion. Reference: megacoat.fp8.expansion.

Per [BLOCK_G, G] tile: amax and non-zero amin per group, k = log2(R_F) / log2(amax / amin) clamped and rounded
to bf16 (1 for all-zero / single-magnitude / non-finite / subnormal-amax groups), then
q = fp8(sign(x) F.max (|x|/amax)^k), amax raised to 2^-126 for the scaling if subnormal.
log2/exp2 are libdevice's, like torch's CUDA log2f/exp2f (expand_math), divisions are div_rn, and the float32
operations follow the reference's order, so the GPU result is bit-exact with torch's.
Speed: instruction-bound, not memory-bound (session 2: ~480 G elements/s on an H200, 57% of copy bandwidth from
float32, 34% from bf16). The default (`lean`) kernel cuts the static SASS from 57.8 to 47.3 instructions per
element (Triton 3.6, sm_90, float32 in, tile 2048 x 4 warps): amax / non-zero amin reduced on the integer bits
(4 instead of 6 per element) and log2 as libdevice's own sequence minus its subnormal/zero/inf/NaN paths
(expand_math.log2_normal: r here is 0 -- flushed anyway -- or a normal <= 1), the clamp left to the cast's
saturation. `lean=False` is the session-2 kernel, for benchmarks/bench_quant.py to measure both in one run.
approx_math=True (lg2/ex2.approx, ~30 per element) trades bit-exactness for speed.
See benchmarks/results/bench_quant_notes.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops import expand_math
from megacoat.ops.quantize_cast import cast_fp8
from megacoat.ops.quantize_layout import fp8_max, group_layout, group_scale_shape
from megacoat.ops.quantize_per_group import group_tile

TILE = (2048, 4)  # (elements, warps) per program: the best of benchmarks/bench_quant.py's sweep on an H200


@triton.jit
def round_to_bf16(x):
    """Round-to-nearest-even to bf16 by integer ops on the float32 bits (finite x): exact in any cast mode, so
    the interpreter, whose float32->bf16 cast truncates, agrees with torch too."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _group_range(x, LEAN: tl.constexpr):
    """Per group of the [BLOCK_G, G] tile: (amax, finite, non-zero amin), NaN counting as +inf. LEAN: reduce the
    bits of |x| as integers -- for non-negative floats the integer order is the float order, NaN patterns sort
    above inf's, and the non-zero minimum is the unsigned minimum of bits - 1, where 0 wraps to the top: 4
    instructions per element instead of 6."""
    if LEAN:
        b = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
        amax_bits = tl.max(b, axis=1)
        amin = (tl.min(b - 1, axis=1) + 1).to(tl.float32, bitcast=True)  # all-zero group: 0 (never used)
        return amax_bits.to(tl.float32, bitcast=True), amax_bits < 0x7F800000, amin
    a = tl.where(x != x, float("inf"), tl.abs(x))
    amax = tl.max(a, axis=1)
    return amax, amax < float("inf"), tl.min(tl.where(a > 0, a, float("inf")), axis=1)


@triton.jit
def _expand_quantize_kernel(x_ptr, q_ptr, scale_ptr, k_ptr, cols, n_groups, blocks_per_row, log2_range,
                            k_min, k_max, FP8_MAX: tl.constexpr, APPROX: tl.constexpr, LEAN: tl.constexpr,
                            G: tl.constexpr, BLOCK_G: tl.constexpr):
    row, g, base, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    amax, finite, amin = _group_range(x, LEAN)
    live = finite & (amax > 0)
    safe_amax = tl.where(live, amax, 1.0)
    safe_amin = tl.where(live, amin, 1.0)

    lr = expand_math.log2(tl.div_rn(safe_amax, safe_amin))
    k = tl.div_rn(tl.zeros_like(lr) + log2_range, lr)  # lr = 0 -> inf, clamped, then replaced by 1
    k = tl.clamp(k, k_min, k_max)
    k = round_to_bf16(tl.where(live & (amax > amin) & (amax >= expand_math.FLT_MIN), k, 1.0))
    kf = k.to(tl.float32)[:, None]

    ones = tl.full(amax.shape, 1.0, tl.float32)
    amax_s = tl.maximum(amax, expand_math.FLT_MIN)  # as the reference: 1 / amax must not overflow
    scale = tl.where(finite, tl.div_rn(tl.where(amax > 0, amax_s, amax), ones * FP8_MAX), float("nan"))
    inv_amax = tl.where(live, tl.div_rn(ones, tl.where(live, amax_s, 1.0)), 0.0)
    if LEAN:  # r is normal and <= 1 wherever the result is kept, so libdevice's special cases can go
        r = tl.abs(x) * inv_amax[:, None]  # NaN/inf in a non-finite group, whose q is replaced by 0 below
        if APPROX:  # PTX lg2/ex2.approx: faster, not bit-exact with the reference (see expand_math)
            f = expand_math.approx_exp2(kf * expand_math.approx_log2(r))
        else:
            f = expand_math.exp2(kf * expand_math.log2_normal(r))
        f = tl.where(r < expand_math.FLT_MIN, 0.0, tl.where(kf == 1.0, r, f))  # the reference's flush
        # f <= 1 + a few ulp (r <= 1 + 1 ulp): the reference's clamp to F.max is the cast's saturation here
        mag = f * FP8_MAX
    else:  # the session-2 code: flush, then libdevice log2 (zero -> -inf)
        r = tl.where(x != x, float("inf"), tl.abs(x)) * inv_amax[:, None]
        r = tl.where(r < expand_math.FLT_MIN, 0.0, r)
        if APPROX:
            f = tl.where(kf == 1.0, r, expand_math.approx_exp2(kf * expand_math.approx_log2(r)))
        else:
            f = tl.where(kf == 1.0, r, expand_math.exp2(kf * expand_math.log2(r)))
        mag = tl.minimum(f * FP8_MAX, FP8_MAX)
    y = tl.where(x < 0, -mag, mag)
    y = tl.where(finite[:, None], y, 0.0)
    tl.store(q_ptr + base + offs, cast_fp8(y, q_ptr.dtype.element_ty), mask=mask)
    gmask = g < n_groups
    tl.store(scale_ptr + row * n_groups + g, scale, mask=gmask)
    tl.store(k_ptr + row * n_groups + g, k, mask=gmask)


def expand_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, group_size: int, log2_range: float, k_min: float,
                    k_max: float, *, approx_math: bool = False, lean: bool = True, block: int | None = None,
                    num_warps: int | None = None):
    """(q fp8 with x's shape, scale float32 and k bfloat16 of shape (*lead, ceil(C/G))).
    approx_math=True: hardware lg2/ex2.approx, faster; q may differ from the reference by one FP8 step.
    lean=False: the session-2 kernel (float reductions, libdevice log2 with its special cases), same results;
    kept so benchmarks/bench_quant.py measures both in one run."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    gshape = group_scale_shape(x.shape, group_size)
    scale = torch.empty(gshape, dtype=torch.float32, device=x.device)
    k = torch.empty(gshape, dtype=torch.bfloat16, device=x.device)
    lay = group_layout(x.shape, group_size, block, num_warps, TILE)
    if x.numel():
        _expand_quantize_kernel[lay.grid](x, q, scale, k, lay.cols, lay.n_groups, lay.blocks_per_row, log2_range,
                                          k_min, k_max, FP8_MAX=fp8_max(fp8_dtype), APPROX=approx_math,
                                          LEAN=lean, G=group_size, BLOCK_G=lay.block_g, num_warps=lay.num_warps)
    return q, scale, k
