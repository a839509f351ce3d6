"""The attention block's [q|k|v] output gradient, from attention's dq, dk, dv straight to its FP8 GEMM operands.

In coat mode [q|k|v] is one FP8 GEMM output; q and k are rotated (RoPE) before attention. Unfused, its gradient
takes four passes over [M, N] (M tokens, N = q + k + v columns): RoPE's backward over dq and over dk, the join of
dq|dk|dv into one BF16 tensor, its amax, and the cast into g8 [M, N] (dgrad) and g8^T [N, M] (wgrad). Here two
passes read dq, dk, dv where attention left them (any strides, unit last stride) and rotate q's and k's columns by
minus the position's angle on the fly: the first reduces the amax, the second casts into both layouts. Neither the
rotated gradients nor the joined tensor is ever written (6 instead of ~12 bytes moved per element).

The unfused path's arithmetic: the rotation in fp32 rounded to the gradients' dtype (what RoPE's backward stored),
then the per-tensor cast of megacoat.ops.cast_transpose (same scale, same reciprocal, same clamp). The reference
is that path itself; on CUDA, fp32 FMA contraction may move a rotated value by an ulp before its rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.cast_transpose import quantize_transpose_ref, scaled_reciprocal
from megacoat.ops.numerics import AMAX_FLOOR, dispatch, fp8_operator, launcher, traced_body
from megacoat.ops.rope import check_rope_input, rope_ref

_BM, _BN_MAX = 64, 64


def _check(dq, dk, dv, cos, sin) -> None:
    check_rope_input(dq, cos, sin)  # dq's layout and the tables; dk and dv must then agree with dq
    for name, t in (("dk", dk), ("dv", dv)):
        if t.dim() != 4 or t.shape[:2] != dq.shape[:2] or t.shape[-1] != dq.shape[-1] or t.stride(-1) != 1 \
                or t.dtype != dq.dtype:
            raise ValueError(f"rope_qkv_grad_fp8: {name} must be [batch, seq, heads, head_dim] in {dq.dtype} with "
                             f"unit last stride like dq {tuple(dq.shape)}, got {tuple(t.shape)} {t.dtype} "
                             f"{t.stride()}")


def rope_qkv_grad_fp8_ref(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    """Reference, the unfused path itself: RoPE's backward of dq and dk, the join with dv, quantize_transpose."""
    _check(dq, dk, dv, cos, sin)
    m = dq.shape[0] * dq.shape[1]
    g = torch.cat([rope_ref(dq, cos, sin, inverse=True).reshape(m, -1),
                   rope_ref(dk, cos, sin, inverse=True).reshape(m, -1), dv.reshape(m, -1)], dim=1)
    return quantize_transpose_ref(g, grad_dtype)


@triton.jit
def _grad_tile(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, rm, pid_n, M, S, NQ, NK,
               qs_b, qs_s, qs_h, ks_b, ks_s, ks_h, vs_b, vs_s, vs_h,
               HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Tile [BM tokens, BN columns] of the joined gradient, rotated back where it is q's or k's and rounded to
    the gradients' dtype, in fp32. BN divides the head dim, so a tile lies in one head of one tensor. Which
    tensor is a per-program choice made by masks and selects, not branches (same code for every tile)."""
    c0 = pid_n * BN
    col = tl.where(c0 < NQ, c0, tl.where(c0 < NQ + NK, c0 - NQ, c0 - NQ - NK))
    head, d0 = col // HD, col % HD
    pos = rm % S
    b = rm // S  # int64, as rm is: offsets past 2^31 elements stay exact
    dn = tl.arange(0, BN)[None, :]
    # the tile's tensor as [BM, 1] masks (tensor-tensor logic, which the interpreter also types as boolean)
    first = c0 + tl.zeros((BM, 1), dtype=tl.int32)
    rows = (rm < M)[:, None]
    in_q, rotate = rows & (first < NQ), rows & (first < NQ + NK)
    in_k, in_v = rotate & (first >= NQ), rows & (first >= NQ + NK)
    xq = tl.load(q_ptr + (b * qs_b + pos * qs_s + head * qs_h + d0)[:, None] + dn, mask=in_q, other=0.0)
    xk = tl.load(k_ptr + (b * ks_b + pos * ks_s + head * ks_h + d0)[:, None] + dn, mask=in_k, other=0.0)
    xv = tl.load(v_ptr + (b * vs_b + pos * vs_s + head * vs_h + d0)[:, None] + dn, mask=in_v, other=0.0)
    ty = xq.dtype
    x = tl.where(in_q, xq, tl.where(in_k, xk, xv)).to(tl.float32)
    # q and k: pairs (2i, 2i+1) of the head by minus the angle, the rotation's transpose (rope_ref, inverse)
    x0, x1 = tl.split(tl.reshape(x, (BM, BN // 2, 2)))
    tab = pos[:, None] * (HD // 2) + (d0 // 2 + tl.arange(0, BN // 2))[None, :]
    c = tl.load(cos_ptr + tab, mask=rotate, other=0.0)
    s = -tl.load(sin_ptr + tab, mask=rotate, other=0.0)
    rotated = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), (BM, BN)).to(ty).to(tl.float32)
    return tl.where(rotate, rotated, x), rows


@triton.jit
def _amax_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, amax_ptr, M, S, NQ, NK,
                 qs_b, qs_s, qs_h, ks_b, ks_s, ks_h, vs_b, vs_s, vs_h,
                 HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    x, _ = _grad_tile(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, rm, tl.program_id(1), M, S, NQ, NK,
                      qs_b, qs_s, qs_h, ks_b, ks_s, ks_h, vs_b, vs_s, vs_h, HD, BM, BN)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def _cast_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, amax_ptr, scale_ptr, out_ptr, outt_ptr, M, N, S, NQ, NK,
                 qs_b, qs_s, qs_h, ks_b, ks_s, ks_h, vs_b, vs_s, vs_h, fmax, amax_floor,
                 HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TRANSPOSE: tl.constexpr):
    # tiles in the reverse order of the amax pass: the first ones read what it left in L2
    pid_m, pid_n = tl.num_programs(0) - 1 - tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)
    scale = tl.div_rn(tl.maximum(tl.load(amax_ptr), amax_floor), fmax)  # as _cast_transpose_kernel
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_ptr, scale)
    c, inv = scaled_reciprocal(scale)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    x, mask = _grad_tile(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, rm, pid_n, M, S, NQ, NK,
                         qs_b, qs_s, qs_h, ks_b, ks_s, ks_h, vs_b, vs_s, vs_h, HD, BM, BN)
    q = tl.clamp((x * c) * inv, -fmax, fmax)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
    if TRANSPOSE:
        tl.store(outt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q).to(outt_ptr.dtype.element_ty),
                 mask=tl.trans(mask))


def _tile_width(head_dim: int) -> int:
    """The widest power-of-two tile (up to 64 columns) that divides the head dim: a tile never straddles heads."""
    bn = _BN_MAX
    while head_dim % bn:
        bn //= 2
    return bn


def rope_qkv_grad_fp8_triton(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    _check(dq, dk, dv, cos, sin)
    b, s, _, hd = dq.shape
    m = b * s
    nq, nk, nv = (t.shape[2] * hd for t in (dq, dk, dv))
    n = nq + nk + nv
    dev = dq.device
    amax = torch.zeros((1,), dtype=torch.float32, device=dev)  # |g| >= 0: zero is the neutral start
    scale = torch.empty((1,), dtype=torch.float32, device=dev)  # written by the cast pass
    g8 = torch.empty((m, n), dtype=grad_dtype, device=dev)
    # Triton 3.6 on sm_90 miswrites the transposed store of a tile loaded as float32 (cast_transpose._launch):
    # float32 gradients (--fp32, tests) get their transpose from torch, bf16 ones from the kernel
    transpose = not (dq.dtype == torch.float32 and dq.is_cuda)
    g8t = torch.empty((n, m), dtype=grad_dtype, device=dev) if transpose else g8
    bn = _tile_width(hd)
    grid = (triton.cdiv(m, _BM), n // bn)
    cos, sin = cos.contiguous(), sin.contiguous()
    strides = (*dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3])
    launcher(_amax_kernel)[grid](dq, dk, dv, cos, sin, amax, m, s, nq, nk, *strides, HD=hd, BM=_BM, BN=bn,
                                 num_warps=4)
    launcher(_cast_kernel)[grid](dq, dk, dv, cos, sin, amax, scale, g8, g8t, m, n, s, nq, nk, *strides,
                                 torch.finfo(grad_dtype).max, AMAX_FLOOR, HD=hd, BM=_BM, BN=bn,
                                 TRANSPOSE=transpose, num_warps=4)
    return g8, g8t if transpose else g8.t().contiguous(), scale


def rope_qkv_grad_fp8(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    """(g8 [M, N], g8^T [N, M], scale): the per-tensor FP8 quantization (grad_dtype) of the [q|k|v] output
    gradient, M = batch x seq, given attention's gradients dq, dk, dv [batch, seq, heads, head_dim] of the
    rotated q and k and of v. Two launches on CUDA (amax, cast), nothing read back to the host."""
    return dispatch(_op, dq, rope_qkv_grad_fp8_triton, rope_qkv_grad_fp8_ref, dq, dk, dv, cos, sin, grad_dtype)


@fp8_operator("megacoat::rope_qkv_grad_fp8")
def _op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return traced_body(dq, rope_qkv_grad_fp8_triton, rope_qkv_grad_fp8_ref, dq, dk, dv, cos, sin, grad_dtype)
