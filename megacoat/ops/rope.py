"""Rotary position embedding of the COAT block's q and k: one Triton kernel, with its torch reference.

Same convention as the model's apply_rope: pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] rotated
by the position's angle, computed in fp32, returned in x's dtype. The kernel reads x through its strides: q and k
can be column slices of the fused [q|k|v] GEMM output, with no copy before the rotation. The backward (the
rotation by minus the angle, so nothing but the constant cos/sin tables is kept for it) is the same kernel, writing
into the joined [q|k|v] gradient before its FP8 cast: megacoat.ops.rope_grad_cast, whose reference is
rope_ref(inverse=True).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.numerics import AMAX_FLOOR, dispatch, fp8_operator, launcher, traced_body
from megacoat.ops.tensor_scale import history_scale, record_program_amax, scaled_codes


def check_rope_input(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"rope expects x [batch, seq, heads, even head_dim] with unit last stride, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if cos.shape != sin.shape or cos.shape[0] < x.shape[1] or cos.shape[1] != x.shape[-1] // 2:
        raise ValueError(f"rope tables {tuple(cos.shape)} do not cover seq {x.shape[1]} x head_dim/2 "
                         f"{x.shape[-1] // 2}")


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    check_rope_input(x, cos, sin)
    seq = x.shape[1]
    c = cos[:seq].view(1, seq, 1, -1)
    s = sin[:seq].view(1, seq, 1, -1)
    if inverse:
        s = -s
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


# One program rotates BH heads of one token: the tile [BH, head_dim] is read and written as whole contiguous rows
# (128-bit accesses), split into its even/odd lanes in registers, and the token's cos/sin row is loaded once for
# all its heads. The same kernel writes the backward's rotated gradients (and v's, copied) straight into their
# columns of the joined [q|k|v] gradient (row stride ld_out) with the amax folded in: megacoat.ops.rope_grad_cast.
#
# With an amax history (HIST > 0: the backward's delayed scaling, megacoat.coat.delayed_scaling) the kernel also casts:
# each value is rounded to x's dtype, as the BF16 joined gradient would hold it, then stored as FP8 (out's dtype)
# with the scale from the history's maximum, which the first program writes to scale_ptr. The amax folded in is that
# of the rounded values, for the history's roll.
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, amax_ptr, hist_ptr, scale_ptr, S, NH, stride_b, stride_s,
                 stride_h, ld_out, hist_len, fmax, amax_floor, HALF: tl.constexpr, BH: tl.constexpr,
                 BD: tl.constexpr, ROTATE: tl.constexpr, INVERSE: tl.constexpr, AMAX: tl.constexpr,
                 HIST: tl.constexpr):
    t = tl.program_id(0)  # token = (batch, position)
    pos = t % S
    src = x_ptr + (t // S).to(tl.int64) * stride_b + pos.to(tl.int64) * stride_s
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, 2 * BD)
    mask = (h < NH)[:, None] & (d < 2 * HALF)[None, :]
    x = tl.load(src + h[:, None].to(tl.int64) * stride_h + d[None, :], mask=mask, other=0.0)
    if HIST > 0:
        ty = x_ptr.dtype.element_ty  # the joined gradient's dtype: rounded to it before the cast
    else:
        ty = out_ptr.dtype.element_ty
    if ROTATE:
        x0, x1 = tl.split(tl.reshape(x.to(tl.float32), (BH, BD, 2)))
        i = tl.arange(0, BD)
        c = tl.load(cos_ptr + pos * HALF + i, mask=i < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + pos * HALF + i, mask=i < HALF, other=0.0)[None, :]
        if INVERSE:  # the rotation's transpose: the angle's negative
            s = -s
        y = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), (BH, 2 * BD)).to(ty)
    else:
        y = x.to(ty)
    dst = out_ptr + t.to(tl.int64) * ld_out + h[:, None] * (2 * HALF) + d[None, :]
    if HIST > 0:
        scale = history_scale(scale_ptr, hist_ptr, hist_len, fmax, amax_floor, HIST)
        tl.store(dst, scaled_codes(y.to(tl.float32), scale, fmax).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, y, mask=mask)
    if AMAX:  # of the stored (or, cast, the rounded) values; masked lanes are 0, and |y| >= 0
        record_program_amax(tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0), amax_ptr)


def rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, ld_out: int,
                rotate: bool = True, inverse: bool = False, amax: torch.Tensor | None = None,
                history: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> None:
    """Write x [batch, seq, heads, head_dim] (any strides, unit last stride), rotated by the angle (or its
    negative, inverse) or copied (rotate=False), into out: token t's heads at out[t * ld_out:], contiguous. With
    amax (float32 [1], zero or a running max), fold max|stored value| into it. With history (an amax history,
    float32 [L]) and scale (float32 [1], written): out is FP8, each value rounded to x's dtype and cast with the scale
    from the history's maximum (amax then folds the rounded values' max)."""
    b, s, nh, d = x.shape
    bd = triton.next_power_of_2(d // 2)
    bh = min(triton.next_power_of_2(nh), max(1, 4096 // (2 * bd)))  # up to 4096 elements per program
    hist_len = 0 if history is None else history.numel()
    fmax = torch.finfo(out.dtype).max if history is not None else 0.0
    launcher(_rope_kernel)[(b * s, triton.cdiv(nh, bh))](
        x, cos, sin, out, out if amax is None else amax, out if history is None else history,
        out if scale is None else scale, s, nh, x.stride(0), x.stride(1), x.stride(2), ld_out, hist_len, fmax,
        AMAX_FLOOR, HALF=d // 2, BH=bh, BD=bd, ROTATE=rotate, INVERSE=inverse, AMAX=amax is not None,
        HIST=triton.next_power_of_2(hist_len) if hist_len else 0, num_warps=4)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    check_rope_input(x, cos, sin)
    b, s, nh, d = x.shape
    out = torch.empty((b, s, nh, d), dtype=x.dtype, device=x.device)
    rope_launch(x, cos.contiguous(), sin.contiguous(), out, nh * d)
    return out


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] (any strides, unit last stride) into a new contiguous tensor. No
    autograd: the caller's backward runs the inverse (megacoat.coat.flow, ops.rope_grad_cast)."""
    return dispatch(_rope_op, x, rope_triton, rope_ref, x, cos, sin)


@fp8_operator("megacoat::rope")
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation as an operator (torch.compile traces through it; eager calls skip it: numerics.dispatch)."""
    return traced_body(x, rope_triton, rope_ref, x, cos, sin)
