"""Per-tensor and per-group (1xG) FP8 quantization and dequantization: torch references, Triton on CUDA.

Round-to-nearest-even with saturation at the format's max. The scale is the dequantization multiplier
scale = amax / F.max (float32); quantization computes q = fp8(clamp(x * (F.max / amax))), the per-group
factor F.max / amax once per group, so kernel and reference do the same float32 operations.
Edge cases: amax == 0 gives scale 0 and q 0; a NaN/Inf anywhere in a group (or the tensor, per tensor) gives
scale NaN, so the group dequantizes to NaN -- visible, never silently repaired -- and q 0; other groups are
unaffected. `QuantizedTensor.nonfinite_groups()` counts them. A positive amax below `amax_floor(fmt)` =
2^(ceil(log2 F.max) - 128) (E4M3 2^-119, E5M2 2^-112) is raised to it: F.max / amax would overflow float32
there (every non-zero x would become F.max and zeros NaN); with the floor such a group keeps its values, on a
smaller part of the FP8 range.

Every function takes backend='auto' (Triton on CUDA tensors, the reference elsewhere), 'torch' or 'triton'.
"""
from __future__ import annotations

from typing import Optional

import torch

from megacoat.fp8._backend import use_triton
from megacoat.fp8._reference import abs_nan_as_inf, check_input, div, from_groups, to_groups
from megacoat.fp8.formats import Fp8Format, get_format
from megacoat.fp8.quantized_tensor import QuantizedTensor, check_group_size, group_scale_shape


def amax_floor(fmt) -> float:
    """Smallest amax used for scaling: a power of two with F.max / floor < 2^128 exactly (see module docstring)."""
    from megacoat.ops.quantize_layout import amax_floor as floor

    return floor(get_format(fmt).dtype)


def _scales(amax: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, quantization multiplier, finite mask) from amax (NaN already mapped to inf)."""
    finite = torch.isfinite(amax)
    amax = torch.where(amax > 0, amax.clamp(min=amax_floor(fmt)), amax)
    scale = torch.where(finite, div(amax, fmt.max), torch.full_like(amax, float("nan")))
    inv = torch.where(finite & (amax > 0), div(fmt.max, amax), torch.zeros_like(amax))
    return scale, inv, finite


def _cast(y: torch.Tensor, finite: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    y = torch.where(finite, y.clamp(-fmt.max, fmt.max), torch.zeros_like(y))
    return y.to(fmt.dtype)


def quantize_per_tensor(x: torch.Tensor, fmt="e4m3", amax: Optional[torch.Tensor] = None, *,
                        backend: str = "auto") -> QuantizedTensor:
    """One scale for the whole tensor. `amax` (0-d float32, e.g. from group scaling's two-stage reduction)
    skips the amax pass; it must bound max|x|, else values saturate."""
    check_input(x, "quantize_per_tensor")
    fmt = get_format(fmt)
    if amax is not None:
        if amax.numel() != 1 or amax.dtype != torch.float32:
            raise ValueError(f"amax must be a one-element float32 tensor, got {amax.dtype} {tuple(amax.shape)}")
        amax = amax.reshape(()).to(x.device)
    if use_triton(x, backend):
        from megacoat.ops.quantize_per_tensor import quantize_per_tensor as kernel

        data, scale = kernel(x, fmt.dtype, amax)
    else:
        xf = x.float()
        if amax is None:
            amax = abs_nan_as_inf(xf).amax() if x.numel() else torch.zeros((), device=x.device)
        scale, inv, finite = _scales(amax, fmt)
        data = _cast(xf * inv, finite, fmt)
    return QuantizedTensor(data=data, scale=scale, group_size=None, orig_dtype=x.dtype)


def quantize_per_group(x: torch.Tensor, fmt="e4m3", group_size: int = 128, *,
                       backend: str = "auto") -> QuantizedTensor:
    """One scale per 1xG group along the last dim (tail groups shorter); scale shape (*lead, ceil(C/G))."""
    check_input(x, "quantize_per_group")
    fmt = get_format(fmt)
    check_group_size(group_size)
    if use_triton(x, backend):
        from megacoat.ops.quantize_per_group import quantize_per_group as kernel

        data, scale = kernel(x, fmt.dtype, group_size)
    else:
        xg = to_groups(x, group_size)
        scale, inv, finite = _scales(abs_nan_as_inf(xg).amax(-1), fmt)
        data = from_groups(_cast(xg * inv[..., None], finite[..., None], fmt), x.shape)
        scale = scale.reshape(group_scale_shape(x.shape, group_size))
    return QuantizedTensor(data=data, scale=scale, group_size=group_size, orig_dtype=x.dtype)


def dequantize(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None, *, backend: str = "auto") -> torch.Tensor:
    """x ~= data * scale (per tensor or per group); expanded tensors go through expansion's inverse map."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize expects a QuantizedTensor, got {type(qt).__name__}")
    dtype = dtype or qt.orig_dtype
    if qt.expanded:
        from megacoat.fp8.expansion import expand_dequantize

        return expand_dequantize(qt, dtype, backend=backend)
    if use_triton(qt.data, backend):
        from megacoat.ops.dequantize import dequantize as kernel

        return kernel(qt.data, qt.scale, qt.group_size, dtype)
    if qt.group_size is None:
        return (qt.data.float() * qt.scale).to(dtype)
    qg = to_groups(qt.data, qt.group_size)
    out = qg * qt.scale.reshape(qg.shape[0], qg.shape[1], 1)
    return from_groups(out, qt.shape).to(dtype)
