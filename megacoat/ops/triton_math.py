"""Triton: the cheaper math of the fused FP8 kernels on the GPU, with the plain form the CPU interpreter runs.

FAST (megacoat.ops.numerics) is False under TRITON_INTERPRET=1 (the interpreter has no libdevice fast math);
kernels take it as a constexpr, so each path compiles alone. Both paths stay within a few fp32 ulp of each other,
far below the E4M3/E5M2 rounding step, and the GPU tests compare the FAST path with the torch references.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """1 / (1 + 2^(-x log2 e)) with ex2.approx.ftz and the approximate divide: 6 SASS instructions against
    tl.sigmoid's 12, whose ex2 and divide carry subnormal and huge-divisor fix-ups that cannot matter here
    (1 + e >= 1, and past 2^126 the result is 0 either way)."""
    if FAST:
        return libdevice.fast_dividef(1.0, 1.0 + tl.math.exp2(-1.4426950408889634 * x))
    else:
        return tl.sigmoid(x)


@triton.jit
def saturate(x, fmax, FAST: tl.constexpr):
    """Clamp to [-fmax, fmax] before an FP8 cast. On the GPU the cast saturates by itself (PTX converts to
    e4m3/e5m2 only with .satfinite), so the two min/max per element are dropped; the interpreter clamps."""
    if FAST:
        return x
    else:
        return tl.clamp(x, -fmax, fmax)


@triton.jit
def div_saturate(x, scale, fmax, FAST: tl.constexpr):
    """x / scale (a per-tensor scalar) clamped for the FP8 cast, as x * (1 / scale): one reciprocal instead of a
    divide per element (within 1.5 ulp of x / scale, like Triton's approximate divide). When 1 / scale
    overflows (an all-zero tensor has scale = tiny / fmax, and 0 * inf is NaN) it divides: a branch taken
    alike by every thread."""
    inv = 1.0 / scale
    if inv < 3.0e38:
        y = x * inv
    else:
        y = x / scale
    return saturate(y, fmax, FAST)
