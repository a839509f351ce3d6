"""Fused FP8 RMSNorm for the COAT precision flow (Triton, forward and backward, with torch references).

Forward `rmsnorm_fp8_fwd`, two launches:
  1. read x once; write it as E4M3 with 1xG group scales (the tensor saved for backward), the row's rstd computed
     from those dequantized values, and fold the row's amax of the output y = x * rstd * w into one float by a
     relaxed atomic max that no program waits on (megacoat.ops.tensor_scale);
  2. re-read the 1-byte x and write y quantized with the per-tensor scale that each program derives from that
     amax (the first program also stores it for the GEMM).
`rmsnorm_fp8_out` writes y again from the saved values and a known scale: transposed, the weight gradient's
operand in backward (made again instead of saved).
`rmsnorm_fp8_fwd_delayed` (delayed scaling, megacoat.coat.delayed_scaling) does both in the first launch: the scale
comes from an amax history, the kernel writes y row-major beside x8, and a one-program launch after it rolls this
call's amax into the history (x8 is not read again: 1 byte per element fewer).
With `add` (the block's residual addition h = x + add, fused), the first launch also reads add and writes h,
rounded to x's dtype as torch's addition rounds it, and norms h: the separate addition's launch and the norm's
read of h are gone.
Backward `rmsnorm_fp8_bwd` reads dy and the saved FP8 x once and writes dx, with a persistent grid whose programs
each keep one partial sum of dw (summed by a column-sum kernel in a fixed order); with dx_amax it also folds max|dx|
in, for the FP8 cast of dx as the next linear's output gradient (no amax pass over dx).

Every function computes from the dequantized FP8 input, so forward, the backward recompute and the
reference agree on the same values. Works for any hidden size (a short last group is padded with zeros).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.tensor_scale import (amax_workspace, cast_scale, delayed_scale, history_scale, record_amax,
                                       record_program_amax, roll_history)
from megacoat.ops.numerics import (AMAX_FLOOR, FAST, check_group_size, dispatch, div_cast, group_dequantize,
                                   group_quantize, fp8_operator, launcher, scale_from_amax, traced_body)
from megacoat.ops.triton_math import div_saturate, saturate

E4M3 = torch.float8_e4m3fn


def _check(x: torch.Tensor, weight: torch.Tensor, group_size: int, add: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 1 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"rmsnorm expects x [M, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype):
        raise ValueError(f"rmsnorm's add must be x's shape and dtype, got {tuple(add.shape)} {add.dtype} for "
                         f"{tuple(x.shape)} {x.dtype}")
    check_group_size(group_size)


# ----------------------------------------------------------------------------------------------- references
def rmsnorm_fp8_fwd_ref(x, weight, eps: float, group_size: int, out_dtype=E4M3, add=None):
    """→ (x8 [M,H] E4M3, x_scales [M, ceil(H/G)], rstd [M] fp32, y_scale [1] fp32, y8 [M,H]): the saved FP8 input
    and y = x * rstd * w cast with its own per-tensor scale, row-major for the next GEMM. add: the norm of
    h = x + add (torch's addition), and h returned last."""
    h = _added(x, weight, group_size, add)
    x8, xs, xd, rstd = _saved_and_rstd(h, weight, eps, group_size)
    y_scale = scale_from_amax(_y_amax(xd, rstd, weight), out_dtype).reshape(1)
    return (x8, xs, rstd, y_scale, _cast_y(xd, rstd, weight, y_scale, out_dtype)) + _h_out(h, add)


def _added(x, weight, group_size, add):
    _check(x, weight, group_size, add)
    return x if add is None else x + add


def _h_out(h, add) -> tuple:
    return () if add is None else (h,)


def _saved_and_rstd(x, weight, eps, group_size):
    """→ (x8, x_scales, xd, rstd): the saved FP8 input, its dequantized fp32 values and their rstd."""
    _check(x, weight, group_size)
    x8, xs = group_quantize(x, group_size, E4M3)
    xd = group_dequantize(x8, xs, group_size)
    return x8, xs, xd, 1.0 / torch.sqrt((xd * xd).mean(-1) + eps)


def _y_amax(xd, rstd, weight) -> torch.Tensor:
    """max|xd * rstd * w| as the kernel takes it: rstd times each row's max|xd * w| (rstd > 0)."""
    return (rstd * (xd * weight.float()).abs().amax(-1)).amax().reshape(1)


def rmsnorm_fp8_out_ref(x8, x_scales, rstd, weight, y_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    """y = x * rstd * w cast with the per-tensor y_scale: [M, H], or [H, M] when transpose."""
    q = _cast_y(group_dequantize(x8, x_scales, group_size), rstd, weight, y_scale, out_dtype)
    return q.t().contiguous() if transpose else q


def _cast_y(xd, rstd, weight, y_scale, out_dtype):
    """y = xd * rstd * w cast with y_scale (the kernels' product order)."""
    return div_cast(xd * rstd[:, None] * weight.float(), y_scale, out_dtype)


def rmsnorm_fp8_fwd_delayed_ref(x, weight, history, eps: float, group_size: int, out_dtype=E4M3,
                                bootstrap: bool = False, add=None):
    """rmsnorm_fp8_fwd with delayed scaling: → (x8, x_scales, rstd, y_scale, y8),
    y_scale from max(history), the amaxes of earlier calls (bootstrap: from this call's own amax, as
    rmsnorm_fp8_fwd); values beyond it saturate. history [L] (float32, most recent first) is rolled in place, this
    call's amax in front (zero for a non-finite one). x is dequantized once (the CPU path's peak). add: as
    rmsnorm_fp8_fwd_ref's."""
    h = _added(x, weight, group_size, add)
    x8, xs, xd, rstd = _saved_and_rstd(h, weight, eps, group_size)
    amax = _y_amax(xd, rstd, weight)
    y_scale = delayed_scale(amax, history, out_dtype, bootstrap)
    y8 = _cast_y(xd, rstd, weight, y_scale, out_dtype)
    record_amax(history, amax)
    return (x8, xs, rstd, y_scale, y8) + _h_out(h, add)


def rmsnorm_fp8_bwd_ref(dy, x8, x_scales, rstd, weight, group_size: int, residual_grad=None, dx_amax: bool = False):
    """→ (dx [M,H] in dy's dtype, dw [H] fp32). residual_grad [M,H]: the gradient the input also receives from
    the residual branch, added to dx in fp32 before the one rounding (the block's add, fused). dx_amax: also
    max|dx| as float32 [1] (the amax of dx's FP8 cast, which the kernel folds in as it writes dx)."""
    xhat = group_dequantize(x8, x_scales, group_size) * rstd[:, None]
    dyf, w = dy.float(), weight.float()
    c = (dyf * w * xhat).sum(-1, keepdim=True) / x8.shape[1]
    dx = rstd[:, None] * (dyf * w - xhat * c)
    if residual_grad is not None:
        dx = dx + residual_grad.float()
    dx = dx.to(dy.dtype)
    amax = (dx.abs().amax().float().reshape(1),) if dx_amax else ()
    return (dx, (dyf * xhat).sum(0)) + amax


# --------------------------------------------------------------------------------------------------- triton
# A row lives in registers as a [NGP, G] tile, one group per tile row (NGP = groups rounded up to a power of
# two): group amaxes are reductions along axis 1, row sums over the whole tile, and no 3-D reshape is needed
# (Triton 3.6 mis-compiles those on Hopper when FP8 values are converted inside them; seen as NaN rstd).
@triton.jit
def _row_tile(H, G: tl.constexpr, NGP: tl.constexpr):
    """Group index [NGP], column offsets [NGP, G] and their mask for one row."""
    gi = tl.arange(0, NGP)
    col = gi[:, None] * G + tl.arange(0, G)[None, :]
    return gi, col, col < H


@triton.jit
def _fwd_kernel(x_ptr, add_ptr, h_ptr, w_ptr, x8_ptr, xs_ptr, rstd_ptr, amax_ptr, scale_ptr, y_ptr, hist_ptr,
                hist_len, H, NG, eps, fmax_in, fmax_out, amax_floor, G: tl.constexpr, NGP: tl.constexpr,
                FAST: tl.constexpr, HIST: tl.constexpr, ADD: tl.constexpr):
    """The row amaxes of y go into amax (megacoat.ops.tensor_scale), for _out_kernel's scale (current scaling) or
    for roll_history. HIST > 0 (delayed scaling): y's scale comes from the amax history's maximum and y is written
    here. ADD: the row normed is h = x + add, summed in fp32 and rounded to h's dtype (torch's addition), and
    written to h."""
    row = tl.program_id(0).to(tl.int64)
    gi, col, mask = _row_tile(H, G, NGP)
    x = tl.load(x_ptr + row * H + col, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(add_ptr + row * H + col, mask=mask, other=0.0).to(tl.float32))
        x = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * H + col, x, mask=mask)
    x = x.to(tl.float32)
    gs = tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor) / fmax_in
    # a divide, not x * (1 / gs): an all-zero or subnormal group has 1 / gs = inf, and 0 * inf is NaN
    q = saturate(x / gs[:, None], fmax_in, FAST).to(x8_ptr.dtype.element_ty)
    tl.store(x8_ptr + row * H + col, q, mask=mask)
    tl.store(xs_ptr + row * NG + gi, gs, mask=gi < NG)
    xd = q.to(tl.float32) * gs[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(xd * xd, axis=1), axis=0) / H + eps)
    tl.store(rstd_ptr + row, rstd)
    # rstd > 0, so max|x * rstd * w| over a row is rstd * max|x * w|: the output amax without the output.
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    amax = rstd * tl.max(tl.max(tl.abs(xd * w), axis=1), axis=0)
    if HIST > 0:
        scale = history_scale(scale_ptr, hist_ptr, hist_len, fmax_out, amax_floor, HIST)
        yq = div_saturate(xd * rstd * w, scale, fmax_out, FAST)  # _out_kernel's product, in its order
        tl.store(y_ptr + row * H + col, yq.to(y_ptr.dtype.element_ty), mask=mask)
    record_program_amax(amax, amax_ptr)


@triton.jit
def _load_xd(x8_ptr, xs_ptr, rm, rn, gi, row_ok, mask, H, NG):
    """Dequantized x tile [BM, G] of group column gi."""
    q = tl.load(x8_ptr + rm[:, None] * H + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    return q * tl.load(xs_ptr + rm * NG + gi, mask=row_ok, other=0.0)[:, None]


@triton.jit
def _out_kernel(x8_ptr, xs_ptr, rstd_ptr, w_ptr, scale_ptr, amax_ptr, y_ptr, M, H, NG, fmax_out, amax_floor,
                TRANSPOSE: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, FAST: tl.constexpr,
                FROM_AMAX: tl.constexpr):
    """FROM_AMAX: the scale comes from _fwd_kernel's total amax (tensor_scale.cast_scale)."""
    scale = cast_scale(scale_ptr, amax_ptr, fmax_out, amax_floor, FROM_AMAX)
    gi = tl.program_id(1)
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (gi * G + tl.arange(0, G)).to(tl.int64)
    row_ok = rm < M
    mask = row_ok[:, None] & (rn[None, :] < H)
    xd = _load_xd(x8_ptr, xs_ptr, rm, rn, gi, row_ok, mask, H, NG)
    rstd = tl.load(rstd_ptr + rm, mask=row_ok, other=0.0)
    w = tl.load(w_ptr + rn, mask=rn < H, other=0.0).to(tl.float32)
    yq = div_saturate(xd * rstd[:, None] * w[None, :], scale, fmax_out, FAST)
    if TRANSPOSE:
        tl.store(y_ptr + rn[:, None] * M + rm[None, :], tl.trans(yq).to(y_ptr.dtype.element_ty), mask=tl.trans(mask))
    else:
        tl.store(y_ptr + rm[:, None] * H + rn[None, :], yq.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_row(dy_ptr, x8_ptr, xs_ptr, rstd_ptr, res_ptr, row, col, gi, mask, H, NG, RES: tl.constexpr):
    r = row.to(tl.int64)
    dy = tl.load(dy_ptr + r * H + col, mask=mask, other=0.0)
    q = tl.load(x8_ptr + r * H + col, mask=mask, other=0.0)
    gs = tl.load(xs_ptr + r * NG + gi, mask=gi < NG, other=0.0)
    if RES:
        res = tl.load(res_ptr + r * H + col, mask=mask, other=0.0)
    else:
        res = dy
    return dy, q, gs, tl.load(rstd_ptr + r), res


@triton.jit
def _bwd_kernel(dy_ptr, x8_ptr, xs_ptr, rstd_ptr, w_ptr, res_ptr, dx_ptr, dwp_ptr, amax_ptr, M, H, NG,
                G: tl.constexpr, NGP: tl.constexpr, RES: tl.constexpr, AMAX: tl.constexpr):
    """Persistent: program p takes rows p, p + P, ... and keeps its share of dw in registers (one [H] partial
    per program, not per row block). The next row's loads are issued before this row's math, so each program
    has two rows in flight. RES: the residual branch's gradient is added to dx before it is stored. AMAX: max|dx|
    of the stored (rounded) values is folded into amax_ptr, one atomic per program: the amax that dx's FP8 cast
    needs, without a pass of its own over dx."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    gi, col, mask = _row_tile(H, G, NGP)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([NGP, G], dtype=tl.float32)
    amax = tl.zeros([NGP, G], dtype=tl.float32)
    nxt = _load_row(dy_ptr, x8_ptr, xs_ptr, rstd_ptr, res_ptr, pid, col, gi, mask, H, NG, RES)
    for i in range(0, tl.cdiv(M - pid, step)):
        row = pid + i * step
        dy, q, gs, rstd, res = nxt
        # past the last row: reload the last row (in bounds, unused) rather than mask by a scalar
        nxt = _load_row(dy_ptr, x8_ptr, xs_ptr, rstd_ptr, res_ptr, tl.minimum(row + step, M - 1), col, gi, mask, H,
                        NG, RES)
        dy = dy.to(tl.float32)
        xhat = q.to(tl.float32) * (gs * rstd)[:, None]
        wdy = dy * w
        c = tl.sum(tl.sum(wdy * xhat, axis=1), axis=0) / H
        dx = rstd * (wdy - xhat * c)
        if RES:
            dx += res.to(tl.float32)
        tl.store(dx_ptr + row.to(tl.int64) * H + col, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if AMAX:  # masked lanes hold 0, and |dx| >= 0
            amax = tl.maximum(amax, tl.abs(dx))
        dw += dy * xhat
    tl.store(dwp_ptr + pid.to(tl.int64) * H + col, dw, mask=mask)
    if AMAX:  # rounding is monotonic: the rounded max is the max of the rounded (stored) values
        amax = tl.max(tl.max(amax, axis=1), axis=0).to(dx_ptr.dtype.element_ty).to(tl.float32)
        record_program_amax(amax, amax_ptr)


def rmsnorm_fp8_fwd_triton(x, weight, eps: float, group_size: int, out_dtype=E4M3, add=None):
    """Current scaling: after one memset, the first launch writes x8 and folds y's amax, the second writes y."""
    *out, h, _ = _fwd_launch(x, weight, eps, group_size, out_dtype, add=add)
    return tuple(out) + _h_out(h, add)


def rmsnorm_fp8_fwd_delayed_triton(x, weight, history, eps: float, group_size: int, out_dtype=E4M3,
                                   bootstrap: bool = False, add=None):
    """Delayed scaling: one launch writes x8 and y, one more (single program) rolls the history, after one memset;
    bootstrap: the two launches of current scaling, then the roll (once per run)."""
    *out, h, amax = _fwd_launch(x, weight, eps, group_size, out_dtype, None if bootstrap else history, add)
    roll_history(history, amax)
    return tuple(out) + _h_out(h, add)


def _fwd_launch(x, weight, eps, group_size, out_dtype, history=None, add=None):
    """→ (x8, xs, rstd, y_scale, y, h, amax): amax is y's total either way; without a history y_scale comes from it
    (in the second launch, which writes y), with one from the history (and the one launch writes y). h: x + add,
    None without add."""
    _check(x, weight, group_size, add)
    x = x.contiguous()
    add = None if add is None else add.contiguous()
    h_out = None if add is None else torch.empty_like(x)
    m, h = x.shape
    ng = triton.cdiv(h, group_size)
    x8 = torch.empty((m, h), dtype=E4M3, device=x.device)
    xs = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    y_scale = torch.empty((1,), dtype=torch.float32, device=x.device)
    y = torch.empty((m, h), dtype=out_dtype, device=x.device)
    amax = amax_workspace(x.device)
    ngp = triton.next_power_of_2(ng)
    hist_len = 0 if history is None else history.numel()
    launcher(_fwd_kernel)[(m,)](x, x if add is None else add, x if h_out is None else h_out, weight, x8, xs, rstd,
                                amax, y_scale, y, y_scale if history is None else history, hist_len, h, ng, eps,
                                torch.finfo(E4M3).max, torch.finfo(out_dtype).max, AMAX_FLOOR, G=group_size, NGP=ngp,
                                FAST=FAST, HIST=triton.next_power_of_2(hist_len) if hist_len else 0,
                                ADD=add is not None, num_warps=_warps(ngp * group_size, _FWD_PER_WARP))
    if history is None:
        _out_launch(x8, xs, rstd, weight, y_scale, y, group_size, False, amax)
    return x8, xs, rstd, y_scale, y, h_out, amax


_FWD_PER_WARP = 1024  # the forward's row elements per warp


def _warps(row_elements: int, per_warp: int) -> int:
    """Warps for one row in registers, `per_warp` elements each (1 to 16 warps). Forward: 32 a thread, which
    halves the per-element share of the row reductions against 16 (25 against 32 SASS instructions per element
    at H = 4096). Backward: 16 a thread, its two rows in flight fill 122 registers."""
    return max(1, min(16, row_elements // per_warp))


def rmsnorm_fp8_out_triton(x8, x_scales, rstd, weight, y_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    m, h = x8.shape
    y = torch.empty((h, m) if transpose else (m, h), dtype=out_dtype, device=x8.device)
    _out_launch(x8, x_scales, rstd, weight, y_scale, y, group_size, transpose)
    return y


# The output pass's tile: BM rows, so a transposed store writes BM-byte pieces of each row.
_OUT_BM, _OUT_WARPS = 64, 4
_TILES = {"forward": ("_FWD_PER_WARP",), "out": ("_OUT_BM", "_OUT_WARPS")}


def tiles() -> dict[str, tuple[int, ...]]:
    """Each kernel's launch setting, read at every launch: {"forward": (row elements per warp,), "out": (BM,
    warps)}."""
    return {kernel: tuple(globals()[name] for name in names) for kernel, names in _TILES.items()}


def set_tile(kernel: str, tile: tuple[int, ...]) -> None:
    """Launch `kernel` with another setting from now on (the benchmarks' tile sweeps); tiles() before it gives the
    library's."""
    globals().update(dict(zip(_TILES[kernel], tile, strict=True)))  # all or nothing


def _out_launch(x8, x_scales, rstd, weight, y_scale, y, group_size, transpose, amax=None):
    """y from the saved values with y_scale; amax given: y_scale is derived from it (and written) in the launch."""
    m, h = x8.shape
    launcher(_out_kernel)[(triton.cdiv(m, _OUT_BM), x_scales.shape[1])](
        x8, x_scales, rstd, weight, y_scale, y_scale if amax is None else amax, y, m, h, x_scales.shape[1],
        torch.finfo(y.dtype).max, AMAX_FLOOR, TRANSPOSE=transpose, G=group_size, BM=_OUT_BM, FAST=FAST,
        FROM_AMAX=amax is not None, num_warps=_OUT_WARPS)


def _persistent_programs(m: int, warps: int, device) -> int:
    """16 warps per SM (two programs of 8 at H = 4096): each program carries a [H] dw partial that torch then
    sums, so more programs cost more bytes (2 x 4 H each), while two rows in flight per program already cover
    memory latency. At ~122 registers a thread, 16 warps is what an SM holds."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(m, sms * max(1, 16 // warps)))


@triton.jit
def _column_sum_kernel(p_ptr, out_ptr, P, H, BP: tl.constexpr, BH: tl.constexpr):
    """out[h] = sum over the P rows of p[:, h] (float32), each program BH columns, its rows in a fixed order:
    the dw partials' sum, deterministic (torch's sum(0) of the [P, H] partials takes several times the read of
    its bytes)."""
    cols = tl.program_id(0) * BH + tl.arange(0, BH)
    col_ok = cols < H
    acc = tl.zeros([BP, BH], dtype=tl.float32)
    for r0 in range(0, P, BP):
        rows = r0 + tl.arange(0, BP)
        acc += tl.load(p_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                       mask=(rows[:, None] < P) & col_ok[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_ok)


def column_sum_triton(p: torch.Tensor) -> torch.Tensor:
    """[P, H] float32 → [H]: p.sum(0) in a fixed order (the backward's dw partials)."""
    rows, h = p.shape
    out = torch.empty((h,), dtype=torch.float32, device=p.device)
    bh = 32
    launcher(_column_sum_kernel)[(triton.cdiv(h, bh),)](p, out, rows, h, BP=64, BH=bh, num_warps=4)
    return out


def rmsnorm_fp8_bwd_triton(dy, x8, x_scales, rstd, weight, group_size: int, residual_grad=None,
                           dx_amax: bool = False):
    dy = dy.contiguous()
    m, h = x8.shape
    ng = x_scales.shape[1]
    ngp = triton.next_power_of_2(ng)
    warps = _warps(ngp * group_size, 512)
    grid = _persistent_programs(m, warps, dy.device)
    res = None if residual_grad is None else residual_grad.contiguous()
    dx = torch.empty((m, h), dtype=dy.dtype, device=dy.device)
    dwp = torch.empty((grid, h), dtype=torch.float32, device=dy.device)
    amax = amax_workspace(dy.device) if dx_amax else None
    launcher(_bwd_kernel)[(grid,)](dy, x8, x_scales, rstd, weight, dy if res is None else res, dx, dwp,
                                   dwp if amax is None else amax, m, h, ng, G=group_size, NGP=ngp,
                                   RES=res is not None, AMAX=dx_amax, num_warps=warps)
    return (dx, column_sum_triton(dwp)) + ((amax,) if dx_amax else ())


# ---------------------------------------------------------------------------------------------- dispatchers
# Eager: the kernel (CUDA) or the reference; under torch.compile: the megacoat:: operators (numerics.dispatch).
Tensor = torch.Tensor


def rmsnorm_fp8_fwd(x, weight, eps: float, group_size: int, out_dtype=E4M3, add=None):
    """→ (x8, x_scales, rstd, y_scale, y8): the saved FP8 input and the FP8 output for the next GEMM
    (rmsnorm_fp8_fwd_ref); add: of h = x + add, with h last."""
    out = dispatch(_fwd_op, x, rmsnorm_fp8_fwd_triton, rmsnorm_fp8_fwd_ref, x, weight, eps, group_size, out_dtype, add)
    return tuple(out) if add is not None else tuple(out[:5])


def rmsnorm_fp8_out(x8, x_scales, rstd, weight, y_scale, group_size: int, transpose: bool, out_dtype=E4M3):
    return dispatch(_out_op, x8, rmsnorm_fp8_out_triton, rmsnorm_fp8_out_ref,
                    x8, x_scales, rstd, weight, y_scale, group_size, transpose, out_dtype)


def rmsnorm_fp8_fwd_delayed(x, weight, history, eps: float, group_size: int, out_dtype=E4M3,
                            bootstrap: bool = False, add=None):
    """rmsnorm_fp8_fwd with delayed scaling (rmsnorm_fp8_fwd_delayed_ref): one launch writes x8 and y (x8 is not
    read again), `history` rolled in place."""
    out = dispatch(_fwd_delayed_op, x, rmsnorm_fp8_fwd_delayed_triton, rmsnorm_fp8_fwd_delayed_ref,
                   x, weight, history, eps, group_size, out_dtype, bootstrap, add)
    return tuple(out) if add is not None else tuple(out[:5])


def rmsnorm_fp8_bwd(dy, x8, x_scales, rstd, weight, group_size: int, residual_grad=None, dx_amax: bool = False):
    """→ (dx, dw), and dx's amax (float32 [1]) last with dx_amax; residual_grad: added to dx in the kernel
    (rmsnorm_fp8_bwd_ref)."""
    out = dispatch(_bwd_op, dy, rmsnorm_fp8_bwd_triton, rmsnorm_fp8_bwd_ref, dy, x8, x_scales, rstd, weight,
                   group_size, residual_grad, dx_amax)
    return tuple(out) if dx_amax else tuple(out[:2])


def _with_h(x: Tensor, out: tuple) -> tuple:
    """The forward operators always return h, empty without add: an operator's outputs are fixed in number."""
    return out if len(out) == 6 else (*out, x.new_empty(0))


@fp8_operator("megacoat::rmsnorm_fp8_fwd")
def _fwd_op(x: Tensor, weight: Tensor, eps: float, group_size: int, out_dtype: torch.dtype,
            add: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _with_h(x, traced_body(x, rmsnorm_fp8_fwd_triton, rmsnorm_fp8_fwd_ref, x, weight, eps, group_size,
                                  out_dtype, add))


@fp8_operator("megacoat::rmsnorm_fp8_fwd_delayed", mutates_args=("history",))
def _fwd_delayed_op(x: Tensor, weight: Tensor, history: Tensor, eps: float, group_size: int, out_dtype: torch.dtype,
                    bootstrap: bool, add: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _with_h(x, traced_body(x, rmsnorm_fp8_fwd_delayed_triton, rmsnorm_fp8_fwd_delayed_ref, x, weight, history,
                                  eps, group_size, out_dtype, bootstrap, add))


@fp8_operator("megacoat::rmsnorm_fp8_out")
def _out_op(x8: Tensor, x_scales: Tensor, rstd: Tensor, weight: Tensor, y_scale: Tensor, group_size: int,
            transpose: bool, out_dtype: torch.dtype) -> Tensor:
    return traced_body(x8, rmsnorm_fp8_out_triton, rmsnorm_fp8_out_ref, x8, x_scales, rstd, weight, y_scale,
                       group_size, transpose, out_dtype)


@fp8_operator("megacoat::rmsnorm_fp8_bwd")
def _bwd_op(dy: Tensor, x8: Tensor, x_scales: Tensor, rstd: Tensor, weight: Tensor, group_size: int,
            residual_grad: Tensor | None, dx_amax: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, amax); amax empty without dx_amax (an operator's outputs are fixed in number)."""
    out = traced_body(dy, rmsnorm_fp8_bwd_triton, rmsnorm_fp8_bwd_ref, dy, x8, x_scales, rstd, weight, group_size,
                      residual_grad, dx_amax)
    return out if dx_amax else (*out, dy.new_empty(0, dtype=torch.float32))
