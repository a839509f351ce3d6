"""Route the FP8 flow through its Triton kernels on CPU tensors (TRITON_INTERPRET=1), as it runs on CUDA.

The dispatchers pick the torch reference for CPU tensors; tests that check what the CUDA path does (host
syncs, launches) swap the names the flow calls for the Triton versions, and put them back afterwards.
"""
from __future__ import annotations

import contextlib

import megacoat.fp8.linear as linear
import megacoat.fp8.precision_flow as flow
import megacoat.ops.rope as rope
from megacoat.ops import cast_transpose, rmsnorm, swiglu

_SWAPS = [(linear, "quantize_transpose", cast_transpose.quantize_transpose_triton)]
_SWAPS += [(flow, n, getattr(rmsnorm, n + "_triton")) for n in ("rmsnorm_fp8_fwd", "rmsnorm_fp8_out", "rmsnorm_fp8_bwd")]
_SWAPS += [(flow, n, getattr(swiglu, n + "_triton"))
           for n in ("swiglu_fp8_fwd", "swiglu_fp8_out", "swiglu_fp8_bwd_out_t")]
_SWAPS += [(rope, "_rope", lambda x, cos, sin, inverse=False: rope.rope_triton(x, cos, sin, inverse))]


@contextlib.contextmanager
def triton_paths():
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in _SWAPS]
    try:
        for mod, name, fn in _SWAPS:
            setattr(mod, name, fn)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
