"""Route the FP8 flow through its Triton kernels on CPU tensors (TRITON_INTERPRET=1), as it runs on CUDA.

The dispatchers pick the torch reference for CPU tensors; tests that check what the CUDA path does (host
syncs, launches) swap the names the flow calls for the Triton versions, and put them back afterwards.
"""
from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

import megacoat.coat.head as head_loss
import megacoat.coat.linear as linear
import megacoat.coat.flow as flow
from megacoat.ops import cast_transpose, cross_entropy_fp8, label_corrections, rmsnorm, rope, rope_grad_cast, swiglu

_SWAPS = [(linear, "quantize_transpose", cast_transpose.quantize_transpose_triton),
          (linear, "cast_transpose_delayed", cast_transpose.cast_transpose_delayed_triton),
          (linear, "transpose_fp8", cast_transpose.transpose_fp8_triton),
          (linear, "cast_transpose", lambda x, scale, dtype, rowwise=True, transpose=True, after=None:
           cast_transpose.cast_transpose_triton(x, scale, dtype, rowwise, transpose))]
_SWAPS += [(flow, n, getattr(rmsnorm, n + "_triton")) for n in ("rmsnorm_fp8_fwd", "rmsnorm_fp8_out", "rmsnorm_fp8_bwd")]
_SWAPS += [(flow, n, getattr(swiglu, n + "_triton"))
           for n in ("swiglu_fp8_fwd", "swiglu_fp8_bwd_out_t")]
_SWAPS += [(flow, "rope_rotate", rope.rope_triton),
           (flow, "rope_qkv_grad_fp8", rope_grad_cast.rope_qkv_grad_fp8_triton)]
_SWAPS += [(head_loss, n, getattr(cross_entropy_fp8, n + "_triton"))
           for n in ("cross_entropy_stats", "cross_entropy_grad_fp8")]
_SWAPS += [(head_loss, "label_corrections", label_corrections.label_corrections_triton)]


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


# Allocations and aliases: no kernel on CUDA.
_NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "_unsafe_view", "detach", "alias", "lift_fresh",
              "set_", "_reshape_alias"}


class LaunchCounter(TorchDispatchMode):
    """Counts, while active, the aten ops that launch a CUDA kernel (views and allocations left out) and the
    Triton launches; the interpreter's own tensor traffic inside a Triton launch is not counted."""

    def __init__(self):
        super().__init__()
        self.aten, self.triton, self._inside = collections.Counter(), collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside and not func.is_view and name not in _NO_KERNEL:
            self.aten[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        run = self._run = InterpretedFunction.run

        def counted(fn, *a, **k):
            self.triton[getattr(fn, "__name__", getattr(getattr(fn, "fn", None), "__name__", "?"))] += 1
            self._inside += 1
            try:
                return run(fn, *a, **k)
            finally:
                self._inside -= 1

        InterpretedFunction.run = counted
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._run
        return super().__exit__(*exc)

    @property
    def launches(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())
