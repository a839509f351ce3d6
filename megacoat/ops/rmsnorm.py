"""Fused FP8 RMSNorm for the COAT precision flow (Triton, forward and backward, with torch references).

Forward, in two launches:
  1. `rmsnorm_fp8_fwd`: read x once; write it as E4M3 with 1xG group scales (the tensor saved for backward),
     the row's rstd computed from those dequantized values, and each block's amax of the output
     y = x * rstd * w (stage 1 of group scaling; a few hundred floats reduced by torch to one scale).
  2. `rmsnorm_fp8_out`: re-read the 1-byte x and write y quantized with that per-tensor scale, row-major
     for the next GEMM, or transposed for its weight gradient (made again in backward instead of saved).
Backward `rmsnorm_fp8_bwd` reads dy and the saved FP8 x and writes dx and per-block partial sums of dw.

Every function computes from the dequantized FP8 input, so forward, the backward recompute and the
reference agree on the same values. Works for any hidden size (a short last group is padded with zeros).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.group_cast_ref import TINY, group_dequantize, group_quantize

E4M3 = torch.float8_e4m3fn


def _check(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> None:
    if x.dim() != 2 or weight.dim() != 1 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"rmsnorm expects x [M, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group size must be a power of two >= 16, got {group_size}")


# ----------------------------------------------------------------------------------------------- references
def rmsnorm_fp8_fwd_ref(x, weight, eps: float, group_size: int, out_dtype=E4M3):
    """→ (x8 [M,H] E4M3, x_scales [M, ceil(H/G)], rstd [M] fp32, y_scale [1] fp32)."""
    _check(x, weight, group_size)
    x8, xs = group_quantize(x, group_size, E4M3)
    xd = group_dequantize(x8, xs, group_size)
    rstd = 1.0 / torch.sqrt((xd * xd).mean(-1) + eps)
    amax = (rstd * (xd * weight.float()).abs().amax(-1)).amax()
    y_scale = (amax.clamp(min=TINY) / torch.finfo(out_dtype).max).reshape(1)
    return x8, xs, rstd, y_scale


def rmsnorm_fp8_out_ref(x8, x_scales, rstd, weight, y_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    """y = x * rstd * w cast with the per-tensor y_scale: [M, H], or [H, M] when transpose."""
    fmax = torch.finfo(out_dtype).max
    y = group_dequantize(x8, x_scales, group_size) * rstd[:, None] * weight.float()
    q = (y / y_scale).clamp(-fmax, fmax).to(out_dtype)
    return q.t().contiguous() if transpose else q


def rmsnorm_fp8_bwd_ref(dy, x8, x_scales, rstd, weight, group_size: int):
    """→ (dx [M,H] in dy's dtype, dw [H] fp32)."""
    xhat = group_dequantize(x8, x_scales, group_size) * rstd[:, None]
    dyf, w = dy.float(), weight.float()
    c = (dyf * w * xhat).sum(-1, keepdim=True) / x8.shape[1]
    dx = rstd[:, None] * (dyf * w - xhat * c)
    return dx.to(dy.dtype), (dyf * xhat).sum(0)


# --------------------------------------------------------------------------------------------------- triton
# Every kernel walks a row in tiles of exactly one group (BN == G), so a group's amax is a plain row reduction
# of the tile: no 3-D reshapes, which Triton 3.6 mis-compiles on Hopper when the groups' FP8 values are
# converted inside them (seen as NaN rstd).
@triton.jit
def _fwd_kernel(x_ptr, w_ptr, x8_ptr, xs_ptr, rstd_ptr, amax_ptr, M, H, NG, eps, fmax_in, tiny,
                G: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0)
    rm = (pid * BM + tl.arange(0, BM)).to(tl.int64)
    row_ok = rm < M
    sumsq = tl.zeros([BM], dtype=tl.float32)
    wmax = tl.zeros([BM], dtype=tl.float32)
    for gi in range(0, NG):
        rn = gi * G + tl.arange(0, G)
        mask = row_ok[:, None] & (rn[None, :] < H)
        offs = rm[:, None] * H + rn[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gs = tl.maximum(tl.max(tl.abs(x), axis=1), tiny) / fmax_in
        q = tl.clamp(x / gs[:, None], -fmax_in, fmax_in).to(x8_ptr.dtype.element_ty)
        tl.store(x8_ptr + offs, q, mask=mask)
        tl.store(xs_ptr + rm * NG + gi, gs, mask=row_ok)
        xd = q.to(tl.float32) * gs[:, None]
        w = tl.load(w_ptr + rn, mask=rn < H, other=0.0).to(tl.float32)
        sumsq += tl.sum(xd * xd, axis=1)
        wmax = tl.maximum(wmax, tl.max(tl.abs(xd * w[None, :]), axis=1))
    rstd = 1.0 / tl.sqrt(sumsq / H + eps)
    tl.store(rstd_ptr + rm, rstd, mask=row_ok)
    # rstd > 0, so max|x * rstd * w| over a row is rstd * max|x * w|: the output amax without the output.
    tl.store(amax_ptr + pid, tl.max(tl.where(row_ok, rstd * wmax, 0.0), axis=0))


@triton.jit
def _load_xd(x8_ptr, xs_ptr, rm, rn, gi, row_ok, mask, H, NG):
    """Dequantized x tile [BM, G] of group column gi."""
    q = tl.load(x8_ptr + rm[:, None] * H + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    return q * tl.load(xs_ptr + rm * NG + gi, mask=row_ok, other=0.0)[:, None]


@triton.jit
def _out_kernel(x8_ptr, xs_ptr, rstd_ptr, w_ptr, scale_ptr, y_ptr, M, H, NG, fmax_out,
                TRANSPOSE: tl.constexpr, G: tl.constexpr, BM: tl.constexpr):
    gi = tl.program_id(1)
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (gi * G + tl.arange(0, G)).to(tl.int64)
    row_ok = rm < M
    mask = row_ok[:, None] & (rn[None, :] < H)
    xd = _load_xd(x8_ptr, xs_ptr, rm, rn, gi, row_ok, mask, H, NG)
    rstd = tl.load(rstd_ptr + rm, mask=row_ok, other=0.0)
    w = tl.load(w_ptr + rn, mask=rn < H, other=0.0).to(tl.float32)
    yq = tl.clamp(xd * rstd[:, None] * w[None, :] / tl.load(scale_ptr), -fmax_out, fmax_out)
    if TRANSPOSE:
        tl.store(y_ptr + rn[:, None] * M + rm[None, :], tl.trans(yq).to(y_ptr.dtype.element_ty), mask=tl.trans(mask))
    else:
        tl.store(y_ptr + rm[:, None] * H + rn[None, :], yq.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(dy_ptr, x8_ptr, xs_ptr, rstd_ptr, w_ptr, dx_ptr, dwp_ptr, M, H, NG,
                G: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0)
    rm = (pid * BM + tl.arange(0, BM)).to(tl.int64)
    row_ok = rm < M
    rstd = tl.load(rstd_ptr + rm, mask=row_ok, other=0.0)
    c = tl.zeros([BM], dtype=tl.float32)
    for gi in range(0, NG):  # pass 1: c = mean(dy * w * xhat) per row
        rn = gi * G + tl.arange(0, G)
        mask = row_ok[:, None] & (rn[None, :] < H)
        xhat = _load_xd(x8_ptr, xs_ptr, rm, rn, gi, row_ok, mask, H, NG) * rstd[:, None]
        dy = tl.load(dy_ptr + rm[:, None] * H + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn, mask=rn < H, other=0.0).to(tl.float32)
        c += tl.sum(dy * w[None, :] * xhat, axis=1)
    c = c / H
    for gi in range(0, NG):  # pass 2: dx, and this block's share of dw
        rn = gi * G + tl.arange(0, G)
        mask = row_ok[:, None] & (rn[None, :] < H)
        xhat = _load_xd(x8_ptr, xs_ptr, rm, rn, gi, row_ok, mask, H, NG) * rstd[:, None]
        dy = tl.load(dy_ptr + rm[:, None] * H + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn, mask=rn < H, other=0.0).to(tl.float32)
        dx = rstd[:, None] * (dy * w[None, :] - xhat * c[:, None])
        tl.store(dx_ptr + rm[:, None] * H + rn[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dwp_ptr + pid * H + rn, tl.sum(dy * xhat, axis=0), mask=rn < H)


def rmsnorm_fp8_fwd_triton(x, weight, eps: float, group_size: int, out_dtype=E4M3):
    _check(x, weight, group_size)
    x = x.contiguous()
    m, h = x.shape
    ng = triton.cdiv(h, group_size)
    x8 = torch.empty((m, h), dtype=E4M3, device=x.device)
    xs = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    bm = 8  # rows per program: enough programs to fill the GPU at one 2048-token sequence
    amax = torch.empty((triton.cdiv(m, bm),), dtype=torch.float32, device=x.device)
    _fwd_kernel[(triton.cdiv(m, bm),)](x, weight, x8, xs, rstd, amax, m, h, ng, eps, torch.finfo(E4M3).max, TINY,
                                       G=group_size, BM=bm, num_warps=4)
    y_scale = (amax.amax().clamp(min=TINY) / torch.finfo(out_dtype).max).reshape(1)
    return x8, xs, rstd, y_scale


def rmsnorm_fp8_out_triton(x8, x_scales, rstd, weight, y_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    m, h = x8.shape
    y = torch.empty((h, m) if transpose else (m, h), dtype=out_dtype, device=x8.device)
    bm = 64
    _out_kernel[(triton.cdiv(m, bm), x_scales.shape[1])](
        x8, x_scales, rstd, weight, y_scale, y, m, h, x_scales.shape[1], torch.finfo(out_dtype).max,
        TRANSPOSE=transpose, G=group_size, BM=bm, num_warps=4)
    return y


def rmsnorm_fp8_bwd_triton(dy, x8, x_scales, rstd, weight, group_size: int):
    dy = dy.contiguous()
    m, h = x8.shape
    bm = 8
    grid = triton.cdiv(m, bm)
    dx = torch.empty((m, h), dtype=dy.dtype, device=dy.device)
    dwp = torch.empty((grid, h), dtype=torch.float32, device=dy.device)
    _bwd_kernel[(grid,)](dy, x8, x_scales, rstd, weight, dx, dwp, m, h, x_scales.shape[1],
                         G=group_size, BM=bm, num_warps=4)
    return dx, dwp.sum(0)


# ---------------------------------------------------------------------------------------------- dispatchers
def rmsnorm_fp8_fwd(x, weight, eps: float, group_size: int, out_dtype=E4M3):
    fn = rmsnorm_fp8_fwd_triton if x.is_cuda else rmsnorm_fp8_fwd_ref
    return fn(x, weight, eps, group_size, out_dtype)


def rmsnorm_fp8_out(x8, x_scales, rstd, weight, y_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    fn = rmsnorm_fp8_out_triton if x8.is_cuda else rmsnorm_fp8_out_ref
    return fn(x8, x_scales, rstd, weight, y_scale, group_size, transpose, out_dtype)


def rmsnorm_fp8_bwd(dy, x8, x_scales, rstd, weight, group_size: int):
    fn = rmsnorm_fp8_bwd_triton if dy.is_cuda else rmsnorm_fp8_bwd_ref
    return fn(dy, x8, x_scales, rstd, weight, group_size)
