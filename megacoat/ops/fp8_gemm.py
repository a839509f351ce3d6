"""The FP8 GEMM every FP8 linear calls: `scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum)` computes
(a * scale_a) @ (b * scale_b) in float32 and casts it to out_dtype, torch._scaled_mm's contract.

a [M, K] and b [K, N] are FP8 (E4M3 or E5M2, either operand), b usually column-major (the transposed view of a
row-major [N, K]); scale_a is one float32 element or [M, 1] (row-wise), scale_b one element or [1, N].
CUDA runs torch._scaled_mm (cuBLASLt). Elsewhere the registered operator megacoat::scaled_mm runs the upcast: an
FP8 value is exact in float32, so each operand is decoded through a 256-entry table (value * scale, the very
float32 product an elementwise upcast-and-scale rounds to), then one float32 matmul. These are the numerics of
torch._scaled_mm's CPU emulation, which decodes FP8 one element at a time and on some CPUs takes a reference
oneDNN path orders of magnitude slower than the float32 matmul. use_fast_accum only selects cuBLASLt's
accumulation; the upcast always accumulates in float32.
"""
from __future__ import annotations

import torch

from megacoat.ops.numerics import FP8_DTYPES, fp8_table


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) with float32 accumulation, as out_dtype: see the module docstring."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=use_fast_accum)
    return torch.ops.megacoat.scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum)


def gemm_op(device: torch.device | str) -> torch._ops.OpOverload:
    """The operator scaled_mm runs on `device` (what a traced graph or a dispatch mode sees)."""
    if torch.device(device).type == "cuda":
        return torch.ops.aten._scaled_mm.default
    return torch.ops.megacoat.scaled_mm.default


def decode(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x8 * scale in float32, x8's layout kept (row-major or its transpose). scale: one element, folded into the
    table (256 products instead of one per element), or a tensor broadcast against x8."""
    if x8.dtype not in FP8_DTYPES:
        raise ValueError(f"scaled_mm: operands must be FP8 ({FP8_DTYPES}), got {x8.dtype}")
    if x8.dim() == 2 and not x8.is_contiguous() and x8.t().is_contiguous():
        return decode(x8.t(), scale.t() if scale.dim() == 2 else scale).t()
    table = fp8_table(x8.dtype, x8.device)
    tensorwise = scale.numel() == 1
    if tensorwise:
        table = table * scale.reshape(1).float()
    codes = x8.contiguous().view(torch.uint8).reshape(-1).int()
    out = table.index_select(0, codes).view(x8.shape)
    return out if tensorwise else out.mul_(scale.float())


@torch.library.custom_op("megacoat::scaled_mm", mutates_args=())
def _scaled_mm_upcast(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    if scale_a.numel() not in (1, m) or scale_b.numel() not in (1, n):
        raise ValueError(f"scaled_mm: scales must be tensor-wise or row-wise ([{m}, 1] and [1, {n}]), got "
                         f"{tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    sa = scale_a.reshape(-1, 1) if scale_a.numel() > 1 else scale_a
    sb = scale_b.reshape(1, -1) if scale_b.numel() > 1 else scale_b
    return (decode(a, sa) @ decode(b, sb)).to(out_dtype)


@_scaled_mm_upcast.register_fake
def _(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
