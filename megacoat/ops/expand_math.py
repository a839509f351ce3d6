"""log2/exp2 for the expansion kernels: libdevice's accurate versions when compiled, numpy's when interpreted.

tl.log2/tl.exp2 lower to the approximate PTX lg2/ex2 on NVIDIA GPUs, while torch's CUDA log2/exp2 call the
CUDA math library (log2f/exp2f, as libdevice's __nv_log2f/__nv_exp2f); using libdevice makes the kernels agree
with the torch reference bit for bit. The Triton interpreter has no libdevice (extern calls are unsupported),
so under TRITON_INTERPRET=1 the plain tl versions (numpy there) stand in; CPU tests compare with a tolerance.
"""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    @triton.jit
    def log2(x):
        return tl.log2(x)

    @triton.jit
    def exp2(x):
        return tl.exp2(x)
else:
    @triton.jit
    def log2(x):
        return libdevice.log2(x)

    @triton.jit
    def exp2(x):
        return libdevice.exp2(x)
