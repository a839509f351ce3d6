"""Dynamic range expansion (COAT): per 1xG group, map |x| through a power k so the group's range fills FP8's.

The contract (shared with CoatAdamW, do not diverge):
  amax = max|x|, amin = min|x| over the group's non-zero entries;
  k = log2(R_F) / log2(amax / amin), R_F = F.max / F.min_subnormal, clamped to [K_MIN, K_MAX];
  k = 1 for an all-zero group, one with a single distinct magnitude or a float32-subnormal amax; k is rounded
  to bfloat16 once and the stored value serves both directions, so round trips are self-consistent.
  scale = amax / F.max (float32), as in plain per-group quantization (amax raised to 2^-126 if subnormal).
  quantize:   q = fp8(sign(x) * F.max * exp2(k * log2(|x| / amax)))      (|x| = 0 -> 0)
  dequantize: x = sign(q) * (F.max * scale) * exp2(log2(|q| / F.max) / k)
This equals COAT's f(x) = sign(x)|x|^k scaled by max|f| / F.max, written so nothing overflows for large k.
k == 1 skips the pow (exactly plain per-group quantization up to float32 rounding).

Why the bounds: K_MAX = 64 stops expanding groups whose range is already tiny (amax/amin < R_F^(1/64)), where a
larger k buys nothing and only grows the float32 pow error; K_MIN = 1/16 covers any finite float32 range
(amax/amin <= 2^277 < R_F^16), so k never has to go lower.

Error bound: rounding f = (|x|/amax)^k to a normal FP8 value has relative error <= u = F.eps / 2, and
x = f^(1/k), so |dx/x| <= (1+u)^(1/k) - 1 ~ u / k, plus a few float32 ulps from log2/exp2; k > 1 *shrinks*
the relative error. An f in FP8's subnormal range has absolute error <= F.min_subnormal / 2 in f-space.
Non-finite input: as in quantize.py, the group's scale is NaN (it dequantizes to NaN) and its q and k are 0 / 1.
Float32 subnormals: |x| / amax and (|q| / F.max)^(1/k) below 2^-126 (float32's smallest normal) are flushed to
0 -- values below amax * 2^-126, far under what the group's FP8 codes resolve. A group whose amax is itself
subnormal gets k = 1 and is scaled as if its amax were 2^-126 (1 / amax would overflow float32 and turn the
group into NaN and F.max codes): plain per-group quantization on a reduced part of the FP8 range. GPU math libraries run in
flush-to-zero mode; flushing explicitly here keeps the torch reference and the kernels bit-identical.
Implementation notes: the division |x| / amax is computed as |x| * (1 / amax) and |q| / F.max as
|q| * fp32(1 / F.max), 1 / k once per group, so the kernels do the same float32 operations in the same order.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megacoat.fp8._backend import use_triton
from megacoat.fp8._reference import abs_nan_as_inf, check_input, div, from_groups, to_groups
from megacoat.fp8.formats import Fp8Format, get_format
from megacoat.fp8.quantized_tensor import QuantizedTensor, check_group_size, group_scale_shape

K_MIN = 1.0 / 16
K_MAX = 64.0
_FLT_MIN = torch.finfo(torch.float32).tiny


def log2_range(fmt: Fp8Format) -> float:
    """log2(F.max / F.min_subnormal): E4M3 log2(229376) ~ 17.81, E5M2 log2(57344 * 2^16) ~ 31.81."""
    return math.log2(fmt.dynamic_range)


def expansion_exponent(amax: torch.Tensor, amin: torch.Tensor, fmt) -> torch.Tensor:
    """Per-group k (bfloat16) from float32 amax and non-zero amin (amin = inf for an all-zero group)."""
    fmt = get_format(fmt)
    k = div(log2_range(fmt), torch.log2(div(amax, amin)))
    k = k.clamp(K_MIN, K_MAX)  # ratio overflowing to inf gives k = 0 -> K_MIN
    spread = torch.isfinite(amax) & (amax > amin)  # false for all-zero (amin = inf), one magnitude, non-finite
    spread &= amax >= _FLT_MIN  # a subnormal amax: not expanded (see the module docstring)
    return torch.where(spread, k, torch.ones_like(k)).to(torch.bfloat16)


def expand_quantize(x: torch.Tensor, fmt="e4m3", group_size: int = 128, *, backend: str = "auto") -> QuantizedTensor:
    """Quantize with per-group dynamic range expansion; returns a QuantizedTensor with `k` set."""
    check_input(x, "expand_quantize")
    fmt = get_format(fmt)
    check_group_size(group_size)
    if use_triton(x, backend):
        from megacoat.ops.expand_quantize import expand_quantize as kernel

        data, scale, k = kernel(x, fmt.dtype, group_size, log2_range(fmt), K_MIN, K_MAX)
    else:
        data, scale, k = _expand_quantize_ref(x, fmt, group_size)
    return QuantizedTensor(data=data, scale=scale, group_size=group_size, orig_dtype=x.dtype, k=k)


def _expand_quantize_ref(x: torch.Tensor, fmt: Fp8Format, group_size: int):
    xg = to_groups(x, group_size)
    a = abs_nan_as_inf(xg)
    amax = a.amax(-1)
    amin = torch.where(a > 0, a, torch.full_like(a, float("inf"))).amin(-1)
    k = expansion_exponent(amax, amin, fmt)
    finite = torch.isfinite(amax)
    amax_s = torch.where(amax > 0, amax.clamp(min=_FLT_MIN), amax)  # 1 / amax must not overflow (docstring)
    scale = torch.where(finite, div(amax_s, fmt.max), torch.full_like(amax, float("nan")))
    inv_amax = torch.where(finite & (amax > 0), div(1.0, amax_s), torch.zeros_like(amax))

    kf = k.float()[..., None]
    r = a * inv_amax[..., None]
    r = torch.where(r < _FLT_MIN, torch.zeros_like(r), r)  # flush float32 subnormals (see module docstring)
    f = torch.where(kf == 1, r, torch.exp2(kf * torch.log2(r)))  # r = 0: log2 = -inf, exp2 -> 0
    mag = (f * fmt.max).clamp(max=fmt.max)
    q = torch.where(xg < 0, -mag, mag)
    q = torch.where(finite[..., None], q, torch.zeros_like(q)).to(fmt.dtype)
    shape = group_scale_shape(x.shape, group_size)
    return from_groups(q, x.shape), scale.reshape(shape), k.reshape(shape)


def expand_dequantize(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None, *,
                      backend: str = "auto") -> torch.Tensor:
    """Inverse of expand_quantize: x = sign(q) * (F.max * scale) * (|q| / F.max)^(1/k)."""
    if not isinstance(qt, QuantizedTensor) or not qt.expanded:
        raise TypeError("expand_dequantize expects a QuantizedTensor made by expand_quantize (with k)")
    dtype = dtype or qt.orig_dtype
    if use_triton(qt.data, backend):
        from megacoat.ops.expand_dequantize import expand_dequantize as kernel

        return kernel(qt.data, qt.scale, qt.k, qt.group_size, dtype)
    fmt = qt.fmt
    qg = to_groups(qt.data, qt.group_size)
    rows, n_groups = qg.shape[:2]
    kf = qt.k.float().reshape(rows, n_groups, 1)
    inv_k = div(1.0, kf)
    m = qt.scale.reshape(rows, n_groups, 1) * fmt.max
    rq = qg.abs() * (1.0 / fmt.max)
    e = torch.where(kf == 1, rq, torch.exp2(torch.log2(rq) * inv_k))
    e = torch.where(e < _FLT_MIN, torch.zeros_like(e), e)
    out = e * m
    out = torch.where(qg < 0, -out, out)
    return from_groups(out, qt.shape).to(dtype)
