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
import triton
import triton.language as tl

from megacoat.ops.cast_transpose import (cast_from_amax_triton, cast_transpose_ref, quantize_transpose_ref,
                                         tensor_amax, transpose_fp8_triton)
from megacoat.ops.numerics import AMAX_FLOOR, dispatch, fp8_operator, launcher, traced_body
from megacoat.ops.rope import check_rope_input, rope_launch, rope_ref
from megacoat.ops.tensor_scale import (amax_workspace, delayed_scale, history_scale, record_amax,
                                       record_program_amax, roll_history, scaled_codes)


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


# The delayed path in one pass per part: a program takes BT tokens of HPP heads and writes their codes in both
# layouts, row-major g8 (rows of head_dim bytes) and g8^T (rows of BT bytes), so no byte transpose follows. The
# tables' rows for its BT positions are loaded once for the HPP heads. Same arithmetic as _rope_kernel's cast.
@triton.jit
def _rope_grad_tiles_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, outt_ptr, amax_ptr, hist_ptr, scale_ptr, M, S, NH,
                            col0, ld_out, stride_b, stride_s, stride_h, hist_len, fmax, amax_floor,
                            HALF: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HPP: tl.constexpr,
                            ROTATE: tl.constexpr, HIST: tl.constexpr):
    rt = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # tokens = batch x seq + position
    pos = rt % S
    row = (rt // S) * stride_b + pos * stride_s
    d = tl.arange(0, 2 * BD)
    dmask = d < 2 * HALF
    tmask = rt < M
    scale = history_scale(scale_ptr, hist_ptr, hist_len, fmax, amax_floor, HIST)
    ty = x_ptr.dtype.element_ty
    if ROTATE:
        i = tl.arange(0, BD)
        tab = pos[:, None] * HALF + i[None, :]
        tmask2 = tmask[:, None] & (i < HALF)[None, :]
        c = tl.load(cos_ptr + tab, mask=tmask2, other=0.0)
        s = -tl.load(sin_ptr + tab, mask=tmask2, other=0.0)  # the rotation's transpose: the angle's negative
    amax = 0.0
    for j in tl.static_range(HPP):
        h = tl.program_id(1) * HPP + j
        hmask = (tmask & (rt * 0 + h < NH))[:, None] & dmask[None, :]
        x = tl.load(x_ptr + row[:, None] + h.to(tl.int64) * stride_h + d[None, :], mask=hmask, other=0.0)
        if ROTATE:
            x0, x1 = tl.split(tl.reshape(x.to(tl.float32), (BT, BD, 2)))
            y = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), (BT, 2 * BD)).to(ty).to(tl.float32)
        else:
            y = x.to(tl.float32)
        q = scaled_codes(y, scale, fmax).to(out_ptr.dtype.element_ty)
        col = (col0 + h * (2 * HALF) + d).to(tl.int64)
        tl.store(out_ptr + rt[:, None] * ld_out + col[None, :], q, mask=hmask)
        tl.store(outt_ptr + col[:, None] * M + rt[None, :], tl.trans(q), mask=tl.trans(hmask))
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    record_program_amax(amax, amax_ptr)


_TILES_BT, _TILES_HPP, _TILES_WARPS = 64, 4, 4


def _tiles_triton(dq, dk, dv, cos, sin, grad_dtype, history, scale):
    """→ (g8, g8t, amax): the delayed cast of the joined gradient in both layouts, one tiled pass per part."""
    _check(dq, dk, dv, cos, sin)
    b, s = dq.shape[:2]
    m = b * s
    widths = [t.shape[2] * t.shape[3] for t in (dq, dk, dv)]
    n = sum(widths)
    g8 = torch.empty((m, n), dtype=grad_dtype, device=dq.device)
    g8t = torch.empty((n, m), dtype=grad_dtype, device=dq.device)
    amax = amax_workspace(dq.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    bt, hpp, warps = _TILES_BT, _TILES_HPP, _TILES_WARPS
    half = dq.shape[3] // 2
    col = 0
    for t, width, rotate in zip((dq, dk, dv), widths, (True, True, False)):
        nh = t.shape[2]
        launcher(_rope_grad_tiles_kernel)[(triton.cdiv(m, bt), triton.cdiv(nh, hpp))](
            t, cos, sin, g8, g8t, amax, history, scale, m, s, nh, col, n, t.stride(0), t.stride(1), t.stride(2),
            history.numel(), torch.finfo(grad_dtype).max, AMAX_FLOOR, HALF=half,
            BD=triton.next_power_of_2(half), BT=bt, HPP=hpp, ROTATE=rotate,
            HIST=triton.next_power_of_2(history.numel()), num_warps=warps)
        col += width
    return g8, g8t, amax


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
