"""FP8 linear layer: E4M3 input and weight with per-tensor scales, GEMMs by torch._scaled_mm (fp32 accumulate),
and backward dgrad/wgrad GEMMs in FP8 with the output gradient in E5M2 (or E4M3).

`fp8_linear(x, weight, cache, grad_dtype)` is a plain function over tensors, so tensor-parallel layers can call
it on their shards; `Fp8Linear` is the nn.Linear that `convert_to_fp8` swaps in (same parameter, `weight`).

Layouts. _scaled_mm multiplies row-major A [M, K] by column-major B [K, N]:
    forward  y  = x  @ W^T : A = x8 [M, K],  B = W8.t()   (W8 [N, K] row-major)
    dgrad    dx = g  @ W   : A = g8 [M, N],  B = W8t.t()  (W8t [K, N], the weight's FP8 transpose, cached)
    wgrad    dW = g^T @ x  : A = g8t [N, M], B = x8t.t()  (x8t [K, M], saved: the only activation kept)
so each operand is cast once into both layouts it needs (ops.cast_transpose). All of N, K and, for backward,
M (tokens per micro-batch) must be multiples of 16: cuBLASLt's FP8 kernels need 16-byte aligned leading
dimensions. Shapes that break this get a ValueError naming the dimension (no silent fallback to BF16).

The weight's FP8 copies are made once per optimizer step and reused by every micro-batch: see Fp8WeightCache.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from megacoat.fp8.formats import E4M3, get_format
from megacoat.ops.cast_transpose import amax_scale, cast_transpose

_generation = 0  # bumped by invalidate_fp8_weight_caches(); every cache compares it with its own


def invalidate_fp8_weight_caches() -> None:
    """Mark every FP8 weight copy stale. Call after each optimizer step when weights are updated in a way
    autograd's version counter cannot see (DeepSpeed writes `param.data`, which keeps `_version`)."""
    global _generation
    _generation += 1


class Fp8WeightCache:
    """E4M3 copies of one weight, or of several concatenated along the output dim (w1|w3, wq|wk|wv) so that
    they run as one GEMM, in both layouts, with one per-tensor scale.

    Rebuilt when any weight's version counter or storage changes (in-place updates by torch optimizers bump
    `_version`), or after invalidate_fp8_weight_caches(). Micro-batches between two optimizer steps reuse it.
    """

    def __init__(self):
        self._key = None
        self.builds = 0  # how many times the copies were made (tests check the reuse)
        self.w8 = self.w8t = self.scale = None

    def get(self, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (_generation,) + tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)
        if key != self._key:
            with torch.no_grad():
                w = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
                self.scale = amax_scale(w, E4M3.dtype)
                self.w8, self.w8t = cast_transpose(w, self.scale, E4M3.dtype)
            self._key = key
            self.builds += 1
        return self.w8, self.w8t, self.scale


def check_gemm_dims(**dims: int) -> None:
    for name, n in dims.items():
        if n % 16:
            raise ValueError(f"FP8 GEMM needs {name} to be a multiple of 16 (torch._scaled_mm / cuBLASLt "
                             f"alignment), got {n}")


def scaled_mm(a8, b8_colmajor, scale_a, scale_b, out_dtype) -> torch.Tensor:
    return torch._scaled_mm(a8, b8_colmajor, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def quantize_grad(g: torch.Tensor, grad_dtype: torch.dtype):
    """Output gradient → (g8 [M, N], g8^T [N, M], scale), one read of g after its amax."""
    scale = amax_scale(g, grad_dtype)
    g8, g8t = cast_transpose(g, scale, grad_dtype)
    return g8, g8t, scale


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ W^T in FP8. x [M, K] in the activation dtype; returns [M, N] in the same dtype."""

    @staticmethod
    def forward(ctx, x, weight, cache, grad_dtype):
        w8, w8t, w_scale = (cache or Fp8WeightCache()).get((weight,))
        x_scale = amax_scale(x, E4M3.dtype)
        x8, x8t = cast_transpose(x, x_scale, E4M3.dtype, transpose=weight.requires_grad)
        out = scaled_mm(x8, w8.t(), x_scale, w_scale, x.dtype)
        ctx.save_for_backward(x8t, x_scale)  # FP8 input, transposed for wgrad: the only activation saved
        ctx.w8t, ctx.w_scale, ctx.grad_dtype, ctx.w_dtype = w8t, w_scale, grad_dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x8t, x_scale = ctx.saved_tensors
        g8, g8t, g_scale = quantize_grad(grad_out.contiguous(), ctx.grad_dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(g8, ctx.w8t.t(), g_scale, ctx.w_scale, grad_out.dtype)
        if ctx.needs_input_grad[1]:
            dw = scaled_mm(g8t, x8t.t(), g_scale, x_scale, ctx.w_dtype)
        return dx, dw, None, None


@torch.compiler.disable  # runs its own Triton kernels; torch.compile graph-breaks around it
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache | None = None,
               grad_dtype: str | torch.dtype = "e5m2") -> torch.Tensor:
    """FP8 x @ weight^T over any leading dims. `cache` keeps the weight's FP8 copies across micro-batches
    (None: quantize the weight on every call). A tensor-parallel layer passes its shard."""
    lead = x.shape[:-1]
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        check_gemm_dims(tokens_per_micro_batch=lead.numel())  # wgrad contracts over the tokens
    out = Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, cache, get_format(grad_dtype).dtype)
    return out.view(*lead, weight.shape[0])


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) whose GEMMs run in FP8; built from an existing nn.Linear, sharing its Parameter
    so checkpoints and the optimizer see the same `weight`."""

    def __init__(self, in_features: int, out_features: int, grad_dtype: str = "e5m2", device=None, dtype=None):
        check_gemm_dims(in_features=in_features, out_features=out_features)
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.grad_dtype = get_format(grad_dtype).name
        self.fp8_cache = Fp8WeightCache()

    @classmethod
    def from_linear(cls, linear: nn.Linear, grad_dtype: str = "e5m2") -> "Fp8Linear":
        if linear.bias is not None:
            raise ValueError("Fp8Linear supports bias-free linears only (the model has no biases)")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        check_gemm_dims(in_features=linear.in_features, out_features=linear.out_features)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", None)
        new.grad_dtype = get_format(grad_dtype).name
        new.fp8_cache = Fp8WeightCache()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.fp8_cache, self.grad_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=e4m3, grad={self.grad_dtype}"
