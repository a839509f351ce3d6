"""The cross-entropy of an FP8 output layer, with the logits' gradient written straight into FP8 (--fp8-output-layer).

With the head an FP8 linear, its backward needs the logits' gradient g = c (softmax(z) - onehot(y)), c the loss's
upstream gradient over the number of counted tokens, as codes in two layouts: g8 [T, V] (dgrad) and g8^T [V, T]
(wgrad), with a per-tensor scale from max|g|. Unfused that is the loss's backward writing g in bf16, an amax pass
over it and a cast pass: 10 bytes moved per logit in backward. Here:

* forward, `cross_entropy_stats`: one pass over the logits gives each token's log-sum-exp and loss, and the amax of
  its gradient row without forming it: max_j |p_j - [j = y]| = max(1 - p_y, max_{j != y} p_j), where p = exp(z - lse)
  grows with z, so the second term is exp(max_{j != y} z_j - lse);
* backward, `cross_entropy_grad_fp8`: one pass reads the logits again, forms g in float32 and writes its codes in
  both layouts, the scale that of c times the forward's amax. 4 bytes per logit (2 read, 2 written).

The backward also returns each token's label residual r = g_y - dq(g8_y), the rounding error of its label's entry,
for the head to add back (megacoat.coat.head). That entry, c (p_y - 1), is the row's largest, and near the
per-tensor amax (~c, set by some token with p_y ~ 0), E5M2 sees it in steps of c/7: every p_y below 1/14 would
count as 0, an error of one sign that does not average out over micro-batches.

The codes are current scaling's of the float32 gradient (one rounding, where a bf16 gradient cast again has two).
The amax is exact up to exp's rounding in the two kernels, which compute p alike; a value an ulp above it would
saturate at F.max (the cast clamps). Tokens labelled `ignore_index` count nowhere: no loss, a zero gradient, no
amax. A label outside [0, V) gives a NaN loss and a NaN scale (visible, not a wrong gradient); the reference
raises. The gradient alone takes such a label as another rank's vocabulary slice (a vocabulary-parallel head passes
its own stats): the token counts, with no label entry in these logits and a zero residual. NaN or Inf logits give
a NaN loss and scale, as current scaling would.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.cast_transpose import asked_layouts, cast_transpose_ref, op_layouts
from megacoat.ops.numerics import AMAX_FLOOR, dispatch, fp8_operator, launcher, scale_from_amax, traced_body
from megacoat.ops.tensor_scale import cast_scale, scaled_codes


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or labels.dtype != torch.int64:
        raise ValueError(f"cross_entropy_fp8: logits [T, V] and int64 labels [T], got {tuple(logits.shape)} and "
                         f"{labels.dtype} {tuple(labels.shape)}")


# --- forward: per-token log-sum-exp and loss, the gradient's amax -----------------------------------------------
def cross_entropy_stats_ref(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """(loss per token float32 [T] (0 where ignored), log-sum-exp float32 [T], amax float32 [1]): the amax of the
    gradient of the summed loss, max over counted tokens of max(1 - p_y, max_{j != y} p_j)."""
    _check(logits, labels)
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    counted = labels != ignore_index
    y = torch.where(counted, labels, 0)[:, None]
    zy = z.gather(1, y)[:, 0]
    others = z.scatter(1, y, float("-inf")).amax(dim=-1)
    row_amax = torch.maximum(1.0 - torch.exp(zy - lse), torch.exp(others - lse))
    amax = torch.where(counted, row_amax, 0.0).amax().reshape(1)
    return torch.where(counted, lse - zy, 0.0), lse, amax


@triton.jit
def _stats_kernel(z_ptr, y_ptr, loss_ptr, lse_ptr, amax_ptr, V, ignore_index, BLOCK: tl.constexpr):
    # one token (row) per program: a running max and sum of exp per lane, combined once at the end
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * V
    y = tl.load(y_ptr + row)
    counted = y != ignore_index
    in_range = (y >= 0) & (y < V)
    lowest = -3.4028234663852886e38  # float32's: exp(lowest - lowest) = 1 where exp(-inf - -inf) is NaN
    m = tl.full([BLOCK], lowest, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    others = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
        others = tl.maximum(others, tl.where(cols == y, float("-inf"), z))
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    zy = tl.load(base + tl.where(in_range, y, 0)).to(tl.float32)
    zy = tl.where(in_range, zy, float("nan"))
    row_amax = tl.maximum(1.0 - tl.exp(zy - lse), tl.exp(tl.max(others, axis=0) - lse))
    row_amax = tl.where(lse - zy == lse - zy, row_amax, float("nan"))  # the hardware max drops NaN: keep it
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(counted, lse - zy, 0.0))
    # an integer max on the float's bits: for values >= 0 the orders agree and a NaN's bits win (_amax_kernel's)
    bits = tl.where(counted, row_amax, 0.0).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), bits, sem="relaxed")


# 8 logits a thread per step: a 32 k vocabulary in 32 steps of 4 warps
_STATS_BLOCK, _STATS_WARPS = 1024, 4


def cross_entropy_stats_triton(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    _check(logits, labels)
    logits, labels = logits.contiguous(), labels.contiguous()
    t, v = logits.shape
    loss = torch.empty(t, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    amax = torch.zeros(1, dtype=torch.float32, device=logits.device)
    block = min(_STATS_BLOCK, triton.next_power_of_2(v))
    launcher(_stats_kernel)[(t,)](logits, labels, loss, lse, amax, v, ignore_index, BLOCK=block,
                                  num_warps=_STATS_WARPS)
    return loss, lse, amax


def cross_entropy_stats(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """One pass over logits [T, V]: (loss per token [T], log-sum-exp [T], the summed loss's gradient amax [1]),
    float32 (cross_entropy_stats_ref)."""
    return dispatch(_stats_op, logits, cross_entropy_stats_triton, cross_entropy_stats_ref, logits, labels,
                    ignore_index)


@fp8_operator("megacoat::cross_entropy_stats")
def _stats_op(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return traced_body(logits, cross_entropy_stats_triton, cross_entropy_stats_ref, logits, labels, ignore_index)


# --- backward: the logits' gradient, cast into both layouts --------------------------------------------------------
def grad_amax(amax: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """max|g| of g = coef * (p - onehot), from the forward's amax of p - onehot: float32 [1], as kernel and reference
    both take it."""
    return amax * coef.float().abs().reshape(1)


def cross_entropy_grad_fp8_ref(logits, labels, lse, amax, coef, grad_dtype: torch.dtype, ignore_index: int,
                               rowwise: bool = True, transpose: bool = True):
    """(g8 or None, g8^T or None, scale, residual): g = coef * (exp(z - lse) - onehot(y)) in float32, zero on
    ignored tokens, cast with the scale of grad_amax(amax, coef) (cast_transpose's arithmetic); residual: the
    codes' label_residual. coef: float32 [1] or []."""
    _check(logits, labels)
    counted = labels != ignore_index
    here = _label_here(labels, logits.shape[1], ignore_index)
    p = torch.exp(logits.float() - lse[:, None])
    onehot = torch.zeros_like(p).scatter_(1, torch.where(here, labels, 0)[:, None], here[:, None].to(p.dtype))
    g = torch.where(counted[:, None], (p - onehot) * coef.float().reshape(1, 1), 0.0)
    scale = scale_from_amax(grad_amax(amax, coef), grad_dtype).reshape(1)
    q, qt = cast_transpose_ref(g, scale, grad_dtype, rowwise, transpose)
    return q, qt, scale, label_residual(logits, labels, lse, coef, q, qt, scale, ignore_index)


@triton.jit
def _grad_cast_kernel(z_ptr, y_ptr, lse_ptr, coef_ptr, amax_ptr, scale_ptr, out_ptr, outt_ptr, T, V, ignore_index,
                      fmax, amax_floor, ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr):
    # cast_transpose's tile and stores; the tile's values made from the logits instead of loaded
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    scale = cast_scale(scale_ptr, amax_ptr, fmax, amax_floor, True)
    coef = tl.load(coef_ptr)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < T) & (rn[None, :] < V)
    z = tl.load(z_ptr + rm[:, None] * V + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + rm, mask=rm < T, other=0.0)
    y = tl.load(y_ptr + rm, mask=rm < T, other=ignore_index)
    p = tl.exp(z - lse[:, None])
    g = tl.where(rn[None, :] == y[:, None], p - 1.0, p) * coef
    g = tl.where((y != ignore_index)[:, None], g, 0.0)
    q = scaled_codes(g, scale, fmax)
    if ROWWISE:
        tl.store(out_ptr + rm[:, None] * V + rn[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
    if TRANSPOSE:
        tl.store(outt_ptr + rn[:, None] * T + rm[None, :], tl.trans(q).to(outt_ptr.dtype.element_ty),
                 mask=tl.trans(mask))


_BM, _BN, _WARPS = 64, 64, 4  # cast_transpose's tile
_TILES = {"stats": ("_STATS_BLOCK", "_STATS_WARPS"), "grad": ("_BM", "_BN", "_WARPS")}


def tiles() -> dict[str, tuple[int, ...]]:
    """Each kernel's launch tile (block sizes, then warps), read at every launch: {"stats": .., "grad": ..}."""
    return {kernel: tuple(globals()[name] for name in names) for kernel, names in _TILES.items()}


def set_tile(kernel: str, tile: tuple[int, ...]) -> None:
    """Launch `kernel` with another tile from now on (the benchmarks' tile sweeps); tiles() before it gives the
    library's."""
    globals().update(dict(zip(_TILES[kernel], tile, strict=True)))  # all or nothing


def cross_entropy_grad_fp8_triton(logits, labels, lse, amax, coef, grad_dtype: torch.dtype, ignore_index: int,
                                  rowwise: bool = True, transpose: bool = True):
    _check(logits, labels)
    if transpose and logits.dtype == torch.float32 and logits.is_cuda:
        # cast_transpose's Triton 3.6 bug: the transposed store of a tile loaded as float32 writes wrong codes on
        # sm_90; float32 logits are the --fp32 path, not the hot one: transpose the FP8 bytes in torch
        g8, _, scale, residual = cross_entropy_grad_fp8_triton(logits, labels, lse, amax, coef, grad_dtype,
                                                               ignore_index, rowwise=True, transpose=False)
        return (g8 if rowwise else None), g8.t().contiguous(), scale, residual
    logits, labels = logits.contiguous(), labels.contiguous()
    t, v = logits.shape
    out = torch.empty((t, v), dtype=grad_dtype, device=logits.device) if rowwise else None
    outt = torch.empty((v, t), dtype=grad_dtype, device=logits.device) if transpose else None
    scale = torch.empty(1, dtype=torch.float32, device=logits.device)  # written by the kernel's first program
    dummy = out if rowwise else outt
    launcher(_grad_cast_kernel)[(triton.cdiv(t, _BM), triton.cdiv(v, _BN))](
        logits, labels, lse, coef.float().reshape(1), grad_amax(amax, coef), scale,
        out if rowwise else dummy, outt if transpose else dummy, t, v, ignore_index, torch.finfo(grad_dtype).max,
        AMAX_FLOOR, ROWWISE=rowwise, TRANSPOSE=transpose, BM=_BM, BN=_BN, num_warps=_WARPS)
    return out, outt, scale, label_residual(logits, labels, lse, coef, out, outt, scale, ignore_index)


def label_residual(logits, labels, lse, coef, g8, g8t, scale, ignore_index: int) -> torch.Tensor:
    """r [T] float32 = g_y - code_y * scale from the codes a kernel wrote (g8 [T, V], else g8^T [V, T]): one
    gather of T logits and T codes, from the stored codes themselves. Outside the tile kernel because a masked sum
    over a tile's columns at the label miscomputes on sm_90 under Triton 3.6 (the GPU tests catch it)."""
    here = _label_here(labels, logits.shape[1], ignore_index)
    label = torch.where(here, labels, 0)
    z_y = logits.gather(1, label[:, None])[:, 0].float()
    g_y = (torch.exp(z_y - lse) - 1.0) * coef.float().reshape(1)
    if g8 is not None:  # gathered as bytes: torch gathers no FP8 dtype on CUDA
        code = g8.view(torch.uint8).gather(1, label[:, None])[:, 0].view(g8.dtype)
    else:
        code = g8t.view(torch.uint8).gather(0, label[None, :])[0].view(g8t.dtype)
    return torch.where(here, g_y - code.float() * scale, 0.0)


def _label_here(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """Which tokens count and have their label among these logits' `vocab` columns."""
    return (labels != ignore_index) & (labels >= 0) & (labels < vocab)


def cross_entropy_grad_fp8(logits, labels, lse, amax, coef, grad_dtype: torch.dtype, ignore_index: int,
                           rowwise: bool = True, transpose: bool = True):
    """The logits' gradient coef * (softmax - onehot) as (g8 [T, V] or None, g8^T [V, T] or None, scale, residual
    [T] float32: each label entry's rounding error), one pass over the logits (cross_entropy_grad_fp8_ref). lse and
    amax: cross_entropy_stats's; coef: float32 [1] or []."""
    g8, g8t, scale, residual = dispatch(_grad_op, logits, cross_entropy_grad_fp8_triton, cross_entropy_grad_fp8_ref,
                                        logits, labels, lse, amax, coef, grad_dtype, ignore_index, rowwise, transpose)
    return (*asked_layouts(g8, g8t, rowwise, transpose), scale, residual)


@fp8_operator("megacoat::cross_entropy_grad_fp8")
def _grad_op(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, amax: torch.Tensor, coef: torch.Tensor,
             grad_dtype: torch.dtype, ignore_index: int, rowwise: bool, transpose: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g8, g8t, scale, residual = traced_body(logits, cross_entropy_grad_fp8_triton, cross_entropy_grad_fp8_ref,
                                           logits, labels, lse, amax, coef, grad_dtype, ignore_index, rowwise,
                                           transpose)
    return (*op_layouts(logits, grad_dtype, g8, g8t), scale, residual)
