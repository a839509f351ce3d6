"""The attention block's [q|k|v] output gradient, from attention's dq, dk, dv to its FP8 GEMM operands.

In coat mode [q|k|v] is one FP8 GEMM output; q and k are rotated (RoPE) before attention. Its gradient needs
RoPE's backward of dq and dk, the join of dq|dk|dv into one [M, N] tensor (M tokens, N = q + k + v columns), its
amax, and the cast into g8 [M, N] (dgrad) and g8^T [N, M] (wgrad). Here RoPE's kernel (megacoat.ops.rope) reads
dq, dk, dv where attention left them (any strides, unit last stride), rotates q's and k's by minus the angle, copies
v's, writes each straight into its columns of the joined gradient and folds the amax in; one cast pass
(megacoat.ops.cast_transpose) then writes both layouts. Four launches, about 8 bytes moved per element, against
the unfused path's ~13 (separate rotations, a torch.cat, a separate amax pass).

(Casting from dq, dk, dv in place, without the joined tensor, moves fewer bytes but its tiles of 64 tokens x 64
columns ran 3.3x slower than this on the H100: benchmarks/results/bench_e2e_notes.md.)

The arithmetic is the unfused path's: the rotation in fp32 rounded to the gradients' dtype, then the per-tensor
cast of quantize_transpose (same scale, same reciprocal, same clamp). The reference is that path itself; on CUDA,
fp32 FMA contraction may move a rotated value by an ulp before its rounding.
"""
from __future__ import annotations

import torch

from megacoat.ops.cast_transpose import cast_from_amax_triton, quantize_transpose_ref
from megacoat.ops.numerics import dispatch, fp8_operator, traced_body
from megacoat.ops.rope import check_rope_input, rope_launch, rope_ref


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


def rope_qkv_grad_fp8_triton(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    _check(dq, dk, dv, cos, sin)
    m = dq.shape[0] * dq.shape[1]
    widths = [t.shape[2] * t.shape[3] for t in (dq, dk, dv)]
    g = torch.empty((m, sum(widths)), dtype=dq.dtype, device=dq.device)
    amax = torch.zeros((1,), dtype=torch.float32, device=dq.device)  # |g| >= 0: zero is the neutral start
    cos, sin = cos.contiguous(), sin.contiguous()
    col = 0
    for t, width, rotate in zip((dq, dk, dv), widths, (True, True, False)):
        rope_launch(t, cos, sin, g[:, col:], g.shape[1], rotate=rotate, inverse=True, amax=amax)
        col += width
    return cast_from_amax_triton(g, amax, grad_dtype, True, True)


def rope_qkv_grad_fp8(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    """(g8 [M, N], g8^T [N, M], scale): the per-tensor FP8 quantization (grad_dtype) of the [q|k|v] output
    gradient, M = batch x seq, given attention's gradients dq, dk, dv [batch, seq, heads, head_dim] of the
    rotated q and k and of v. Four launches on CUDA, nothing read back to the host."""
    return dispatch(_op, dq, rope_qkv_grad_fp8_triton, rope_qkv_grad_fp8_ref, dq, dk, dv, cos, sin, grad_dtype)


@fp8_operator("megacoat::rope_qkv_grad_fp8")
def _op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return traced_body(dq, rope_qkv_grad_fp8_triton, rope_qkv_grad_fp8_ref, dq, dk, dv, cos, sin, grad_dtype)
