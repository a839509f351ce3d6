"""log2/exp2 for the expansion kernels.

Accurate (default): libdevice's log2/exp2, as torch's CUDA log2/exp2 (CUDA's log2f/exp2f), so the kernels agree
with the torch reference bit for bit (tl.log2 compiles to the same software log2: no lg2 in the PTX, and the
same time in benchmarks/bench_quant.py). Approximate: the PTX lg2.approx/ex2.approx (one MUFU op each, ~2 ulp;
about 12 fewer FFMA per element in the SASS), for callers that accept the error bound tested in
tests/ops/test_expand_kernels.py in exchange for speed (the CoatAdamW CUDA kernel makes the same choice).
Float32 subnormals: the compiled kernels run libdevice in flush-to-zero mode, so both the kernels and the
reference flush explicitly (`FLT_MIN`) where a subnormal could arise; that keeps them bit-identical.
The Triton interpreter has no libdevice and no inline PTX: under TRITON_INTERPRET=1 numpy's log2/exp2 stand
in for both, and CPU tests compare with a tolerance.
"""
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FLT_MIN = tl.constexpr(torch.finfo(torch.float32).tiny)  # smallest normal float32, 2^-126

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
