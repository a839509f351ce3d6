"""The float32 -> FP8 cast used by the quantization kernels (round-to-nearest-even; inputs already clamped).

Compiled, it is the native conversion (cvt.rn.satfinite on Hopper), which the GPU tests check bit-exact
against torch. The Triton interpreter's float downcast (triton/runtime/interpreter.py `_convert_float`) is not
RNE: ties round up, a carry out of the mantissa is dropped (127.3 -> 64 instead of 128 in E4M3), and subnormal
results truncate. So under TRITON_INTERPRET=1 the value is first rounded onto the FP8 grid here, exactly, with
integer ops on the float32 bits (normal range) and the add-a-large-constant trick (subnormal range, where the
grid step is the fixed F.min_subnormal); the interpreter's cast of a representable value is then exact.
"""
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:
    def _grid(torch_dtype):
        fi = torch.finfo(torch_dtype)
        mant = round(-torch.log2(torch.tensor(fi.eps)).item())
        min_sub = fi.smallest_normal * fi.eps
        return mant, fi.smallest_normal, min_sub * 2.0 ** 23  # magic: float32 ulp there == min_sub

    _E4M3 = _grid(torch.float8_e4m3fn)
    _E5M2 = _grid(torch.float8_e5m2)

    @triton.jit
    def cast_fp8(y, dtype: tl.constexpr):
        mant, min_normal, magic = _E5M2 if dtype == tl.float8e5 else _E4M3
        drop = 23 - mant
        a = tl.abs(y)
        u = a.to(tl.uint32, bitcast=True)
        u = (u + ((1 << (drop - 1)) - 1) + ((u >> drop) & 1)) & ~((1 << drop) - 1)
        normal = u.to(tl.float32, bitcast=True)
        sub = (a + magic) - magic
        r = tl.where(a < min_normal, sub, normal)
        return tl.where(y < 0, -r, r).to(dtype)
else:
    @triton.jit
    def cast_fp8(y, dtype: tl.constexpr):
        return y.to(dtype)
