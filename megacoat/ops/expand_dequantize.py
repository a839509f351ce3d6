"""Triton: FP8 dequantization with dynamic range expansion's inverse. Reference: megacoat.fp8.expansion.

x = sign(q) * (F.max * scale) * exp2(log2(|q| * fp32(1/F.max)) * (1/k)), 1/k once per group, the reference's
float32 operation order. k == 1 skips the pow. A NaN scale gives NaN.

|q| takes at most 256 values, so log2(|q| * fp32(1/F.max)) comes from a 256-entry float32 table built with
torch on the tensor's device: bit-identical to what the torch reference computes there, and one libdevice log2
per element cheaper (the 1 KB table stays in L1). `lut=False` computes log2 in the kernel (benchmark
comparison); `approx_math=True` uses the hardware lg2/ex2.approx (not bit-exact, see expand_math).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops import expand_math
from megacoat.ops.quantize_layout import fp8_max, group_layout
from megacoat.ops.quantize_per_group import group_tile

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
def _expand_dequantize_kernel(q_ptr, scale_ptr, k_ptr, lut_ptr, out_ptr, cols, n_groups, blocks_per_row,
                              FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, LUT: tl.constexpr,
                              APPROX: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr):
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
        e = expand_math.approx_exp2(expand_math.approx_log2(rq) * inv_k[:, None])
    else:
        if LUT:
            lg = tl.load(lut_ptr + q8.to(tl.uint8, bitcast=True).to(tl.int32))
        else:
            lg = expand_math.log2(rq)
        e = expand_math.exp2(lg * inv_k[:, None])
    e = tl.where(kf[:, None] == 1.0, rq, e)
    e = tl.where(e < expand_math.FLT_MIN, 0.0, e)  # as the reference (FTZ here)
    out = e * m[:, None]
    out = tl.where(qv < 0, -out, out)
    tl.store(out_ptr + base + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def expand_dequantize(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, group_size: int,
                      out_dtype: torch.dtype, *, lut: bool = True, approx_math: bool = False,
                      block: int | None = None, num_warps: int | None = None):
    q, scale, k = q.contiguous(), scale.contiguous(), k.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lay = group_layout(q.shape, group_size, block, num_warps, TILE)
    if q.numel():
        fmax = fp8_max(q.dtype)
        _expand_dequantize_kernel[lay.grid](q, scale, k, log2_table(q.dtype, q.device), out, lay.cols, lay.n_groups,
                                            lay.blocks_per_row, FP8_MAX=fmax, INV_FP8_MAX=1.0 / fmax, LUT=lut,
                                            APPROX=approx_math, G=group_size, BLOCK_G=lay.block_g,
                                            num_warps=lay.num_warps)
    return out
