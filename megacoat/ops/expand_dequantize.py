"""Triton: FP8 dequantization with dynamic range expansion's inverse. Reference: megacoat.fp8.expansion.

x = sign(q) * (F.max * scale) * exp2(log2(|q| * fp32(1/F.max)) * (1/k)), 1/k once per group, the reference's
float32 operation order. k == 1 skips the pow. A NaN scale gives NaN.

|q| takes at most 128 values, so log2(|q| * fp32(1/F.max)) comes from a float32 table built with torch on the
tensor's device: bit-identical to what the torch reference computes there, and one libdevice log2 per element
cheaper. The table is indexed by the magnitude bits (q & 0x7F), so a warp's gather touches at most 4 of its
128-byte lines instead of 8 (L1 serves a gather in about one pass per distinct line).
The tile is cut in chunks of VEC = 16 bytes of output, 4 lanes per group (quantize_per_group.group_tile_vec):
the FP8 load and the output store share one register layout, and each thread's 16-32 elements lie in one group.
With the plain [BLOCK_G, G] tile (`vec=0`: the session-2 kernel, kept for the benchmark) Triton loads 16 FP8 per
thread but stores 4 float32 / 8 bf16 per thread, and exchanges the whole tile through shared memory between the
two (8-16 KB per program, STS/LDS and barriers), on top of the gathers: a likely part of why bf16 output ran at
62% of copy. Static SASS (Triton 3.6, 4096 x 4 warps): bf16 out 19.8 instructions per element without shared
memory vs 20.0 with 8 KB; float32 out 22.1 vs 19.9 with 16 KB (more, smaller FP8 loads): the device decides.
`lut=False` computes log2 in the kernel and `approx_math=True` uses the hardware lg2/ex2.approx (not bit-exact,
see expand_math): benchmark comparisons.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops import expand_math
from megacoat.ops.quantize_layout import fp8_max, group_layout, vector_tile
from megacoat.ops.quantize_per_group import group_tile, group_tile_vec

_LUTS: dict = {}

TILE = (4096, 4)  # (elements, warps) per program: the best of benchmarks/bench_quant.py's sweep on an H200


def log2_table(fp8_dtype: torch.dtype, device) -> torch.Tensor:
    """[256] float32: log2(|q| * fp32(1/F.max)) indexed by the FP8 bit pattern, computed as the reference does."""
    key = (fp8_dtype, str(device))
    if key not in _LUTS:
        q = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(fp8_dtype).float()
        _LUTS[key] = torch.log2(q.abs() * (1.0 / fp8_max(fp8_dtype))).contiguous()
    return _LUTS[key]


@triton.jit
def _per_group(v, VEC: tl.constexpr):
    """A [BLOCK_G] per-group vector broadcast against the tile."""
    if VEC:
        out = v[None, :, None, None]
    else:
        out = v[:, None]
    return out


@triton.jit
def _expand_dequantize_kernel(q_ptr, scale_ptr, k_ptr, lut_ptr, out_ptr, cols, n_groups, blocks_per_row,
                              FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, LUT: tl.constexpr,
                              APPROX: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, VEC: tl.constexpr,
                              LANES: tl.constexpr):
    if VEC:
        row, g, base, offs, mask = group_tile_vec(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G, VEC, LANES)
    else:
        row, g, base, offs, mask = group_tile(tl.program_id(0), blocks_per_row, cols, G, BLOCK_G)
    gmask = g < n_groups
    s = tl.load(scale_ptr + row * n_groups + g, mask=gmask, other=0.0)
    kf = tl.load(k_ptr + row * n_groups + g, mask=gmask, other=1.0).to(tl.float32)
    inv_k = tl.div_rn(tl.full(kf.shape, 1.0, tl.float32), kf)
    m = s * FP8_MAX
    q8 = tl.load(q_ptr + base + offs, mask=mask, other=0.0)
    qv = q8.to(tl.float32)
    rq = tl.abs(qv) * INV_FP8_MAX
    if APPROX:
        e = expand_math.approx_exp2(expand_math.approx_log2(rq) * _per_group(inv_k, VEC))
    else:
        if LUT:
            idx = q8.to(tl.uint8, bitcast=True)
            if VEC:
                idx = idx & 0x7F
            lg = tl.load(lut_ptr + idx.to(tl.int32))
        else:
            lg = expand_math.log2(rq)
        e = expand_math.exp2(lg * _per_group(inv_k, VEC))
    e = tl.where(_per_group(kf, VEC) == 1.0, rq, e)
    e = tl.where(e < expand_math.FLT_MIN, 0.0, e)  # as the reference (FTZ here)
    out = e * _per_group(m, VEC)
    out = tl.where(qv < 0, -out, out)
    tl.store(out_ptr + base + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def expand_dequantize(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, group_size: int,
                      out_dtype: torch.dtype, *, lut: bool = True, approx_math: bool = False, vec: int | None = None,
                      block: int | None = None, num_warps: int | None = None):
    """vec: elements per thread vector (default 16 bytes of out_dtype, at most G); 0 = the plain tile."""
    q, scale, k = q.contiguous(), scale.contiguous(), k.contiguous()
    vec, lanes = vector_tile(out_dtype, group_size, vec)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lay = group_layout(q.shape, group_size, block, num_warps, TILE)
    if q.numel():
        fmax = fp8_max(q.dtype)
        _expand_dequantize_kernel[lay.grid](q, scale, k, log2_table(q.dtype, q.device), out, lay.cols, lay.n_groups,
                                            lay.blocks_per_row, FP8_MAX=fmax, INV_FP8_MAX=1.0 / fmax, LUT=lut,
                                            APPROX=approx_math, G=group_size, BLOCK_G=lay.block_g, VEC=vec,
                                            LANES=lanes, num_warps=lay.num_warps)
    return out
