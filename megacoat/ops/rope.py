"""Rotary position embedding, forward and backward in one Triton kernel, with its torch reference.

Same convention as the model's apply_rope: pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] rotated
by the position's angle, computed in fp32, returned in x's dtype. Backward is the rotation by minus the angle,
so nothing but the (shared, constant) cos/sin tables is kept for it. The kernel reads x through its strides:
q and k can be column slices of the fused [q|k|v] GEMM output, with no copy before the rotation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"rope expects x [batch, seq, heads, even head_dim] with unit last stride, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if cos.shape != sin.shape or cos.shape[0] < x.shape[1] or cos.shape[1] != x.shape[-1] // 2:
        raise ValueError(f"rope tables {tuple(cos.shape)} do not cover seq {x.shape[1]} x head_dim/2 "
                         f"{x.shape[-1] // 2}")


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    _check(x, cos, sin)
    seq = x.shape[1]
    c = cos[:seq].view(1, seq, 1, -1)
    s = sin[:seq].view(1, seq, 1, -1)
    if inverse:
        s = -s
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, R, S, NH, stride_b, stride_s, stride_h, sign,
                 HALF: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)  # row = (batch, position, head)
    head = r % NH
    t = r // NH
    pos = t % S
    src = (t // S) * stride_b + pos * stride_s + head * stride_h
    i = tl.arange(0, BH)
    mask = (r < R)[:, None] & (i < HALF)[None, :]
    x0 = tl.load(x_ptr + src[:, None] + 2 * i[None, :], mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + src[:, None] + 2 * i[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos[:, None] * HALF + i[None, :], mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * HALF + i[None, :], mask=mask, other=0.0) * sign
    dst = r[:, None] * (2 * HALF) + 2 * i[None, :]
    tl.store(out_ptr + dst, (x0 * c - x1 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + dst + 1, (x0 * s + x1 * c).to(out_ptr.dtype.element_ty), mask=mask)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    _check(x, cos, sin)
    b, s, nh, d = x.shape
    out = torch.empty((b, s, nh, d), dtype=x.dtype, device=x.device)
    rows = b * s * nh
    br = 32
    _rope_kernel[(triton.cdiv(rows, br),)](
        x, cos.contiguous(), sin.contiguous(), out, rows, s, nh, x.stride(0), x.stride(1), x.stride(2),
        -1.0 if inverse else 1.0, HALF=d // 2, BH=triton.next_power_of_2(d // 2), BR=br, num_warps=4)
    return out


def _rope(x, cos, sin, inverse=False):
    return (rope_triton if x.is_cuda else rope_ref)(x, cos, sin, inverse)


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.tables = (cos, sin)  # constants of the model, not activations
        return _rope(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_out):
        return _rope(grad_out.contiguous(), *ctx.tables, inverse=True), None, None


@torch.compiler.disable  # runs its own Triton kernel; torch.compile graph-breaks around it
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] (any strides, unit last stride); returns a contiguous tensor."""
    return RopeFunction.apply(x, cos, sin)
