"""COAT's precision flow: the transformer block whose activations and gradients pass between layers in FP8.

`CoatTransformerBlock` adopts the plain block's submodules (parameter names and objects unchanged) and runs
    h   = x + wo(SDPA(q, k, v))   with q, k, v = coat_norm_qkv(x): RMSNorm, the [q|k|v] GEMM, RoPE of q and k
    out = h + coat_mlp(h)         coat_mlp: RMSNorm, the w1|w3 GEMM, SwiGLU, the w2 GEMM
Inside both fused functions the norm and SwiGLU read E4M3 with 1xG group scales (megacoat.coat.group_scaling)
and write E4M3 with a per-tensor scale that the next GEMM consumes; only FP8 tensors are saved for backward
(the norm's input, SwiGLU's input pair), and the gradients between layers are FP8 too (E5M2 by default).
On one rank the norms' kernels make the residual additions and take the residual branches' gradients, and
`CoatLayers` defers each block's output addition to the next block's attention norm. Attention's core stays BF16.
The fused functions take their settings as one object (`FlowSettings`, constants) and their delayed-scaling state
as another (`FlowScales`: tensors and flags), which torch.compile traces with no graph break.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from megacoat.coat.delayed_scaling import DelayedScale, drop_saved_history, history_for_call
from megacoat.coat.linear import Fp8Linear, Fp8WeightCache, check_gemm_dims, fp8_weight_t, quantize_grad, scaled_mm
from megacoat.coat.recipe import CoatRecipe
from megacoat.coat.tensor_parallel import NO_REGION, RegionBlock
from megacoat.ops.attention import causal_attention
from megacoat.ops.formats import get_format
from megacoat.ops.rmsnorm import rmsnorm_fp8_bwd, rmsnorm_fp8_fwd, rmsnorm_fp8_fwd_delayed, rmsnorm_fp8_out
from megacoat.ops.rope import rope_rotate
from megacoat.ops.rope_grad_cast import rope_qkv_grad_fp8, rope_qkv_grad_fp8_delayed
from megacoat.ops.swiglu import swiglu_fp8_bwd_delayed, swiglu_fp8_bwd_out_t, swiglu_fp8_fwd, swiglu_fp8_fwd_delayed


@dataclass(frozen=True)
class FlowSettings:
    """The constants of one fused function: its norm's eps, the 1xG group size, the FP8 dtype of the output
    gradients, and fast accumulation in the forward GEMMs (CoatRecipe.fast_accum)."""
    eps: float
    group_size: int
    grad_dtype: torch.dtype = torch.float8_e5m2
    fast_accum: bool = False


class CastScale(NamedTuple):
    """One cast site's delayed scaling for one call: its amax history and whether this call scales by its own amax
    (delayed_scaling.history_for_call); history None: current scaling."""
    history: torch.Tensor | None = None
    bootstrap: bool = False


CURRENT = CastScale()


class FlowScales(NamedTuple):
    """One call's scaling at a fused function's cast sites: its norm's FP8 output, SwiGLU's (coat_mlp's only) and the
    output gradient it casts (SwiGLU's or the [q|k|v] output's)."""
    norm_out: CastScale = CURRENT
    swiglu_out: CastScale = CURRENT
    grad: CastScale = CURRENT


class FlowSites(NamedTuple):
    """A fused function's delayed-scaling sites, as FlowScales' (None: current scaling at that site)."""
    norm_out: DelayedScale | None = None
    swiglu_out: DelayedScale | None = None
    grad: DelayedScale | None = None

    def for_call(self, grad: bool) -> FlowScales:
        """The scales of one forward (grad: with gradients; without, every site scales just in time)."""
        return FlowScales(CastScale(*history_for_call(self.norm_out, grad)),
                          CastScale(*history_for_call(self.swiglu_out, grad)),
                          CastScale(*history_for_call(self.grad, grad)))


CURRENT_SITES = FlowSites()


def _split_rows(t: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    return tuple(t.split(sizes, dim=0))


def _norm_fwd(x, weight, flow: FlowSettings, scale: CastScale, add=None):
    """→ (x8, xs, rstd, y_scale, y8): RMSNorm's saved FP8 input and its FP8 output for the next GEMM. Current
    scaling: two launches; delayed scaling from scale's amax history: one. add: the norm of h = x + add, made in
    the norm's first launch, and h last."""
    if scale.history is None:
        return rmsnorm_fp8_fwd(x, weight, flow.eps, flow.group_size, add=add)
    return rmsnorm_fp8_fwd_delayed(x, weight, scale.history, flow.eps, flow.group_size, bootstrap=scale.bootstrap,
                                   add=add)


def _swiglu_fwd(a13, group_size: int, scale: CastScale):
    """→ (a1_8, s1, a3_8, s3, s_scale, s8): SwiGLU's saved FP8 pair and its FP8 output, as _norm_fwd."""
    if scale.history is None:
        return swiglu_fp8_fwd(a13, group_size)
    return swiglu_fp8_fwd_delayed(a13, scale.history, group_size, bootstrap=scale.bootstrap)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, t.shape[-1])


class CoatNormQKVFunction(torch.autograd.Function):
    """[q|k|v] = RMSNorm(x) @ cat(wq, wk, wv)^T with the normed x in FP8, then q and k rotated (RoPE); x [batch, seq,
    H] → q, k, v [batch, seq, heads, head_dim], each contiguous: v has a GEMM of its own (a view of a joined output
    would keep all of it alive as attention's saved v, and a copy costs a pass). w8s: the joined weight's FP8
    copies (Fp8WeightCache.get); rope: (cos, sin), [seq, head_dim / 2].

    residual: x is also returned, as rows [M, H] (M = batch x seq), for the block's residual branch to read; the
    gradient that branch sends back is then added to x's in the norm's backward kernel, instead of by autograd in a
    pass of its own (one read and one write of [M, H] less per block, and dx is rounded to BF16 once, not twice).
    add, add_carrier (with residual): as CoatMLPFunction's, for the previous block's residual addition (its
    output h + out made here, and the amax of its gradient carried back to that block's w2)."""

    @staticmethod
    def forward(ctx, x, norm_weight, wq, wk, wv, add, add_carrier, w8s, rope, flow: FlowSettings, scales: FlowScales,
                residual: bool):
        w8, w8t, w_scale = w8s
        cos, sin = rope
        rows = _rows(x)
        x8, xs, rstd, y_scale, y8, *h = _norm_fwd(rows, norm_weight, flow, scales.norm_out, _rows(add))
        ctx.has_add, ctx.carry = add is not None, add_carrier is not None
        sizes = [w.shape[0] for w in (wq, wk, wv)]
        # two GEMMs over row slices of the joined W8 (one scale): v is born contiguous, as attention saves it,
        # instead of copied out of a joined [M, 3H] output; q and k are rotated out of theirs into new tensors
        nqk, batch, head_dim = sizes[0] + sizes[1], x.shape[0], 2 * cos.shape[-1]
        qk = scaled_mm(y8, w8[:nqk].t(), y_scale, w_scale, x.dtype, flow.fast_accum)
        v = scaled_mm(y8, w8[nqk:].t(), y_scale, w_scale, x.dtype, flow.fast_accum)
        q, k = (t.view(batch, -1, n // head_dim, head_dim) for t, n in zip(qk.split(sizes[:2], dim=1), sizes))
        q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
        v = v.view(batch, -1, sizes[2] // head_dim, head_dim)
        ctx.save_for_backward(x8, xs, rstd, y_scale, norm_weight)
        ctx.w8t, ctx.w_scale, ctx.flow, ctx.grad_scale = w8t, w_scale, flow, scales.grad  # the history: state
        ctx.rope = rope  # constants of the model, not activations
        ctx.sizes, ctx.w_dtype, ctx.x_shape = sizes, wq.dtype, x.shape
        ctx.weights = (wq, wk, wv) if w8t is None else None  # to remake W8^T in backward (no persistent cache)
        return (q, k, v, h[0] if h else rows.view_as(rows)) if residual else (q, k, v)

    @staticmethod
    def backward(ctx, dq, dk, dv, dres=None):
        x8, xs, rstd, y_scale, norm_weight = ctx.saved_tensors
        flow, grad_scale = ctx.flow, ctx.grad_scale
        dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
        if grad_scale.history is None:
            g8, g8t, g_scale = rope_qkv_grad_fp8(dq, dk, dv, *ctx.rope, flow.grad_dtype)
        else:  # delayed scaling: RoPE's pass writes the FP8 gradient itself, the history rolled
            g8, g8t, g_scale = rope_qkv_grad_fp8_delayed(dq, dk, dv, *ctx.rope, flow.grad_dtype, grad_scale.history,
                                                         bootstrap=grad_scale.bootstrap)
        w8t = fp8_weight_t(ctx.w8t, ctx.weights)
        dy = scaled_mm(g8, w8t.t(), g_scale, ctx.w_scale, dq.dtype)
        y8t = rmsnorm_fp8_out(x8, xs, rstd, norm_weight, y_scale, flow.group_size, transpose=True)
        dw = scaled_mm(g8t, y8t.t(), g_scale, y_scale, ctx.w_dtype)
        dx, dnorm, *amax = rmsnorm_fp8_bwd(dy, x8, xs, rstd, norm_weight, flow.group_size, residual_grad=dres,
                                           dx_amax=ctx.carry)
        dx = dx.view(ctx.x_shape)
        return (dx, dnorm.to(norm_weight.dtype), *_split_rows(dw, ctx.sizes), dx if ctx.has_add else None,
                amax[0] if ctx.carry else None, None, None, None, None, None)


class CoatMLPFunction(torch.autograd.Function):
    """w2(silu(w1 n) * w3 n) with n = RMSNorm(x), all in the FP8 flow; x [M, H] → [M, H]. w8s: the FP8 copies of
    w1|w3 and of w2, ((W8, W8^T, scale), (W8, W8^T, scale)) as Fp8WeightCache.get gives them.

    residual: x is also returned (a view) for the block's residual branch, whose gradient is then added to x's in
    the norm's backward kernel (as CoatNormQKVFunction's). add (with residual): the input is h = x + add, the
    block's residual addition, made by the norm's forward kernel; h is returned instead of x, and x and add both
    receive h's gradient. add_carrier (with add): the carrier of add's producer (Fp8LinearFunction, carry_amax),
    whose gradient is returned as h's gradient's amax, folded into the norm's backward kernel.
    carry_amax: also return a carrier for out (Fp8LinearFunction's, for w2): the consumer of out that writes its
    gradient in a kernel of its own (the next block's attention norm, given out as its add) returns that gradient's
    amax as the carrier's gradient, and backward casts grad_out from it instead of reducing it once more."""

    @staticmethod
    def forward(ctx, x, norm_weight, w1, w3, w2, add, add_carrier, w8s, flow: FlowSettings, scales: FlowScales,
                residual: bool, carry_amax: bool):
        (w13_8, w13_8t, w13_scale), (w2_8, w2_8t, w2_scale) = w8s
        x8, xs, rstd, y_scale, y8, *h = _norm_fwd(x, norm_weight, flow, scales.norm_out, add)
        ctx.has_add, ctx.carry = add is not None, add_carrier is not None
        a13 = scaled_mm(y8, w13_8.t(), y_scale, w13_scale, x.dtype, flow.fast_accum)  # [M, 2F]: gate | up
        a1_8, s1, a3_8, s3, s_scale, s8 = _swiglu_fwd(a13, flow.group_size, scales.swiglu_out)
        del a13  # the BF16 GEMM output dies here; backward keeps its FP8 copy
        out = scaled_mm(s8, w2_8.t(), s_scale, w2_scale, x.dtype, flow.fast_accum)
        ctx.save_for_backward(x8, xs, rstd, y_scale, a1_8, s1, a3_8, s3, s_scale, norm_weight)
        ctx.w13_8t, ctx.w13_scale, ctx.w2_8t, ctx.w2_scale = w13_8t, w13_scale, w2_8t, w2_scale
        ctx.w13 = (w1, w3) if w13_8t is None else None  # to remake W8^T in backward (no persistent cache)
        ctx.w2 = (w2,) if w2_8t is None else None
        ctx.flow, ctx.grad_scale = flow, scales.grad  # the history: state (written by backward), not an activation
        ctx.w_dtype, ctx.ffn = w1.dtype, w1.shape[0]
        outs = (out, h[0] if h else x.view_as(x)) if residual else (out,)  # h: a new tensor, x: an input (a view)
        ctx.residual, ctx.carry_out = residual, carry_amax
        if not carry_amax:
            return outs if residual else out
        ctx.set_materialize_grads(False)  # an unused carrier must arrive as None, not as a zero amax
        ctx.out_meta = (out.shape, out.dtype)
        return *outs, x.new_zeros(1, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out, *rest):
        dres = rest[0] if ctx.residual else None
        grad_amax = rest[-1] if ctx.carry_out else None
        x8, xs, rstd, y_scale, a1_8, s1, a3_8, s3, s_scale, norm_weight = ctx.saved_tensors
        if grad_out is None:  # (with a carrier, no gradient materialized) out unused: a zero gradient
            grad_out, grad_amax = torch.zeros(ctx.out_meta[0], dtype=ctx.out_meta[1], device=x8.device), None
        flow, grad_scale, g = ctx.flow, ctx.grad_scale, ctx.flow.group_size
        g8, g8t, g_scale = quantize_grad(grad_out, flow.grad_dtype, amax=grad_amax)
        w2_8t = fp8_weight_t(ctx.w2_8t, ctx.w2)
        ds = scaled_mm(g8, w2_8t.t(), g_scale, ctx.w2_scale, grad_out.dtype)  # [M, F]
        del w2_8t
        # SwiGLU's backward also remakes s^T (w2's wgrad operand) from the pair it reads anyway
        if grad_scale.history is None:
            da8, da8t, da_scale, s8t = swiglu_fp8_bwd_out_t(ds, a1_8, s1, a3_8, s3, s_scale, g, flow.grad_dtype)
        else:  # delayed scaling (megacoat.coat.delayed_scaling): one pass, the history rolled
            da8, da8t, da_scale, s8t = swiglu_fp8_bwd_delayed(ds, a1_8, s1, a3_8, s3, s_scale, grad_scale.history, g,
                                                              flow.grad_dtype, bootstrap=grad_scale.bootstrap)
        del ds
        dw2 = scaled_mm(g8t, s8t.t(), g_scale, s_scale, ctx.w_dtype)
        del g8, g8t, s8t
        w13_8t = fp8_weight_t(ctx.w13_8t, ctx.w13)
        dy = scaled_mm(da8, w13_8t.t(), da_scale, ctx.w13_scale, grad_out.dtype)  # [M, H]
        del w13_8t
        y8t = rmsnorm_fp8_out(x8, xs, rstd, norm_weight, y_scale, g, transpose=True)
        dw13 = scaled_mm(da8t, y8t.t(), da_scale, y_scale, ctx.w_dtype)
        dx, dnorm, *amax = rmsnorm_fp8_bwd(dy, x8, xs, rstd, norm_weight, g, residual_grad=dres, dx_amax=ctx.carry)
        dw1, dw3 = _split_rows(dw13, [ctx.ffn, ctx.ffn])
        return (dx, dnorm.to(norm_weight.dtype), dw1, dw3, dw2, dx if ctx.has_add else None,
                amax[0] if ctx.carry else None, None, None, None, None, None)


def coat_norm_qkv(x, norm_weight, weights, cache: Fp8WeightCache, flow: FlowSettings, cos: torch.Tensor,
                  sin: torch.Tensor, sites: FlowSites = CURRENT_SITES, residual: bool = False,
                  add: torch.Tensor | None = None, add_carrier: torch.Tensor | None = None):
    """x [batch, seq, H] → q, k, v [batch, seq, heads, head_dim] (q and k rotated); weights (wq, wk, wv); cos, sin
    [seq, head_dim / 2]. sites: the norm's FP8 output (norm_out) and the [q|k|v] output gradient (grad) with delayed
    scaling from those histories (None: current scaling).
    residual: also return x, for the residual branch (its gradient joins x's in the norm's backward kernel).
    add, add_carrier (with residual): the norm of h = x + add, made in the norm's kernel, and h returned instead
    of x; add's producer may pass its carrier (coat_mlp's carry_amax), as for coat_mlp."""
    _check_add(residual, add, add_carrier)
    grad = torch.is_grad_enabled()
    if grad:
        check_gemm_dims(tokens_per_micro_batch=x.shape[0] * x.shape[1])  # wgrad contracts over the tokens
    out = CoatNormQKVFunction.apply(x, norm_weight, *weights, add, add_carrier, cache.get(weights), (cos, sin), flow,
                                    sites.for_call(grad), residual)
    return (*out[:3], out[3].view(x.shape)) if residual else out


def _check_add(residual: bool, add, add_carrier) -> None:
    if add is not None and not residual:
        raise ValueError("add needs residual=True (h = x + add is returned for the residual branch)")
    if add_carrier is not None and add is None:
        raise ValueError("add_carrier needs add (it carries the amax of add's gradient)")


def coat_mlp(x, norm_weight, weights, caches: tuple[Fp8WeightCache, Fp8WeightCache], flow: FlowSettings,
             sites: FlowSites = CURRENT_SITES, residual: bool = False, add: torch.Tensor | None = None,
             add_carrier: torch.Tensor | None = None, carry_amax: bool = False):
    """x [..., H] → the MLP's output; weights (w1, w3, w2), caches: w1|w3's and w2's. sites: the norm's and SwiGLU's
    FP8 outputs and SwiGLU's gradient with delayed scaling from those histories (None: current scaling).
    residual: → (out, x), x for the residual branch (its gradient joins x's in the norm's backward kernel). add
    (with residual): the MLP of h = x + add, the addition made in the norm's forward kernel, → (out, h). add_carrier:
    the carrier of the FP8 linear that made add (fp8_linear's carry_amax), whose backward then receives h's
    gradient's amax from the norm's backward kernel; add must then have no other use (its gradient is exactly h's).
    carry_amax: also return out's carrier, last (see CoatMLPFunction); out must then be its consumer's add, with no
    other use."""
    _check_add(residual, add, add_carrier)
    grad = torch.is_grad_enabled()
    if grad:
        check_gemm_dims(tokens_per_micro_batch=x[..., 0].numel())
    w1, w3, w2 = weights
    cache13, cache2 = caches
    w8s = (cache13.get((w1, w3)), cache2.get((w2,)))
    out = CoatMLPFunction.apply(_rows(x), norm_weight, w1, w3, w2, _rows(add), add_carrier, w8s, flow,
                                sites.for_call(grad), residual, carry_amax)
    if not (residual or carry_amax):  # views made here: a view made inside the function could not be written in place
        return out.view(x.shape)
    return (*(t.view(x.shape) for t in out[:1 + residual]), *out[1 + residual:])


class CoatTransformerBlock(RegionBlock):
    def __init__(self, block: nn.Module, fp8: CoatRecipe):
        super().__init__()
        self.attention_norm = block.attention_norm
        self.attention = block.attention
        self.ffn_norm = block.ffn_norm
        self.feed_forward = block.feed_forward
        # wq/wk/wv and w1/w3/w2 stay nn.Linear: the fused functions read their weights, the modules never run.
        # wo's input is attention's output, which attention's flash / cuDNN / efficient kernels save for their own
        # backward: wo keeps it rather than an FP8 copy, and casts it again in backward (save_input)
        self.attention.wo = Fp8Linear(self.attention.wo, fp8.grad_dtype, weight_cache=fp8.weight_cache,
                                      fast_accum=fp8.fast_accum, save_input=True)
        constants = dict(group_size=fp8.group_size, grad_dtype=get_format(fp8.grad_dtype).dtype,
                         fast_accum=fp8.fast_accum)
        self.qkv_flow = FlowSettings(self.attention_norm.eps, **constants)
        self.mlp_flow = FlowSettings(self.ffn_norm.eps, **constants)
        self.qkv_cache, self.w13_cache, self.w2_cache = (Fp8WeightCache(fp8.weight_cache)
                                                         for _ in range(3))
        # delayed scaling sites (megacoat.coat.delayed_scaling): SwiGLU's and the [q|k|v] output's gradients; the two
        # norms' and SwiGLU's outputs, and wo's input (attention's output). Each a submodule of its own (checkpoints
        # name them so); qkv_sites and mlp_sites hand them to the fused functions
        sites = dict.fromkeys(("swiglu_grad_scale", "qkv_grad_scale"), fp8.grad_scaling == "delayed")
        sites.update(dict.fromkeys(("qkv_norm_out_scale", "mlp_norm_out_scale", "swiglu_out_scale", "wo_in_scale"),
                                   fp8.activation_scaling == "delayed"))
        for name, delayed in sites.items():
            setattr(self, name, DelayedScale(fp8.amax_history_len) if delayed else None)
            if not delayed:
                drop_saved_history(self, name)
        self.region = NO_REGION

    @property
    def group_size(self) -> int:
        return self.mlp_flow.group_size

    def qkv_sites(self) -> FlowSites:
        return FlowSites(norm_out=self.qkv_norm_out_scale, grad=self.qkv_grad_scale)

    def mlp_sites(self) -> FlowSites:
        return FlowSites(self.mlp_norm_out_scale, self.swiglu_out_scale, self.swiglu_grad_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, add: torch.Tensor | None = None,
                add_carrier: torch.Tensor | None = None, defer: bool = False):
        """→ the block's output. One rank only (CoatLayers): add, add_carrier: the previous block's deferred
        output, x + add, made by this block's attention norm; defer: return this block's own output deferred,
        (h, out, carrier) with output h + out, for the next block's attention norm to make."""
        a, ff, region = self.attention, self.feed_forward, self.region
        # One rank: each residual branch reads its input through the fused function that norms it, so that the
        # branch's gradient is added in the norm's backward kernel. Under TP the branches must bypass the regions
        # (their backward all-reduces the input's gradient).
        fused = region is NO_REGION
        if (add is not None or defer) and not fused:
            raise ValueError("a deferred residual addition needs the one-rank block (no tensor parallelism)")
        out = coat_norm_qkv(region.enter(x), region.replicated(self.attention_norm.weight),
                            (a.wq.weight, a.wk.weight, a.wv.weight), self.qkv_cache, self.qkv_flow, cos, sin,
                            self.qkv_sites(), residual=fused, add=add, add_carrier=add_carrier)
        core = causal_attention(*out[:3])
        mlp = (region.replicated(self.ffn_norm.weight), (ff.w1.weight, ff.w3.weight, ff.w2.weight),
               (self.w13_cache, self.w2_cache), self.mlp_flow, self.mlp_sites())
        if fused:  # h = x + attn made by the MLP norm's kernel, and returned for the residual branch; that kernel's
            # backward also folds in the amax of h's gradient, which is wo's output gradient, for wo's cast
            attn, wo_carrier = a.wo(core, carry_amax=True, input_scale=self.wo_in_scale)
            out, h, *w2_carrier = coat_mlp(out[3], *mlp, residual=True, add=attn, add_carrier=wo_carrier,
                                           carry_amax=defer)
            return (h, out, *w2_carrier) if defer else h + out
        h = x + a.wo(core, input_scale=self.wo_in_scale)
        return h + region.exit(coat_mlp(region.enter(h), *mlp))

    def takes_deferred_output(self) -> bool:
        """Whether this block can make (and defer) the residual additions around it: on one rank only."""
        return self.region is NO_REGION

    def fp8_weight_caches(self):
        """(cache, weights) pairs for refresh_fp8_weights (wo's cache belongs to its Fp8Linear)."""
        a, ff = self.attention, self.feed_forward
        return ((self.qkv_cache, (a.wq.weight, a.wk.weight, a.wv.weight)),
                (self.w13_cache, (ff.w1.weight, ff.w3.weight)),
                (self.w2_cache, (ff.w2.weight,)))


class CoatLayers(nn.ModuleList):
    """The blocks of a coat model, run in sequence with each block's output addition h + out deferred to the next
    block's attention norm, whose kernel makes the sum as it reads it (one [M, H] pass less a block) and whose
    backward folds the amax of the sum's gradient into the carrier of the previous block's w2. The same bytes as
    the blocks run one by one. Blocks that cannot take a deferred output (tensor parallelism) run one by one."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        pending = {}
        for i, layer in enumerate(self):
            nxt = self[i + 1] if i + 1 < len(self) else None
            defer = _takes(layer) and _takes(nxt)
            out = layer(h, cos, sin, **pending, defer=defer)
            h, pending = (out[0], {"add": out[1], "add_carrier": out[2]}) if defer else (out, {})
        return h


def _takes(layer) -> bool:
    return isinstance(layer, CoatTransformerBlock) and layer.takes_deferred_output()
