"""FP8 linear layer: E4M3 input and weight with per-tensor scales, GEMMs by torch._scaled_mm (fp32 accumulate),
and backward dgrad/wgrad GEMMs in FP8 with the output gradient in E5M2 (or E4M3).

`fp8_linear(x, weight, cache, grad_dtype)` is a plain function over tensors, so tensor-parallel layers can call
it on their shards; `Fp8Linear` is the nn.Linear that `convert_to_coat` swaps in (same parameter, `weight`).

Layouts. _scaled_mm multiplies row-major A [M, K] by column-major B [K, N]:
    forward  y  = x  @ W^T : A = x8 [M, K],  B = W8.t()   (W8 [N, K] row-major)
    dgrad    dx = g  @ W   : A = g8 [M, N],  B = W8t.t()  (W8t [K, N], the weight's FP8 transpose)
    wgrad    dW = g^T @ x  : A = g8t [N, M], B = x8t.t()  (x8t [K, M], saved: the only activation kept)
so each operand is cast once into both layouts it needs (ops.cast_transpose). An input that its producer saves
for its own backward anyway (attention's output, wo's input) is saved as it is instead, and x8t made again from
it in backward with the forward's scale (save_input): the same bytes, one FP8 copy less to keep. All of N, K
and, for backward, M (tokens per micro-batch) must be multiples of 16: cuBLASLt's FP8 kernels need 16-byte
aligned leading dimensions. Shapes that break this get a ValueError naming the dimension (no silent fallback to
BF16).

The weight's FP8 copies are made once per optimizer step and reused by every micro-batch: see Fp8WeightCache
and refresh_fp8_weights (in place, so compiled forwards read them without a Python check).
Linears that read the very same input tensor (wq, wk, wv; w1, w3) quantize it once: see Fp8InputCache.
Only tensors and constants cross the autograd function, so torch.compile traces fp8_linear with no graph break.

No host sync anywhere (scales stay on the device; tests/coat/test_no_host_sync.py checks it), and per GEMM
operand two launches (amax, fused cast+transpose that also writes the scale): see ops/cast_transpose.py.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import nn

from megacoat.coat.delayed_scaling import DelayedScale, history_for_call
from megacoat.coat.recipe import DEFAULT_WEIGHT_CACHE, WEIGHT_CACHES
from megacoat.ops import fp8_gemm
from megacoat.ops.cast_transpose import (cast_from_amax, cast_transpose, cast_transpose_delayed, quantize_transpose,
                                         quantize_transpose_into, transpose_fp8)
from megacoat.ops.formats import E4M3, get_format

_generation = 0  # bumped by invalidate_fp8_weight_caches(); every cache compares it with its own


def invalidate_fp8_weight_caches() -> None:
    """Mark every FP8 weight copy stale for eager forwards. Call after each optimizer step when weights are updated
    in a way autograd's version counter cannot see (DeepSpeed writes `param.data`, which keeps `_version`).
    Compiled forwards do not check staleness: they need refresh_fp8_weights(model)."""
    global _generation
    _generation += 1


def refresh_fp8_weights(model: nn.Module) -> int:
    """Re-quantize every persistent FP8 weight copy in `model` from its current weights, in place (the copies stay
    the same tensors, so compiled graphs keep reading them and a CUDA graph's addresses stay valid). The trainer
    calls it after each optimizer step and after loading a checkpoint: a compiled forward only reads the copies
    (the staleness check is Python, outside any graph). Returns how many caches were refreshed."""
    n = 0
    for cache, weights in persistent_weight_caches(model):
        cache.refresh(weights)
        n += 1
    return n


def persistent_weight_caches(model: nn.Module):
    """(cache, weights) of every FP8 weight cache in `model` that keeps its copies between optimizer steps."""
    for module in model.modules():
        pairs = module.fp8_weight_caches() if hasattr(module, "fp8_weight_caches") else ()
        yield from ((cache, weights) for cache, weights in pairs if cache.persistent)


def _weights_key(weights: Sequence[torch.Tensor]) -> tuple:
    return (_generation,) + tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)


class Fp8WeightCache:
    """E4M3 copies of one weight, or of several concatenated along the output dim (w1|w3, wq|wk|wv) so that
    they run as one GEMM, in both layouts, with one per-tensor scale.

    policy step (--fp8-weight-cache): both copies are kept from one optimizer step to the next, so micro-batches
    between two steps reuse them. Costs 2 bytes per block-linear parameter for the whole run. `refresh` rewrites
    them in place.
    rowwise (the default): only W8 is kept (1 byte per parameter); `get` hands out W8^T as a transposed view of it,
    which backward makes contiguous (fp8_weight_t): one FP8 transpose per backward GEMM, and exactly step's bytes
    (both layouts are casts of the same values with the same scale), so training is bit for bit the same.
    An eager forward refreshes the kept copies itself when a weight's version counter or storage changed
    (in-place updates by torch optimizers bump `_version`) or after invalidate_fp8_weight_caches(); a compiled
    forward only reads them (refresh_fp8_weights before it).
    none (not persistent): forward makes W8 and drops it after its GEMM, and backward makes
    W8^T again from the weight (fp8_weight_t): nothing is kept, for three more reads of the weight per micro-batch;
    compiled, these quantizations are part of the graph.
    """

    def __init__(self, policy: str = DEFAULT_WEIGHT_CACHE):
        if policy not in WEIGHT_CACHES:
            raise ValueError(f"FP8 weight cache policy must be one of {WEIGHT_CACHES}, got {policy!r}")
        self.policy = policy
        self.persistent, self.transposed = policy != "none", policy == "step"
        self._key = None
        self.builds = 0  # how many times the copies were made (tests check the reuse)
        self.w8 = self.w8t = self.scale = None

    def refresh(self, weights: Sequence[torch.Tensor]) -> None:
        """Quantize `weights` (joined along the output dim) into the copies: in place when copies of that shape and
        device exist, so every refresh after the first writes the same tensors."""
        parts = [w.detach() for w in weights]
        shape, device = (sum(w.shape[0] for w in parts), parts[0].shape[1]), parts[0].device
        if self.w8 is None or self.w8.shape != shape or self.w8.device != device:
            self.w8 = torch.empty(shape, dtype=E4M3.dtype, device=device)
            self.w8t = torch.empty(shape[::-1], dtype=E4M3.dtype, device=device) if self.transposed else None
            self.scale = torch.empty(1, dtype=torch.float32, device=device)
            for t in (self.w8, self.w8t, self.scale):  # fixed addresses: a CUDA graph reads them in place
                if t is not None:
                    torch._dynamo.mark_static_address(t)
        with torch.no_grad():  # straight into the copies: no joined weight, no copy of the results
            quantize_transpose_into(parts, self.w8, self.w8t, self.scale)
        self._key = _weights_key(weights)
        self.builds += 1

    def get(self, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(W8, W8^T, scale); W8^T is a transposed view of W8 under policy rowwise, and None when the cache is not
        persistent (backward calls fp8_weight_t)."""
        compiling = torch.compiler.is_compiling()
        if not self.persistent:
            gathered = gathered_fp8(weights)
            if gathered is not None:
                return gathered[0], None, gathered[1]
            if not compiling:
                self.builds += 1
            with torch.no_grad():
                w8, _, scale = quantize_transpose(_joined(weights), E4M3.dtype, rowwise=True, transpose=False)
            return w8, None, scale
        if compiling:
            if self.w8 is None:
                raise RuntimeError("a compiled FP8 forward reads the FP8 weight copies: call "
                                   "megacoat.coat.linear.refresh_fp8_weights(model) before it")
        elif _weights_key(weights) != self._key:
            self.refresh(weights)
        return self.w8, (self.w8t if self.transposed else self.w8.t()), self.scale


def gathered_fp8(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(W8 joined along the output dim, scale) when every weight carries the whole FP8 copy that ZeRO-3's FP8
    all-gather left on it (`fp8_gathered`: its codes and the scale the joined weights share,
    megacoat.training.zero3_fp8_gather); None otherwise (quantize the weights themselves)."""
    copies = [getattr(w, "fp8_gathered", None) for w in weights]
    if not copies or any(c is None for c in copies):
        return None
    w8 = copies[0][0] if len(copies) == 1 else torch.cat([c[0].view(torch.uint8) for c in copies]).view(E4M3.dtype)
    return w8, copies[0][1]


def _joined(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    return weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])


def fp8_weight_t(w8t: torch.Tensor | None, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Backward's FP8 W^T, contiguous (the layout _scaled_mm reads): the cached copy; the byte transpose of the
    cached W8 (policy rowwise: w8t is its transposed view); or (non-persistent cache) made again from the weights,
    which have not changed since forward: the same amax, hence the same scale and bytes as a cached copy."""
    if w8t is not None:
        return w8t if w8t.is_contiguous() else transpose_fp8(w8t.t())
    gathered = gathered_fp8(weights)
    if gathered is not None:  # the codes forward read, gathered again for backward
        return transpose_fp8(gathered[0])
    with torch.no_grad():
        return quantize_transpose(_joined(weights), E4M3.dtype, rowwise=False, transpose=True)[1]


class Fp8InputCache:
    """The E4M3 copy (x8, x8^T, scale) of the last input quantized, shared by the linears of a block: wq, wk
    and wv read one tensor, w1 and w3 another, so each is quantized once (two launches and a read of x saved
    per sharing linear) and its FP8 transpose is saved for backward once instead of three or two times.

    A hit needs the very same tensor object at the same version counter (in-place ops bump it; writes through
    `.data` do not, and no forward does that between two sibling linears). The copies are dropped when the
    input dies, so the cache never keeps a micro-batch's activations alive.

    Under torch.compile the weakref and version checks cannot be traced: a hit is then the same tensor of the
    graph being traced (`is`), and the block's forward hook `clear` (convert_to_coat registers it) drops the entry
    at the end of the block, so nothing traced outlives the block's forward (Inductor does not merge the siblings'
    quantizations by itself: their amax reductions and casts stay separate launches).
    """

    def __init__(self):
        self._ref = self._version = self._value = None
        self._traced_x = self._traced_value = None
        self.hits = 0  # how many quantizations were saved (tests check the sharing)

    def __getstate__(self):  # copies and pickles start empty: the cached tensors belong to one forward
        return {"hits": self.hits}

    def __setstate__(self, state) -> None:
        self.__init__()
        self.hits = state["hits"]

    def _forget(self, ref) -> None:
        if ref is self._ref:
            self._ref = self._value = None

    def clear(self, *hook_args) -> None:
        """Forget the traced entry (a forward hook of the block: called with (module, inputs, output))."""
        self._traced_x = self._traced_value = None

    def _get_traced(self, x: torch.Tensor, transpose: bool):
        if self._traced_x is x and (self._traced_value[1] is not None or not transpose):
            return self._traced_value
        self._traced_x, self._traced_value = x, quantize_x(x, transpose)
        return self._traced_value

    def get(self, x: torch.Tensor, transpose: bool):
        if torch.compiler.is_compiling():
            return self._get_traced(x, transpose)
        if x.is_inference():  # inference tensors have no version counter: nothing to key a hit on
            return quantize_x(x, transpose)
        if self._ref is not None and self._ref() is x and x._version == self._version \
                and (self._value[1] is not None or not transpose):
            self.hits += 1
            return self._value
        self._value = quantize_x(x, transpose)
        self._ref, self._version = weakref.ref(x, self._forget), x._version
        return self._value


def quantize_x(x: torch.Tensor, transpose: bool, history: torch.Tensor | None = None, bootstrap: bool = False):
    """A linear's input [..., K] → (x8 [M, K], x8^T [K, M] or None, scale), E4M3. history: a delayed site's
    (delayed_scaling.history_for_call), whose scale the cast takes and which it rolls with x's amax, in one launch."""
    x = x.detach().reshape(-1, x.shape[-1])
    if history is None:
        return quantize_transpose(x, E4M3.dtype, transpose=transpose)
    return cast_transpose_delayed(x, history, E4M3.dtype, transpose=transpose, bootstrap=bootstrap)


def check_gemm_dims(**dims: int) -> None:
    for name, n in dims.items():
        if n % 16:
            raise ValueError(f"FP8 GEMM needs {name} to be a multiple of 16 (torch._scaled_mm / cuBLASLt "
                             f"alignment), got {n}")


def scaled_mm(a8, b8_colmajor, scale_a, scale_b, out_dtype, fast_accum: bool = False) -> torch.Tensor:
    """fast_accum: cuBLASLt's FP8 accumulation without the periodic fp32 promotion (about 14 accumulated mantissa
    bits instead of 23); only CoatRecipe.fast_accum's forward GEMMs ask for it."""
    return fp8_gemm.scaled_mm(a8, b8_colmajor, scale_a, scale_b, out_dtype, fast_accum)


def quantize_grad(g: torch.Tensor, grad_dtype: torch.dtype, rowwise: bool = True, transpose: bool = True,
                  amax: torch.Tensor | None = None):
    """Output gradient → (g8 [M, N] for dgrad, g8^T [N, M] for wgrad, scale): its amax, then one read of g.
    A layout nobody needs (frozen weight, or an input without grad) is not written. amax: g's, folded into the
    kernel that wrote g (see Fp8LinearFunction's carrier): the cast alone."""
    if amax is not None:
        return cast_from_amax(g, amax, grad_dtype, rowwise, transpose)
    return quantize_transpose(g, grad_dtype, rowwise, transpose)


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ W^T in FP8. x [M, K] in the activation dtype; x8s = (x8, x8t, x_scale) its FP8 copies and
    w8s = (w8, w8t, w_scale) the weight's, made by the caller (x's possibly shared with sibling linears, W's cached;
    w8t None: made again from `weight` in backward); returns [M, N] in x's dtype. Only tensors, tuples of them and
    constants cross apply(), so torch.compile traces forward and backward into its graphs.

    carry_amax: also return a carrier, a float32 [1] tensor whose gradient is y's gradient's amax. The one consumer
    of y that writes y's gradient in a kernel of its own (the COAT block's MLP norm, whose backward kernel makes
    dh) passes the carrier in and returns that amax, folded into its kernel, as the carrier's gradient; backward
    then casts grad_out in one launch instead of two. Its bytes are the same: a max in any order is the same max.
    A carrier that receives no gradient (None: unused) leaves the amax to this backward.

    save_input: x itself is saved (x8t None), and backward casts it again with x_scale into x8t: the forward's
    codes, as one cast of the same values with the same scale gives (fp8_linear's save_input)."""

    @staticmethod
    def forward(ctx, x, weight, w8s, x8s, grad_dtype, fast_accum, carry_amax=False, save_input=False):
        (w8, w8t, w_scale), (x8, x8t, x_scale) = w8s, x8s
        out = scaled_mm(x8, w8.t(), x_scale, w_scale, x.dtype, fast_accum)
        # the FP8 input transposed for wgrad (the only activation saved), or x, which its producer keeps anyway
        ctx.save_for_backward(x if save_input else x8t, x_scale)
        Fp8LinearFunction.save_weight(ctx, weight, w8t, w_scale, grad_dtype, save_input)
        if not carry_amax:
            return out
        ctx.set_materialize_grads(False)  # an unused carrier must arrive as None, not as a zero amax
        return out, x.new_zeros(1, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out, grad_amax=None):
        if grad_out is None:  # (with a carrier) y unused
            return (None,) * 8
        x8t, x_scale = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        g8, g8t, g_scale = quantize_grad(grad_out, ctx.grad_dtype, rowwise=need_dx, transpose=need_dw,
                                         amax=grad_amax)
        return (*fp8_linear_grads(ctx, g8, g8t, g_scale, x8t, x_scale, grad_out.dtype), *(None,) * 6)

    @staticmethod
    def save_weight(ctx, weight, w8t, w_scale, grad_dtype, save_input=False) -> None:
        """What fp8_linear_grads reads from ctx besides the saved input: the weight's FP8 transpose (or the weight,
        to make it again), its scale and dtype, the gradient's FP8 dtype."""
        ctx.save_input = save_input
        ctx.w8t, ctx.w_scale, ctx.grad_dtype, ctx.w_dtype = w8t, w_scale, grad_dtype, weight.dtype
        ctx.weights = (weight,) if w8t is None else None  # to remake W8^T in backward (no persistent cache)


def fp8_linear_grads(ctx, g8, g8t, g_scale, x8t, x_scale, dx_dtype: torch.dtype):
    """(dx, dw) of an FP8 linear from its output gradient's codes (g8 for dgrad, g8t for wgrad; None: that
    gradient is not needed), given what its forward saved: x8t (or x itself, ctx.save_input) with x_scale, and
    Fp8LinearFunction.save_weight's attributes of ctx."""
    dx = dw = None
    if g8 is not None:
        w8t = fp8_weight_t(ctx.w8t, ctx.weights)
        dx = scaled_mm(g8, w8t.t(), g_scale, ctx.w_scale, dx_dtype)
    if g8t is not None:
        if ctx.save_input:  # x8t is x here; cast after g's cast, so that a compiled graph casts in backward
            x8t = cast_transpose(x8t, x_scale, E4M3.dtype, rowwise=False, transpose=True, after=g_scale)[1]
        dw = scaled_mm(g8t, x8t.t(), g_scale, x_scale, ctx.w_dtype)
    return dx, dw


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache | None = None,
               grad_dtype: str | torch.dtype = "e5m2", input_cache: Fp8InputCache | None = None,
               fast_accum: bool = False, carry_amax: bool = False, input_scale: DelayedScale | None = None,
               save_input: bool = False):
    """FP8 x @ weight^T over any leading dims. `cache` keeps the weight's FP8 copies across micro-batches
    (None: quantize the weight on every call); `input_cache` shares x's FP8 copy with sibling linears that
    read the same x (None: quantize x here); `fast_accum`: the forward GEMM's (CoatRecipe.fast_accum). A
    tensor-parallel layer passes its shard. carry_amax: → (y, carrier), see Fp8LinearFunction. input_scale: x
    cast with delayed scaling from that site's history in a forward with gradients (without: current scaling,
    and the history left alone, as every delayed site does in evaluation). save_input: keep x itself for backward
    instead of its FP8 transpose, which backward casts again from x with the forward's scale (the same bytes). For
    an x that its producer saves for backward anyway (attention's output): then this linear keeps nothing of its
    own, 1 byte per element less, for one more read of x in backward (elsewhere it would keep 2 bytes, not 1)."""
    if input_scale is not None and input_cache is not None:
        raise ValueError("fp8_linear: input_scale and input_cache are two ways to quantize x; pass one")
    if save_input and input_cache is not None:
        raise ValueError("fp8_linear: save_input keeps x, input_cache shares x's FP8 copies with siblings; pass one")
    lead = x.shape[:-1]
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if grad:
        check_gemm_dims(tokens_per_micro_batch=lead.numel())  # wgrad contracts over the tokens
    save_input = save_input and grad and weight.requires_grad
    transpose = grad and weight.requires_grad and not save_input  # x^T only feeds wgrad (save_input: made there)
    if input_cache is not None:
        x8s = input_cache.get(x, transpose)
    else:
        x8s = quantize_x(x, transpose, *history_for_call(input_scale, grad))
    if cache is None:  # no cache: both layouts made here, for this call only
        with torch.no_grad():
            w8s = quantize_transpose(weight.detach(), E4M3.dtype)
    else:
        w8s = cache.get((weight,))
    out = Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, w8s, x8s, get_format(grad_dtype).dtype,
                                  fast_accum, carry_amax, save_input)
    if carry_amax:
        return out[0].view(*lead, weight.shape[0]), out[1]
    return out.view(*lead, weight.shape[0])


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) whose GEMMs run in FP8, made from an existing nn.Linear whose Parameter it shares,
    so checkpoints and the optimizer see the same `weight`. `input_cache`: one Fp8InputCache given to every
    linear of a block lets siblings that read the same input share its FP8 copy. save_input: the input's producer
    saves it for backward anyway, so keep it rather than an FP8 copy (fp8_linear's save_input)."""

    def __init__(self, linear: nn.Linear, grad_dtype: str = "e5m2", input_cache: Fp8InputCache | None = None,
                 weight_cache: str = DEFAULT_WEIGHT_CACHE, fast_accum: bool = False, save_input: bool = False):
        if linear.bias is not None:
            raise ValueError("Fp8Linear supports bias-free linears only (the model has no biases)")
        check_gemm_dims(in_features=linear.in_features, out_features=linear.out_features)
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight of its own
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", None)
        self.grad_dtype = get_format(grad_dtype).name
        self.fp8_cache = Fp8WeightCache(weight_cache)
        self.input_cache = input_cache
        self.fast_accum, self.save_input = fast_accum, save_input

    def forward(self, x: torch.Tensor, carry_amax: bool = False, input_scale: DelayedScale | None = None):
        """carry_amax: → (y, carrier), see Fp8LinearFunction; input_scale: x's delayed-scaling site (fp8_linear)."""
        return fp8_linear(x, self.weight, self.fp8_cache, self.grad_dtype, self.input_cache, self.fast_accum,
                          carry_amax, input_scale, self.save_input)

    def fp8_weight_caches(self):
        """(cache, weights) pairs for refresh_fp8_weights."""
        return ((self.fp8_cache, (self.weight,)),)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8=e4m3, grad={self.grad_dtype}" + (", fast_accum" if self.fast_accum else "")
                + (", save_input" if self.save_input else ""))
