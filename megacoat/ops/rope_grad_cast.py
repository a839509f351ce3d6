"""The attention block's [q|k|v] output gradient, from attention's dq, dk, dv to its FP8 GEMM operands.

In coat mode [q|k|v] is one FP8 GEMM output; q and k are rotated (RoPE) before attention. Its gradient needs
RoPE's backward of dq and dk, the join of dq|dk|dv into one [M, N] tensor (M tokens, N = q + k + v columns), its
amax, and the cast into g8 [M, N] (dgrad) and g8^T [N, M] (wgrad). Here RoPE's kernel (megacoat.ops.rope) reads
dq, dk, dv where attention left them (any strides, unit last stride), rotates q's and k's by minus the angle, copies
v's, writes each straight into its columns of the joined gradient and folds the amax in; one cast pass
(megacoat.ops.cast_transpose) then writes both layouts. Four launches, about 8 bytes moved per element, against
the unfused path's ~13 (separate rotations, a torch.cat, a separate amax pass).

With delayed scaling (`rope_qkv_grad_fp8_delayed`, --fp8-grad-scaling delayed) the scale is known before the pass,
so RoPE's kernel, keeping its one-token programs, writes the FP8 codes row-major itself, rounding each value to the
gradients' dtype first as the joined tensor would hold it; g8^T is then a byte transpose with the cast's tile
(megacoat.ops.cast_transpose.transpose_fp8_triton). About 5 bytes per element instead of 8, and the same bytes as
the current path whenever the history's maximum is this call's amax.

The arithmetic is the unfused path's: the rotation in fp32 rounded to the gradients' dtype, then the per-tensor
cast of quantize_transpose (same scale, same reciprocal, same clamp). The reference is that path itself; on CUDA,
fp32 FMA contraction may move a rotated value by an ulp before its rounding.
"""
from __future__ import annotations

import torch

from megacoat.ops.cast_transpose import (cast_from_amax_triton, cast_transpose_ref, quantize_transpose_ref,
                                         tensor_amax, transpose_fp8_triton)
from megacoat.ops.numerics import dispatch, fp8_operator, traced_body
from megacoat.ops.rope import check_rope_input, rope_launch, rope_ref
from megacoat.ops.tensor_scale import amax_workspace, delayed_scale, record_amax, roll_history


def _check(dq, dk, dv, cos, sin) -> None:
    check_rope_input(dq, cos, sin)  # dq's layout and the tables; dk and dv must then agree with dq
    for name, t in (("dk", dk), ("dv", dv)):
        if t.dim() != 4 or t.shape[:2] != dq.shape[:2] or t.shape[-1] != dq.shape[-1] or t.stride(-1) != 1 \
                or t.dtype != dq.dtype:
            raise ValueError(f"rope_qkv_grad_fp8: {name} must be [batch, seq, heads, head_dim] in {dq.dtype} with "
                             f"unit last stride like dq {tuple(dq.shape)}, got {tuple(t.shape)} {t.dtype} "
                             f"{t.stride()}")


def _joined_ref(dq, dk, dv, cos, sin) -> torch.Tensor:
    """The joined [q|k|v] gradient [M, N] in dq's dtype: RoPE's backward of dq and dk, the join with dv."""
    _check(dq, dk, dv, cos, sin)
    m = dq.shape[0] * dq.shape[1]
    return torch.cat([rope_ref(dq, cos, sin, inverse=True).reshape(m, -1),
                      rope_ref(dk, cos, sin, inverse=True).reshape(m, -1), dv.reshape(m, -1)], dim=1)


def rope_qkv_grad_fp8_ref(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    """Reference, the unfused path itself: RoPE's backward of dq and dk, the join with dv, quantize_transpose."""
    return quantize_transpose_ref(_joined_ref(dq, dk, dv, cos, sin), grad_dtype)


def rope_qkv_grad_fp8_triton(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    return _current(dq, dk, dv, cos, sin, grad_dtype)[:3]


def _current(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    """→ (g8, g8t, scale, amax): the joined gradient in dq's dtype with its amax folded in, then one cast."""
    g, amax = _joined_triton(dq, dk, dv, cos, sin, dq.dtype)
    return (*cast_from_amax_triton(g, amax, grad_dtype, True, True), amax)


def _joined_triton(dq, dk, dv, cos, sin, dtype: torch.dtype, history=None, scale=None):
    """→ (the joined gradient [M, N] in dtype, its amax): RoPE's kernel per part, straight into its columns. dtype
    FP8 with history and scale: the codes, cast with the history's scale (rope_launch)."""
    _check(dq, dk, dv, cos, sin)
    m = dq.shape[0] * dq.shape[1]
    widths = [t.shape[2] * t.shape[3] for t in (dq, dk, dv)]
    g = torch.empty((m, sum(widths)), dtype=dtype, device=dq.device)
    amax = amax_workspace(dq.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    col = 0
    for t, width, rotate in zip((dq, dk, dv), widths, (True, True, False)):
        rope_launch(t, cos, sin, g[:, col:], g.shape[1], rotate=rotate, inverse=True, amax=amax, history=history,
                    scale=scale)
        col += width
    return g, amax


def rope_qkv_grad_fp8_delayed_ref(dq, dk, dv, cos, sin, grad_dtype: torch.dtype, history: torch.Tensor,
                                  bootstrap: bool = False):
    """rope_qkv_grad_fp8 with delayed scaling: the scale comes from max(history), the amaxes of earlier calls
    (bootstrap: from this call's own amax, as rope_qkv_grad_fp8); values beyond it saturate. history [L] (float32,
    most recent first) is rolled in place, this call's amax in front."""
    g = _joined_ref(dq, dk, dv, cos, sin)
    amax = tensor_amax(g).float()
    scale = delayed_scale(amax, history, grad_dtype, bootstrap)
    q, qt = cast_transpose_ref(g, scale, grad_dtype)
    record_amax(history, amax)
    return q, qt, scale


def rope_qkv_grad_fp8_delayed_triton(dq, dk, dv, cos, sin, grad_dtype: torch.dtype, history: torch.Tensor,
                                     bootstrap: bool = False):
    """Delayed scaling: RoPE's kernel casts as it writes, so the joined gradient exists only in FP8 (row-major),
    and its transpose is a byte copy: per element 2 bytes read and 1 written, then 1 and 1, against the current
    path's 2 + 2 (the BF16 joined gradient) and 2 + 2 (its cast). Then the one-program roll of the history.
    bootstrap: the current path (this call's own amax), then the roll."""
    if bootstrap:
        g8, g8t, scale, amax = _current(dq, dk, dv, cos, sin, grad_dtype)
    else:
        scale = torch.empty((1,), dtype=torch.float32, device=dq.device)
        g8, amax = _joined_triton(dq, dk, dv, cos, sin, grad_dtype, history, scale)
        g8t = transpose_fp8_triton(g8)
    roll_history(history, amax)
    return g8, g8t, scale


def rope_qkv_grad_fp8(dq, dk, dv, cos, sin, grad_dtype: torch.dtype):
    """(g8 [M, N], g8^T [N, M], scale): the per-tensor FP8 quantization (grad_dtype) of the [q|k|v] output
    gradient, M = batch x seq, given attention's gradients dq, dk, dv [batch, seq, heads, head_dim] of the
    rotated q and k and of v. Four launches on CUDA, nothing read back to the host."""
    return dispatch(_op, dq, rope_qkv_grad_fp8_triton, rope_qkv_grad_fp8_ref, dq, dk, dv, cos, sin, grad_dtype)


def rope_qkv_grad_fp8_delayed(dq, dk, dv, cos, sin, grad_dtype: torch.dtype, history: torch.Tensor,
                              bootstrap: bool = False):
    """rope_qkv_grad_fp8 with delayed scaling (rope_qkv_grad_fp8_delayed_ref): the cast in RoPE's pass, no BF16
    joined gradient; `history` rolled in place."""
    return dispatch(_delayed_op, dq, rope_qkv_grad_fp8_delayed_triton, rope_qkv_grad_fp8_delayed_ref,
                    dq, dk, dv, cos, sin, grad_dtype, history, bootstrap)


@fp8_operator("megacoat::rope_qkv_grad_fp8")
def _op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return traced_body(dq, rope_qkv_grad_fp8_triton, rope_qkv_grad_fp8_ref, dq, dk, dv, cos, sin, grad_dtype)


@fp8_operator("megacoat::rope_qkv_grad_fp8_delayed", mutates_args=("history",))
def _delayed_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                grad_dtype: torch.dtype, history: torch.Tensor,
                bootstrap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return traced_body(dq, rope_qkv_grad_fp8_delayed_triton, rope_qkv_grad_fp8_delayed_ref, dq, dk, dv, cos, sin,
                       grad_dtype, history, bootstrap)
