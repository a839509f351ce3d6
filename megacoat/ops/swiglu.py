"""Fused FP8 SwiGLU, silu(a1) * a3, for the COAT precision flow (Triton, forward and backward, torch references).

a13 [M, 2F] is the output of the fused w1|w3 GEMM (gate in the first F columns, up in the last F).
Forward `swiglu_fp8_fwd`, two launches:
  1. read a13 once; write a1 and a3 as E4M3 with 1xG group scales (what backward keeps: 2 bytes per pair instead
     of BF16's 4 plus silu's output) and fold the amax of s = silu(a1) * a3, computed from the dequantized values,
     into one float by a relaxed atomic max that no program waits on (megacoat.ops.tensor_scale);
  2. re-read the FP8 pair and write s row-major for the down projection's GEMM, with the per-tensor scale that
     each program derives from that amax (the first program also stores it for the GEMM).
`swiglu_fp8_out` writes s again from the saved pair and a known scale (transposed: the down projection's weight
gradient operand, made again in backward instead of saved).
`swiglu_fp8_fwd_delayed` (delayed scaling, megacoat.coat.delayed_scaling) does both in the first launch: the scale
comes from an amax history, the kernel writes s row-major beside the pair, and a one-program launch after it rolls
this call's amax into the history (the pair is not read again: 2 bytes per pair fewer).
Backward, two passes over ds and the saved pair (the per-tensor scale needs the whole tensor's amax before any
byte is written, so ds, a1, a3 are read twice; 12 bytes per (token, ffn) pair in all): `swiglu_fp8_bwd`'s first
kernel reduces max|da1|, |da3| into one float by atomic max; the second derives the scale from it and writes
da13 [M, 2F] for the dgrad GEMM and da13^T [2F, M] for the wgrad GEMM from one read. `swiglu_fp8_bwd_out_t`
also writes s^T in the first pass, in place of a `swiglu_fp8_out(transpose=True)` launch.
`swiglu_fp8_bwd_delayed` (delayed scaling, megacoat.coat.delayed_scaling) runs the second pass alone: its scale comes
from an amax history, and the pass writes s^T and records this call's amax for the history's roll (8 bytes per
pair instead of 12).
On the GPU the kernels use the cheaper math of megacoat.ops.triton_math (fast sigmoid, saturating casts).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.tensor_scale import (amax_workspace, cast_scale, delayed_scale, history_scale, record_amax,
                                       record_program_amax, roll_history)
from megacoat.ops.numerics import (AMAX_FLOOR, FAST, check_group_size, dispatch, div_cast, group_dequantize,
                                   group_quantize, fp8_operator, launcher, scale_from_amax, traced_body)
from megacoat.ops.triton_math import div_saturate, saturate, sigmoid

E4M3 = torch.float8_e4m3fn


def _check(a13: torch.Tensor, group_size: int) -> int:
    if a13.dim() != 2 or a13.shape[1] % 2:
        raise ValueError(f"swiglu expects a13 [M, 2F] (gate | up), got shape {tuple(a13.shape)}")
    check_group_size(group_size)
    return a13.shape[1] // 2


def _scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return scale_from_amax(amax.amax(), dtype).reshape(1)


# ----------------------------------------------------------------------------------------------- references
def swiglu_fp8_fwd_ref(a13, group_size: int, out_dtype=E4M3):
    """→ (a1_8, a1_scales, a3_8, a3_scales, s_scale, s8): the saved FP8 pair, and s cast with its own per-tensor
    scale, row-major for the down projection's GEMM."""
    *pair, s = _pair_and_s(a13, group_size)
    s_scale = _scale(s.abs().amax(), out_dtype)
    return (*pair, s_scale, div_cast(s, s_scale, out_dtype))


def _pair_and_s(a13, group_size: int):
    """→ (a1_8, s1, a3_8, s3, s): the saved FP8 pair and s = silu(a1) * a3 in fp32 from its dequantized values."""
    f = _check(a13, group_size)
    a1_8, s1 = group_quantize(a13[:, :f], group_size, E4M3)
    a3_8, s3 = group_quantize(a13[:, f:], group_size, E4M3)
    return a1_8, s1, a3_8, s3, _silu_mul(group_dequantize(a1_8, s1, group_size), group_dequantize(a3_8, s3, group_size))


def swiglu_fp8_fwd_delayed_ref(a13, history, group_size: int, out_dtype=E4M3, bootstrap: bool = False):
    """swiglu_fp8_fwd with delayed scaling: → (a1_8, s1, a3_8, s3, s_scale, s8),
    s_scale from max(history), the amaxes of earlier calls (bootstrap: from this call's own amax, as
    swiglu_fp8_fwd); values beyond it saturate. history [L] (float32, most recent first) is rolled in place, this
    call's amax in front (zero for a non-finite one). s is made once (the CPU path's peak: one fp32 [M, F])."""
    *pair, s = _pair_and_s(a13, group_size)
    amax = s.abs().amax()
    s_scale = delayed_scale(amax, history, out_dtype, bootstrap)
    s8 = div_cast(s, s_scale, out_dtype)
    record_amax(history, amax)
    return (*pair, s_scale, s8)


def _silu_mul(a1, a3):
    return a1 * torch.sigmoid(a1) * a3


def swiglu_fp8_out_ref(a1_8, s1, a3_8, s3, s_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    q = div_cast(_silu_mul(group_dequantize(a1_8, s1, group_size), group_dequantize(a3_8, s3, group_size)), s_scale,
                 out_dtype)
    return q.t().contiguous() if transpose else q


def swiglu_fp8_bwd_out_t_ref(ds, a1_8, s1, a3_8, s3, s_scale, group_size: int, grad_dtype=torch.float8_e5m2,
                             out_dtype=E4M3):
    """→ (da13, da13^T, scale, s^T): swiglu_fp8_bwd and swiglu_fp8_out(transpose=True) in one call."""
    return (*swiglu_fp8_bwd_ref(ds, a1_8, s1, a3_8, s3, group_size, grad_dtype),
            swiglu_fp8_out_ref(a1_8, s1, a3_8, s3, s_scale, group_size, True, out_dtype))


def swiglu_fp8_bwd_ref(ds, a1_8, s1, a3_8, s3, group_size: int, grad_dtype=torch.float8_e5m2):
    """→ (da13 [M, 2F], da13^T [2F, M], scale): d(silu(a1) a3) in `grad_dtype` with one per-tensor scale."""
    da = _da_ref(ds, a1_8, s1, a3_8, s3, group_size)
    return _cast_ref(da, _scale(da.abs().amax(), grad_dtype), grad_dtype)


def _da_ref(ds, a1_8, s1, a3_8, s3, group_size: int) -> torch.Tensor:
    """da1 | da3 [M, 2F] in float32."""
    a1 = group_dequantize(a1_8, s1, group_size)
    a3 = group_dequantize(a3_8, s3, group_size)
    sig = torch.sigmoid(a1)
    dsf = ds.float()
    return torch.cat((dsf * a3 * sig * (1 + a1 * (1 - sig)), dsf * a1 * sig), dim=1)


def _cast_ref(da, scale, grad_dtype):
    q = div_cast(da, scale, grad_dtype)
    return q, q.t().contiguous(), scale


def swiglu_fp8_bwd_delayed_ref(ds, a1_8, s1, a3_8, s3, s_scale, history, group_size: int,
                               grad_dtype=torch.float8_e5m2, out_dtype=E4M3, bootstrap: bool = False):
    """swiglu_fp8_bwd_out_t with delayed scaling: the scale comes from max(history), the amaxes of earlier calls
    (bootstrap: from this call's own amax, as swiglu_fp8_bwd_out_t); values beyond it saturate at the format's
    max. history [L] (float32, most recent first) is rolled in place, this call's amax in front (zero for a
    non-finite one: that step is refused anyway, and later calls should not inherit it)."""
    da = _da_ref(ds, a1_8, s1, a3_8, s3, group_size)
    amax = da.abs().amax().reshape(1)
    q, qt, scale = _cast_ref(da, delayed_scale(amax, history, grad_dtype, bootstrap), grad_dtype)
    del da  # float32 [M, 2F]: gone before s^T is made, as in swiglu_fp8_bwd_out_t_ref
    st = swiglu_fp8_out_ref(a1_8, s1, a3_8, s3, s_scale, group_size, True, out_dtype)
    record_amax(history, amax)
    return q, qt, scale, st


# --------------------------------------------------------------------------------------------------- triton
# Tiles are [BM, G]: one group per row of a tile, so group amaxes are row reductions (no 3-D reshapes, which
# Triton 3.6 mis-compiles on Hopper around FP8 values). A program's column tile is group column gi.
@triton.jit
def _load_pair(a1_ptr, s1_ptr, a3_ptr, s3_ptr, rm, rn, gi, mask, M, F, NG):
    """Dequantized a1, a3 tiles [BM, G] from their E4M3 data and 1xG scales."""
    row_ok = rm < M
    offs = rm[:, None] * F + rn[None, :]
    a1 = tl.load(a1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a3 = tl.load(a3_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g1 = tl.load(s1_ptr + rm * NG + gi, mask=row_ok, other=0.0)
    g3 = tl.load(s3_ptr + rm * NG + gi, mask=row_ok, other=0.0)
    return a1 * g1[:, None], a3 * g3[:, None]


@triton.jit
def _fwd_kernel(a_ptr, a1_ptr, s1_ptr, a3_ptr, s3_ptr, amax_ptr, scale_ptr, y_ptr, hist_ptr, hist_len,
                M, F, NG, fmax_in, fmax_out, amax_floor, G: tl.constexpr, BM: tl.constexpr, FAST: tl.constexpr,
                HIST: tl.constexpr):
    """The tile amaxes of s go into amax (megacoat.ops.tensor_scale), for _out_kernel's scale (current scaling) or
    for roll_history. HIST > 0 (delayed scaling): s's scale comes from the amax history's maximum and s is
    written here (row-major, _out_kernel's bytes).
    A 1-D grid, group columns fastest: the programs in flight read and write whole rows of a few row blocks (every
    store is row-major), not one 256-byte piece of each of many rows."""
    pid = tl.program_id(0)
    gi = pid % NG
    rm = ((pid // NG) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (gi * G + tl.arange(0, G)).to(tl.int64)
    row_ok = rm < M
    mask = row_ok[:, None] & (rn[None, :] < F)
    offs = rm[:, None] * F + rn[None, :]
    x1 = tl.load(a_ptr + rm[:, None] * (2 * F) + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(a_ptr + rm[:, None] * (2 * F) + F + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    g1 = tl.maximum(tl.max(tl.abs(x1), axis=1), amax_floor) / fmax_in
    g3 = tl.maximum(tl.max(tl.abs(x3), axis=1), amax_floor) / fmax_in
    q1 = saturate(x1 / g1[:, None], fmax_in, FAST).to(a1_ptr.dtype.element_ty)
    q3 = saturate(x3 / g3[:, None], fmax_in, FAST).to(a3_ptr.dtype.element_ty)
    tl.store(a1_ptr + offs, q1, mask=mask)
    tl.store(a3_ptr + offs, q3, mask=mask)
    tl.store(s1_ptr + rm * NG + gi, g1, mask=row_ok)
    tl.store(s3_ptr + rm * NG + gi, g3, mask=row_ok)
    a1 = q1.to(tl.float32) * g1[:, None]
    a3 = q3.to(tl.float32) * g3[:, None]
    s = a1 * sigmoid(a1, FAST) * a3
    amax = tl.max(tl.max(tl.abs(s), axis=1), axis=0)
    if HIST > 0:
        scale = history_scale(scale_ptr, hist_ptr, hist_len, fmax_out, amax_floor, HIST)
        tl.store(y_ptr + offs, div_saturate(s, scale, fmax_out, FAST).to(y_ptr.dtype.element_ty), mask=mask)
    record_program_amax(amax, amax_ptr)


@triton.jit
def _out_kernel(a1_ptr, s1_ptr, a3_ptr, s3_ptr, scale_ptr, amax_ptr, y_ptr, M, F, NG, fmax_out, amax_floor,
                TRANSPOSE: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, FAST: tl.constexpr,
                FROM_AMAX: tl.constexpr):
    """FROM_AMAX: the scale comes from _fwd_kernel's total amax (tensor_scale.cast_scale)."""
    scale = cast_scale(scale_ptr, amax_ptr, fmax_out, amax_floor, FROM_AMAX)
    # Reverse order: the forward runs this right after _fwd_kernel, whose last row blocks (written last) are still
    # in L2 for the first programs here.
    gi = tl.num_programs(1) - 1 - tl.program_id(1)
    rm = ((tl.num_programs(0) - 1 - tl.program_id(0)) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (gi * G + tl.arange(0, G)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < F)
    a1, a3 = _load_pair(a1_ptr, s1_ptr, a3_ptr, s3_ptr, rm, rn, gi, mask, M, F, NG)
    q = div_saturate(a1 * sigmoid(a1, FAST) * a3, scale, fmax_out, FAST)
    if TRANSPOSE:
        tl.store(y_ptr + rn[:, None] * M + rm[None, :], tl.trans(q).to(y_ptr.dtype.element_ty), mask=tl.trans(mask))
    else:
        tl.store(y_ptr + rm[:, None] * F + rn[None, :], q.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _da_tile(ds_ptr, a1_ptr, s1_ptr, a3_ptr, s3_ptr, rm, rn, gi, mask, M, F, NG, FAST: tl.constexpr):
    """da1 = ds a3 sig (1 + a1 (1 - sig)), da3 = ds silu(a1) and the forward's s = silu(a1) a3 (computed as
    _out_kernel does, so both write the same bytes; dropped by the compiler where unused) on a [BM, G] tile."""
    a1, a3 = _load_pair(a1_ptr, s1_ptr, a3_ptr, s3_ptr, rm, rn, gi, mask, M, F, NG)
    ds = tl.load(ds_ptr + rm[:, None] * F + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = sigmoid(a1, FAST)
    silu = a1 * sig  # shared: d silu / d a1 = sig (1 + a1 (1 - sig)) = sig + silu (1 - sig)
    return ds * a3 * (sig + silu * (1 - sig)), ds * silu, silu * a3


@triton.jit
def _bwd_amax_kernel(ds_ptr, a1_ptr, s1_ptr, a3_ptr, s3_ptr, amax_ptr, s_scale_ptr, st_ptr, M, F, NG, fmax_s,
                     G: tl.constexpr, BM: tl.constexpr, FAST: tl.constexpr, WRITE_ST: tl.constexpr):
    """Pass 1: max |da1|, |da3| into one float (they share one scale, as one [M, 2F] GEMM operand). The
    atomic max (relaxed: nothing waits on it; pass 2 reads the total) needs no partial-amax array and no torch
    reductions over it (three launches).
    WRITE_ST: also write s^T [F, M] (the down projection's wgrad operand) from the pair this pass reads
    anyway, instead of a swiglu_fp8_out(transpose=True) launch that reads it once more."""
    gi = tl.program_id(1)
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (gi * G + tl.arange(0, G)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < F)
    da1, da3, s = _da_tile(ds_ptr, a1_ptr, s1_ptr, a3_ptr, s3_ptr, rm, rn, gi, mask, M, F, NG, FAST)
    record_program_amax(tl.max(tl.max(tl.maximum(tl.abs(da1), tl.abs(da3)), axis=1), axis=0), amax_ptr)
    if WRITE_ST:
        q = div_saturate(s, tl.load(s_scale_ptr), fmax_s, FAST)
        tl.store(st_ptr + rn[:, None] * M + rm[None, :], tl.trans(q).to(st_ptr.dtype.element_ty),
                 mask=tl.trans(mask))


@triton.jit
def _bwd_cast_kernel(ds_ptr, a1_ptr, s1_ptr, a3_ptr, s3_ptr, amax_ptr, scale_ptr, out_ptr, outt_ptr, s_scale_ptr,
                     st_ptr, amax_out_ptr, hist_ptr, hist_len, M, F, NG, fmax_g, fmax_s, amax_floor,
                     G: tl.constexpr, BM: tl.constexpr, FAST: tl.constexpr, WRITE_ST: tl.constexpr,
                     HIST: tl.constexpr):
    """Pass 2: one read of ds, a1, a3 writes da1|da3 both row-major [M, 2F] (dgrad) and transposed [2F, M]
    (wgrad). Tiles run in the reverse order of pass 1, so the first ones read what pass 1 left in L2.
    Delayed scaling (HIST > 0) runs this pass alone: the scale comes from the amax history's maximum, WRITE_ST
    writes s^T (pass 1's other job), and this call's max |da1|, |da3| is folded into amax_out, which
    roll_history puts into the history after the pass (megacoat.ops.tensor_scale)."""
    gi = tl.num_programs(1) - 1 - tl.program_id(1)
    rm = ((tl.num_programs(0) - 1 - tl.program_id(0)) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (gi * G + tl.arange(0, G)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < F)
    if HIST > 0:
        scale = history_scale(scale_ptr, hist_ptr, hist_len, fmax_g, amax_floor, HIST)
    else:  # IEEE, as the reference's torch division
        scale = cast_scale(scale_ptr, amax_ptr, fmax_g, amax_floor, True)
    da1, da3, s = _da_tile(ds_ptr, a1_ptr, s1_ptr, a3_ptr, s3_ptr, rm, rn, gi, mask, M, F, NG, FAST)
    if HIST > 0:
        record_program_amax(tl.max(tl.max(tl.maximum(tl.abs(da1), tl.abs(da3)), axis=1), axis=0), amax_out_ptr)
    if WRITE_ST:
        qs = div_saturate(s, tl.load(s_scale_ptr), fmax_s, FAST)
        tl.store(st_ptr + rn[:, None] * M + rm[None, :], tl.trans(qs).to(st_ptr.dtype.element_ty),
                 mask=tl.trans(mask))
    ty = out_ptr.dtype.element_ty
    inv = 1.0 / scale  # as in div_saturate, with one branch for both halves
    if inv < 3.0e38:
        q1, q3 = da1 * inv, da3 * inv
    else:
        q1, q3 = da1 / scale, da3 / scale
    q1 = saturate(q1, fmax_g, FAST).to(ty)
    q3 = saturate(q3, fmax_g, FAST).to(ty)
    row = out_ptr + rm[:, None] * (2 * F) + rn[None, :]
    tl.store(row, q1, mask=mask)
    tl.store(row + F, q3, mask=mask)
    col = rn[:, None] * M + rm[None, :]
    tl.store(outt_ptr + col, tl.trans(q1), mask=tl.trans(mask))
    tl.store(outt_ptr + F.to(tl.int64) * M + col, tl.trans(q3), mask=tl.trans(mask))  # da3^T: rows F..2F


_BM = 32
_BM_F, _WARPS_F = 32, 4  # the forward's tile
_BM_T, _WARPS_T = 64, 8  # the transposed store writes BM contiguous bytes per row: 64 of them
_TILES = {"forward": ("_BM_F", "_WARPS_F"), "backward": ("_BM_T", "_WARPS_T")}


def tiles() -> dict[str, tuple[int, ...]]:
    """Each kernel's launch tile (rows, warps), read at every launch: {"forward": .., "backward": ..}."""
    return {kernel: tuple(globals()[name] for name in names) for kernel, names in _TILES.items()}


def set_tile(kernel: str, tile: tuple[int, ...]) -> None:
    """Launch `kernel` with another tile from now on (the benchmarks' tile sweeps); tiles() before it gives the
    library's."""
    globals().update(dict(zip(_TILES[kernel], tile, strict=True)))  # all or nothing


def swiglu_fp8_fwd_triton(a13, group_size: int, out_dtype=E4M3):
    """Current scaling: after one memset, the first launch writes the pair and folds s's amax, the second writes s."""
    return _fwd_launch(a13, group_size, out_dtype)[:6]


def swiglu_fp8_fwd_delayed_triton(a13, history, group_size: int, out_dtype=E4M3, bootstrap: bool = False):
    """Delayed scaling: one launch writes the pair and s, one more (single program) rolls the history, after one
    memset; bootstrap: the two launches of current scaling, then the roll (once per run)."""
    *out, amax = _fwd_launch(a13, group_size, out_dtype, None if bootstrap else history)
    roll_history(history, amax)
    return tuple(out)


def _fwd_launch(a13, group_size, out_dtype, history=None):
    """→ (a1_8, s1, a3_8, s3, s_scale, s8, amax): amax is s's total either way; without a history s_scale comes
    from it (in the second launch, which writes s), with one from the history (and the one launch writes s)."""
    f = _check(a13, group_size)
    a13 = a13.contiguous()
    m = a13.shape[0]
    ng = triton.cdiv(f, group_size)
    grid = (triton.cdiv(m, _BM_F) * ng,)
    dev = a13.device
    a1_8, a3_8 = (torch.empty((m, f), dtype=E4M3, device=dev) for _ in range(2))
    s1, s3 = (torch.empty((m, ng), dtype=torch.float32, device=dev) for _ in range(2))
    s_scale = torch.empty((1,), dtype=torch.float32, device=dev)
    y = torch.empty((m, f), dtype=out_dtype, device=dev)
    amax = amax_workspace(dev)
    hist_len = 0 if history is None else history.numel()
    launcher(_fwd_kernel)[grid](a13, a1_8, s1, a3_8, s3, amax, s_scale, y, s_scale if history is None else history,
                                hist_len, m, f, ng, torch.finfo(E4M3).max, torch.finfo(out_dtype).max, AMAX_FLOOR,
                                G=group_size, BM=_BM_F, FAST=FAST,
                                HIST=triton.next_power_of_2(hist_len) if hist_len else 0, num_warps=_WARPS_F)
    if history is None:
        _out_launch(a1_8, s1, a3_8, s3, s_scale, y, group_size, False, amax)
    return a1_8, s1, a3_8, s3, s_scale, y, amax


def swiglu_fp8_out_triton(a1_8, s1, a3_8, s3, s_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    m, f = a1_8.shape
    y = torch.empty((f, m) if transpose else (m, f), dtype=out_dtype, device=a1_8.device)
    _out_launch(a1_8, s1, a3_8, s3, s_scale, y, group_size, transpose)
    return y


def _out_launch(a1_8, s1, a3_8, s3, s_scale, y, group_size, transpose, amax=None):
    """s from the saved pair with s_scale; amax given: s_scale is derived from it (and written) in the launch."""
    m, f = a1_8.shape
    launcher(_out_kernel)[(triton.cdiv(m, _BM), s1.shape[1])](
        a1_8, s1, a3_8, s3, s_scale, s_scale if amax is None else amax, y, m, f, s1.shape[1],
        torch.finfo(y.dtype).max, AMAX_FLOOR, TRANSPOSE=transpose, G=group_size, BM=_BM, FAST=FAST,
        FROM_AMAX=amax is not None, num_warps=4)


def swiglu_fp8_bwd_triton(ds, a1_8, s1, a3_8, s3, group_size: int, grad_dtype=torch.float8_e5m2):
    return _bwd_triton(ds, a1_8, s1, a3_8, s3, group_size, grad_dtype, None, None)


def swiglu_fp8_bwd_out_t_triton(ds, a1_8, s1, a3_8, s3, s_scale, group_size: int, grad_dtype=torch.float8_e5m2,
                                out_dtype=E4M3):
    return _bwd_triton(ds, a1_8, s1, a3_8, s3, group_size, grad_dtype, s_scale, out_dtype)


def swiglu_fp8_bwd_delayed_triton(ds, a1_8, s1, a3_8, s3, s_scale, history, group_size: int,
                                  grad_dtype=torch.float8_e5m2, out_dtype=E4M3, bootstrap: bool = False):
    """Delayed scaling: one pass (the cast pass: the scale from the history's maximum, s^T written, this call's
    amax folded into a zeroed float) and the single-program roll of the history; bootstrap: both passes, as
    swiglu_fp8_bwd_out_t, then the roll (once per run)."""
    return _bwd_triton(ds, a1_8, s1, a3_8, s3, group_size, grad_dtype, s_scale, out_dtype, history, bootstrap)


def _bwd_triton(ds, a1_8, s1, a3_8, s3, group_size, grad_dtype, s_scale, out_dtype, history=None, bootstrap=False):
    """history None: current scaling (the amax pass, then the cast pass). Otherwise delayed scaling with this amax
    history (bootstrap: current scaling, then this call's amax recorded)."""
    ds = ds.contiguous()
    m, f = a1_8.shape
    ng = s1.shape[1]
    dev = ds.device
    delayed = history is not None and not bootstrap
    amax = torch.zeros((1,), dtype=torch.float32, device=dev)  # |da| >= 0: zero is the neutral start
    scale = torch.empty((1,), dtype=torch.float32, device=dev)
    da = torch.empty((m, 2 * f), dtype=grad_dtype, device=dev)
    dat = torch.empty((2 * f, m), dtype=grad_dtype, device=dev)
    write_st = s_scale is not None
    st = torch.empty((f, m), dtype=out_dtype, device=dev) if write_st else None
    pair = (ds, a1_8, s1, a3_8, s3)
    if not delayed:
        launcher(_bwd_amax_kernel)[(triton.cdiv(m, _BM), ng)](
            *pair, amax, s_scale if write_st else amax, st if write_st else amax, m, f, ng,
            torch.finfo(out_dtype).max if write_st else 0.0, G=group_size, BM=_BM, FAST=FAST, WRITE_ST=write_st,
            num_warps=4)
        _cast_launch((*pair, amax), scale, da, dat, None, None, group_size)
    else:
        _cast_launch((*pair, amax), scale, da, dat, s_scale, st, group_size, history, amax)
    if history is not None:
        roll_history(history, amax)
    return (da, dat, scale, st) if write_st else (da, dat, scale)


def _cast_launch(args, scale, da, dat, s_scale, st, group_size, history=None, amax_out=None):
    """The cast pass over args = (ds, a1_8, s1, a3_8, s3, amax); s^T only where given. With an amax history
    (delayed scaling): the scale from its maximum instead of args' amax, and this call's amax folded into amax_out
    (zero before the pass)."""
    m, f = args[1].shape
    ng = args[2].shape[1]
    hist_len = 0 if history is None else history.numel()
    launcher(_bwd_cast_kernel)[(triton.cdiv(m, _BM_T), ng)](
        *args, scale, da, dat, scale if s_scale is None else s_scale, da if st is None else st,
        scale if amax_out is None else amax_out, scale if history is None else history, hist_len, m, f, ng, torch.finfo(da.dtype).max,
        0.0 if st is None else torch.finfo(st.dtype).max, AMAX_FLOOR, G=group_size, BM=_BM_T, FAST=FAST,
        WRITE_ST=st is not None, HIST=triton.next_power_of_2(hist_len) if hist_len else 0, num_warps=_WARPS_T)


# ---------------------------------------------------------------------------------------------- dispatchers
# Eager: the kernel (CUDA) or the reference; under torch.compile: the megacoat:: operators (numerics.dispatch).
Tensor = torch.Tensor


def swiglu_fp8_fwd(a13, group_size: int, out_dtype=E4M3):
    """→ (a1_8, s1, a3_8, s3, s_scale, s8): the saved FP8 pair and s for the down projection (swiglu_fp8_fwd_ref)."""
    return dispatch(_fwd_op, a13, swiglu_fp8_fwd_triton, swiglu_fp8_fwd_ref, a13, group_size, out_dtype)


def swiglu_fp8_fwd_delayed(a13, history, group_size: int, out_dtype=E4M3, bootstrap: bool = False):
    """swiglu_fp8_fwd with delayed scaling (swiglu_fp8_fwd_delayed_ref): one launch writes the pair and s (the pair
    is not read again), `history` rolled in place."""
    return dispatch(_fwd_delayed_op, a13, swiglu_fp8_fwd_delayed_triton, swiglu_fp8_fwd_delayed_ref,
                    a13, history, group_size, out_dtype, bootstrap)


def swiglu_fp8_out(a1_8, s1, a3_8, s3, s_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    return dispatch(_out_op, a1_8, swiglu_fp8_out_triton, swiglu_fp8_out_ref,
                    a1_8, s1, a3_8, s3, s_scale, group_size, transpose, out_dtype)


def swiglu_fp8_bwd(ds, a1_8, s1, a3_8, s3, group_size: int, grad_dtype=torch.float8_e5m2):
    return dispatch(_bwd_op, ds, swiglu_fp8_bwd_triton, swiglu_fp8_bwd_ref, ds, a1_8, s1, a3_8, s3, group_size,
                    grad_dtype)


def swiglu_fp8_bwd_out_t(ds, a1_8, s1, a3_8, s3, s_scale, group_size: int, grad_dtype=torch.float8_e5m2,
                         out_dtype=E4M3):
    """swiglu_fp8_bwd plus the forward's output transposed (s^T [F, M], the down projection's wgrad operand),
    written by the backward's amax pass from the pair it reads anyway: one launch and one read of the pair
    (2 bytes per element) fewer than swiglu_fp8_out(transpose=True) beside swiglu_fp8_bwd."""
    return dispatch(_bwd_out_t_op, ds, swiglu_fp8_bwd_out_t_triton, swiglu_fp8_bwd_out_t_ref,
                    ds, a1_8, s1, a3_8, s3, s_scale, group_size, grad_dtype, out_dtype)


def swiglu_fp8_bwd_delayed(ds, a1_8, s1, a3_8, s3, s_scale, history, group_size: int,
                           grad_dtype=torch.float8_e5m2, out_dtype=E4M3, bootstrap: bool = False):
    """swiglu_fp8_bwd_out_t with delayed scaling (swiglu_fp8_bwd_delayed_ref): one pass over ds and the pair
    instead of two, `history` rolled in place."""
    return dispatch(_bwd_delayed_op, ds, swiglu_fp8_bwd_delayed_triton, swiglu_fp8_bwd_delayed_ref,
                    ds, a1_8, s1, a3_8, s3, s_scale, history, group_size, grad_dtype, out_dtype, bootstrap)


@fp8_operator("megacoat::swiglu_fp8_fwd")
def _fwd_op(a13: Tensor, group_size: int,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return traced_body(a13, swiglu_fp8_fwd_triton, swiglu_fp8_fwd_ref, a13, group_size, out_dtype)


@fp8_operator("megacoat::swiglu_fp8_fwd_delayed", mutates_args=("history",))
def _fwd_delayed_op(a13: Tensor, history: Tensor, group_size: int, out_dtype: torch.dtype,
                    bootstrap: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return traced_body(a13, swiglu_fp8_fwd_delayed_triton, swiglu_fp8_fwd_delayed_ref, a13, history, group_size,
                       out_dtype, bootstrap)


@fp8_operator("megacoat::swiglu_fp8_out")
def _out_op(a1_8: Tensor, s1: Tensor, a3_8: Tensor, s3: Tensor, s_scale: Tensor, group_size: int, transpose: bool,
            out_dtype: torch.dtype) -> Tensor:
    return traced_body(a1_8, swiglu_fp8_out_triton, swiglu_fp8_out_ref, a1_8, s1, a3_8, s3, s_scale, group_size,
                       transpose, out_dtype)


@fp8_operator("megacoat::swiglu_fp8_bwd")
def _bwd_op(ds: Tensor, a1_8: Tensor, s1: Tensor, a3_8: Tensor, s3: Tensor, group_size: int,
            grad_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return traced_body(ds, swiglu_fp8_bwd_triton, swiglu_fp8_bwd_ref, ds, a1_8, s1, a3_8, s3, group_size, grad_dtype)


@fp8_operator("megacoat::swiglu_fp8_bwd_out_t")
def _bwd_out_t_op(ds: Tensor, a1_8: Tensor, s1: Tensor, a3_8: Tensor, s3: Tensor, s_scale: Tensor, group_size: int,
                  grad_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return traced_body(ds, swiglu_fp8_bwd_out_t_triton, swiglu_fp8_bwd_out_t_ref, ds, a1_8, s1, a3_8, s3, s_scale,
                       group_size, grad_dtype, out_dtype)


@fp8_operator("megacoat::swiglu_fp8_bwd_delayed", mutates_args=("history",))
def _bwd_delayed_op(ds: Tensor, a1_8: Tensor, s1: Tensor, a3_8: Tensor, s3: Tensor, s_scale: Tensor, history: Tensor,
                    group_size: int, grad_dtype: torch.dtype, out_dtype: torch.dtype,
                    bootstrap: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return traced_body(ds, swiglu_fp8_bwd_delayed_triton, swiglu_fp8_bwd_delayed_ref, ds, a1_8, s1, a3_8, s3, s_scale,
                       history, group_size, grad_dtype, out_dtype, bootstrap)
