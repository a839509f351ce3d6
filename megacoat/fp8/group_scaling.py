"""Group scaling (COAT): a per-tensor amax reduced in two stages so no extra pass over the tensor is needed.

Stage 1 writes one amax per 1xG group and is fused into the kernel that produces the tensor
(`elementwise_group_amax`: y = op(x) and the amax of each group of y, as stored, in one pass; kernels of other
ops fuse the same step through `megacoat.ops.group_amax.store_group_amax`). Stage 2 reduces that G-times
smaller tensor to one value (`reduce_group_amax`), and per-tensor quantization uses it (`quantize_group_scaled`).
NaN/Inf count as an infinite amax, so a non-finite tensor gets a NaN scale (see quantize.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megacoat.fp8._backend import use_triton
from megacoat.fp8._reference import abs_nan_as_inf, check_input, to_groups
from megacoat.fp8.quantize import quantize_per_tensor
from megacoat.fp8.quantized_tensor import QuantizedTensor, check_group_size, group_scale_shape

# The elementwise ops the fused building block offers; the activation kernels fuse stage 1 themselves.
ELEMENTWISE_OPS = {
    "identity": lambda x: x,
    "relu": F.relu,
    "silu": F.silu,
    "square": torch.square,
}


def group_amax(x: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """float32 max|x| per 1xG group along the last dim, shape (*lead, ceil(C/G)); NaN/Inf -> inf."""
    check_input(x, "group_amax")
    check_group_size(group_size)
    return abs_nan_as_inf(to_groups(x, group_size)).amax(-1).reshape(group_scale_shape(x.shape, group_size))


def elementwise_group_amax(x: torch.Tensor, op: str = "identity", group_size: int = 128,
                           out_dtype: Optional[torch.dtype] = None, *, backend: str = "auto"):
    """Stage 1, fused: (y = op(x) in out_dtype, per-group amax of y as stored). One read of x, one write of y."""
    check_input(x, "elementwise_group_amax")
    check_group_size(group_size)
    if op not in ELEMENTWISE_OPS:
        raise ValueError(f"op must be one of {sorted(ELEMENTWISE_OPS)}, got {op!r}")
    out_dtype = out_dtype or x.dtype
    if use_triton(x, backend):
        from megacoat.ops.group_amax import elementwise_group_amax as kernel

        return kernel(x, op, group_size, out_dtype)
    y = ELEMENTWISE_OPS[op](x.float()).to(out_dtype)
    return y, group_amax(y, group_size)


def reduce_group_amax(amax: torch.Tensor) -> torch.Tensor:
    """Stage 2: the per-tensor amax (0-d float32) from stage 1's per-group amaxes; inf stays inf."""
    if amax.dtype != torch.float32:
        raise TypeError(f"group amax must be float32, got {amax.dtype}")
    return amax.amax() if amax.numel() else torch.zeros((), device=amax.device)


def quantize_group_scaled(x: torch.Tensor, fmt="e4m3", amaxes: Optional[torch.Tensor] = None, *,
                          group_size: int = 128, backend: str = "auto") -> QuantizedTensor:
    """Per-tensor quantization with the scale from the two-stage amax; `amaxes` is stage 1's output (the
    per-group amaxes written by the kernel that produced x), computed here if not given."""
    if amaxes is None:
        amaxes = group_amax(x, group_size)
    return quantize_per_tensor(x, fmt, amax=reduce_group_amax(amaxes), backend=backend)
