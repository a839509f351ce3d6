"""log2/exp2 for the expansion kernels.

Accurate (default): libdevice's log2/exp2, as torch's CUDA log2/exp2 (CUDA's log2f/exp2f), so the kernels agree
with the torch reference bit for bit (tl.log2 compiles to the same software log2: no lg2 in the PTX, and the
same time in benchmarks/bench_quant.py). Approximate: the PTX lg2.approx/ex2.approx (one MUFU op each, ~2 ulp;
about 12 fewer FFMA per element in the SASS), for callers that accept the error bound tested in
tests/ops/test_expand_kernels.py in exchange for speed (the CoatAdamW CUDA kernel makes the same choice).
`log2_normal`: libdevice's log2f for normal inputs only, written out (same constants and FMA order), ~7 fewer
instructions per element where the caller knows the input is normal or discards the result otherwise; it runs
in the interpreter too (as plain float ops). tests/ops/test_expand_kernels.py checks its constants against the
PTX of libdevice.log2 on the installed Triton, and bit-exactness with torch.log2 on the GPU.
Float32 subnormals: the compiled kernels run libdevice in flush-to-zero mode, so both the kernels and the
reference flush explicitly (`FLT_MIN`) where a subnormal could arise; that keeps them bit-identical.
The Triton interpreter has no libdevice and no inline PTX: under TRITON_INTERPRET=1 numpy's log2/exp2 stand
in for both, and CPU tests compare with a tolerance.
"""
import os
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FLT_MIN = tl.constexpr(torch.finfo(torch.float32).tiny)  # smallest normal float32, 2^-126


def _f32(bits: int) -> tl.constexpr:
    return tl.constexpr(struct.unpack("<f", struct.pack("<I", bits))[0])


# libdevice __nv_log2f (CUDA 12/13, as compiled by Triton 3.6 and 3.9): split x = 2^e * m, m in [sqrt(1/2), sqrt(2)),
# t = m - 1, log2(x) = e + (t / ln2 + t^2 * P(t)), P of degree 8 by Horner with FMAs. The constants are its
# float32 bit patterns, read from the PTX (benchmarks/results/bench_quant_notes.md says how to re-check them).
_LOG2_SPLIT = tl.constexpr(0x3F3504F3)  # bits of sqrt(1/2)
_LOG2_P = [_f32(b) for b in (0x3DC6B27F, 0xBE2C7F30, 0x3E2FCF2A, 0xBE374E43, 0x3E520BF4, 0xBE763C8B, 0x3E93BF99,
                             0xBEB8AA49, 0x3EF6384A, 0xBF38AA3B)]
_P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7, _P8, _P9 = _LOG2_P
_INV_LN2 = _f32(0x3FB8AA3B)
_TWO_M23 = _f32(0x34000000)


@triton.jit
def log2_normal(x):
    """libdevice's log2f bit for bit for a normal float32 x > 0 (2^-126 <= x < inf), without its paths for
    subnormal, zero, infinite and NaN inputs (~7 instructions per element): the caller guarantees the range or
    overrides the result. Plain float32 ops and explicit FMAs, so it also runs in the interpreter."""
    u = x.to(tl.int32, bitcast=True)
    e = (u - _LOG2_SPLIT) & -8388608  # exponent field, re-centred on sqrt(1/2)
    t = (u - e).to(tl.float32, bitcast=True) - 1.0
    p = tl.fma(_P0, t, _P1)
    p = tl.fma(p, t, _P2)
    p = tl.fma(p, t, _P3)
    p = tl.fma(p, t, _P4)
    p = tl.fma(p, t, _P5)
    p = tl.fma(p, t, _P6)
    p = tl.fma(p, t, _P7)
    p = tl.fma(p, t, _P8)
    p = tl.fma(p, t, _P9)
    p = tl.fma(t, _INV_LN2, t * (t * p))
    return e.to(tl.float32) * _TWO_M23 + p  # e * 2^-23 is exact, so the contracted FMA equals libdevice's add

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    @triton.jit
    def log2(x):
        return tl.log2(x)

    @triton.jit
    def exp2(x):
        return tl.exp2(x)

    @triton.jit
    def approx_log2(x):
        return tl.log2(x)

    @triton.jit
    def approx_exp2(x):
        return tl.exp2(x)
else:
    @triton.jit
    def log2(x):
        return libdevice.log2(x)

    @triton.jit
    def exp2(x):
        return libdevice.exp2(x)

    @triton.jit
    def approx_log2(x):
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def approx_exp2(x):
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
