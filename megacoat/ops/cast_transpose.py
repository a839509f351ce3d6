"""FP8 cast with a per-tensor scale that writes the row-major copy and its transpose in one pass.

torch._scaled_mm multiplies a row-major A by a column-major B, so a linear layer needs each FP8 operand in
two layouts: x for the forward GEMM and x^T for the weight gradient, g for dgrad and g^T for wgrad. Writing
both from one read of the high-precision tensor costs one extra byte per element instead of a second pass.

`scale` is the dequantization scale (amax / fmt_max): stored = clamp(x / scale), value = stored * scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def amax_scale(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor dequantization scale amax / fmt_max as a 1-element fp32 tensor (no host sync).
    An all-zero tensor gets the smallest positive scale so that dividing by it stays finite."""
    lo, hi = torch.aminmax(x.detach())  # one pass, no |x| temporary
    amax = torch.maximum(lo.abs(), hi.abs()).float()
    return (amax.clamp(min=torch.finfo(torch.float32).tiny) / torch.finfo(out_dtype).max).reshape(1)


def cast_transpose_ref(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                       rowwise: bool = True, transpose: bool = True):
    """Reference: (x / scale) clamped to the format and cast; returns (q or None, q^T contiguous or None)."""
    if x.dim() != 2:
        raise ValueError(f"cast_transpose expects a 2-D tensor, got shape {tuple(x.shape)}")
    fmax = torch.finfo(out_dtype).max
    q = (x.float() / scale.float()).clamp(-fmax, fmax).to(out_dtype)
    return (q if rowwise else None), (q.t().contiguous() if transpose else None)


@triton.jit
def _cast_transpose_kernel(x_ptr, scale_ptr, out_ptr, outt_ptr, M, N, fmax,
                           ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    q = tl.clamp(x / scale, -fmax, fmax)
    if ROWWISE:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
    if TRANSPOSE:
        tl.store(outt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q).to(outt_ptr.dtype.element_ty),
                 mask=tl.trans(mask))


def cast_transpose_triton(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                          rowwise: bool = True, transpose: bool = True):
    if x.dim() != 2:
        raise ValueError(f"cast_transpose expects a 2-D tensor, got shape {tuple(x.shape)}")
    x = x.contiguous()
    m, n = x.shape
    out = torch.empty((m, n), dtype=out_dtype, device=x.device) if rowwise else None
    outt = torch.empty((n, m), dtype=out_dtype, device=x.device) if transpose else None
    bm, bn = 64, 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    dummy = out if out is not None else outt
    _cast_transpose_kernel[grid](x, scale, out if rowwise else dummy, outt if transpose else dummy, m, n,
                                 torch.finfo(out_dtype).max, ROWWISE=rowwise, TRANSPOSE=transpose,
                                 BM=bm, BN=bn, num_warps=4)
    return out, outt


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                   rowwise: bool = True, transpose: bool = True):
    """(q, q^T) with q = fp8(x / scale); either may be skipped. Triton on CUDA, the reference on CPU (the
    CPU tests run the Triton versions under the interpreter by calling them by name)."""
    fn = cast_transpose_triton if x.is_cuda else cast_transpose_ref
    return fn(x, scale, out_dtype, rowwise, transpose)
