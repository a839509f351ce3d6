"""The FP8 head's label corrections: each label entry's rounding error added back to dx and dW (megacoat.coat.head).

The logits' gradient reaches the head's backward GEMMs as E5M2 codes; its label entries, the rows' largest, lose
most to that rounding, so the loss also returns each token's residual r_t (the label entry's value less its code's)
and the head adds it back in float32:

    dx_t += r_t W[y_t]                          (W the BF16 weight)
    dW[y] += sum over the tokens t labelled y of r_t x_t    (x as wgrad reads it: x8^T [K, T] times its scale)

One kernel does both, over tiles of tokens x hidden columns: it reads each token's weight row and x column once,
updates dx in place, and adds r_t x_t into a float32 copy of dW with atomics (frequent labels sum thousands of rows,
hence float32, not bf16; the atomics sum in no fixed order, as attention's backward does). dW is then rounded back
into the wgrad GEMM's own output. Done in torch, the same sums take eight kernels a piece of tokens (gather,
addcmul, the FP8 rows' float copy, their scaling, index_add, then the sum's zero fill, add and copy).

The torch reference goes over the tokens in pieces of LABEL_PIECE_ELEMENTS (a bounded transient on the CPU); it is
also the path under torch's deterministic mode, where index_add_ sums in a fixed order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.numerics import dispatch, fp8_operator, launcher, traced_body

LABEL_PIECE_ELEMENTS = 1 << 24  # the reference's piece: its float32 rows [piece, K] stay at 64 MiB, not 4 T K bytes


def _check(dx, dw, residual, label, weight, x8t, x_scale) -> None:
    t = residual.shape[0]
    v, k = weight.shape
    if label.shape != (t,) or x8t.shape != (k, t):
        raise ValueError(f"label_corrections: label {tuple(label.shape)} and x8t {tuple(x8t.shape)} do not match "
                         f"{t} tokens of hidden size {k}")
    if dx is not None and (dx.shape != (t, k) or not dx.is_contiguous()):
        raise ValueError(f"label_corrections: dx {tuple(dx.shape)} is not a contiguous [{t}, {k}] (the kernel "
                         "writes it in place, row by row)")
    if dw is not None and dw.shape != (v, k):
        raise ValueError(f"label_corrections: dw {tuple(dw.shape)} is not the weight's [{v}, {k}]")


def label_corrections_ref(dx: torch.Tensor | None, dw: torch.Tensor | None, residual: torch.Tensor,
                          label: torch.Tensor, weight: torch.Tensor, x8t: torch.Tensor, x_scale: torch.Tensor) -> None:
    """dx and dw updated in place (None: not needed), over the tokens in pieces: dx_t in float32 and rounded once,
    dW's sums in a float32 V x K copy, rounded into dw once at the end."""
    _check(dx, dw, residual, label, weight, x8t, x_scale)
    piece = max(1, LABEL_PIECE_ELEMENTS // weight.shape[1])
    if dx is not None:
        for t0 in range(0, dx.shape[0], piece):
            sl = slice(t0, t0 + piece)
            rows = weight.index_select(0, label[sl]).float().mul_(residual[sl, None])
            dx[sl] = rows.add_(dx[sl].float()).to(dx.dtype)
    if dw is not None:
        total = dw.float()
        factor = residual * x_scale.float().reshape(())
        for t0 in range(0, x8t.shape[1], piece):
            sl = slice(t0, t0 + piece)
            total.index_add_(0, label[sl], x8t[:, sl].t().float().mul_(factor[sl, None]))
        dw.copy_(total)


@triton.jit
def _label_corrections_kernel(dx_ptr, total_ptr, r_ptr, y_ptr, w_ptr, xt_ptr, xs_ptr, T, K, DX: tl.constexpr,
                              DW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    # a tile of BT tokens x BK hidden columns; a token whose residual is 0 (an ignored one) adds nothing
    rt = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    rk = (tl.program_id(1) * BK + tl.arange(0, BK)).to(tl.int64)
    r = tl.load(r_ptr + rt, mask=rt < T, other=0.0)
    y = tl.load(y_ptr + rt, mask=rt < T, other=0)
    mask = ((rt < T) & (r != 0.0))[:, None] & (rk < K)[None, :]
    if DX:
        w = tl.load(w_ptr + y[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dx_ptr + rt[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rt[:, None] * K + rk[None, :], (r[:, None] * w + d).to(dx_ptr.dtype.element_ty), mask=mask)
    if DW:
        # x8^T's tile is read along the tokens (its rows), then turned so that the atomics run along dW's rows
        xt = tl.load(xt_ptr + rk[:, None] * T + rt[None, :], mask=tl.trans(mask), other=0.0).to(tl.float32)
        factor = r * tl.load(xs_ptr)
        tl.atomic_add(total_ptr + y[:, None] * K + rk[None, :], tl.trans(xt) * factor[:, None], mask=mask,
                      sem="relaxed")


_BT, _BK, _WARPS = 32, 128, 4  # tokens x hidden columns a program, warps


def tiles() -> dict[str, tuple[int, ...]]:
    """The kernel's launch tile (tokens, hidden columns, warps), read at every launch: {"corrections": ..}."""
    return {"corrections": (_BT, _BK, _WARPS)}


def set_tile(kernel: str, tile: tuple[int, ...]) -> None:
    """Launch `kernel` with another tile from now on (the benchmarks' tile sweeps); tiles() before it gives the
    library's."""
    global _BT, _BK, _WARPS
    if kernel != "corrections":
        raise KeyError(kernel)
    _BT, _BK, _WARPS = tile


def label_corrections_triton(dx: torch.Tensor | None, dw: torch.Tensor | None, residual: torch.Tensor,
                             label: torch.Tensor, weight: torch.Tensor, x8t: torch.Tensor, x_scale: torch.Tensor,
                             tile: tuple[int, int, int] | None = None) -> None:
    _check(dx, dw, residual, label, weight, x8t, x_scale)
    if dx is None and dw is None:
        return
    t, k = residual.shape[0], weight.shape[1]
    bt, bk, warps = tile or (_BT, _BK, _WARPS)
    total = dw.float() if dw is not None else None
    launcher(_label_corrections_kernel)[(triton.cdiv(t, bt), triton.cdiv(k, bk))](
        dx if dx is not None else total, total if total is not None else dx,  # an unused pointer: the other tensor
        residual.contiguous(), label.contiguous(), weight.contiguous(), x8t.contiguous(), x_scale.float().reshape(1),
        t, k, DX=dx is not None, DW=dw is not None, BT=bt, BK=bk, num_warps=warps)
    if dw is not None:
        dw.copy_(total)


def label_corrections(dx: torch.Tensor | None, dw: torch.Tensor | None, residual: torch.Tensor, label: torch.Tensor,
                      weight: torch.Tensor, x8t: torch.Tensor, x_scale: torch.Tensor) -> None:
    """Adds the label entries' rounding back, in place: dx [T, K] (the dgrad GEMM's output) += r_t W[y_t], and dw
    [V, K] (the wgrad GEMM's output) += the sum of r_t x_t over the tokens labelled y, each in float32 and rounded
    once into its tensor's dtype. None: that gradient is not needed. residual [T] float32 (0 for ignored tokens),
    label [T] int64 in [0, V), weight [V, K] (BF16), x8t [K, T] FP8, x_scale float32 [1]. The kernel on CUDA (the
    reference under torch's deterministic mode), the reference elsewhere; a registered operator under
    torch.compile."""
    dispatch(_label_corrections_op, residual, _cuda_path, label_corrections_ref, dx, dw, residual, label, weight, x8t,
             x_scale)


def _cuda_path(*args) -> None:
    """What runs for CUDA tensors (numerics.pick's kernel): the Triton kernel, or the reference's fixed-order
    index_add_ under torch's deterministic mode."""
    (label_corrections_ref if torch.are_deterministic_algorithms_enabled() else label_corrections_triton)(*args)


@fp8_operator("megacoat::label_corrections", mutates_args=("dx", "dw"))
def _label_corrections_op(dx: torch.Tensor | None, dw: torch.Tensor | None, residual: torch.Tensor,
                          label: torch.Tensor, weight: torch.Tensor, x8t: torch.Tensor, x_scale: torch.Tensor) -> None:
    traced_body(residual, _cuda_path, label_corrections_ref, dx, dw, residual, label, weight, x8t, x_scale)
