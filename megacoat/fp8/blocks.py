"""The COAT transformer block: the plain model's block with its forward routed through the FP8 precision flow.

It adopts the original block's submodules (`attention_norm`, `attention.wq/wk/wv/wo`, `ffn_norm`,
`feed_forward.w1/w2/w3`), so parameter names and objects are unchanged. Per block:
    h   = x + wo(SDPA(q, k, v))   with q, k, v = coat_norm_qkv(x): RMSNorm, the [q|k|v] GEMM, RoPE of q and k
                                  (wo: Fp8Linear)
    out = h + coat_mlp(h)
On one rank the MLP norm's forward kernel makes h itself (coat_mlp's add), and both norms' backward kernels add
the residual branches' gradients; the MLP norm's also folds in the amax of h's gradient, which wo's backward casts
(wo's carrier, megacoat.fp8.linear.Fp8LinearFunction). In a model, run_coat_layers defers each block's own output
addition h + out in the same way to the next block's attention norm, with w2's carrier. The residual stream itself
stays in the activation dtype (adds save nothing for backward); attention's core stays BF16 (flash SDPA on GPU) and
what it saves is counted in the measurements.

Tensor parallelism: the block runs inside a TP region, `self.region`, which is the identity (`NO_REGION`) on
one rank; megacoat.parallel.apply_tp shards the linears and sets a real region. COAT fuses each norm into
the GEMM after it, so the region is entered *before* the norm: every rank normalises the whole (replicated
or, under sequence parallelism, all-gathered) input, and the norm weight's gradient, computed from this
rank's share of the GEMM's gradient only, is a partial sum that `region.replicated` all-reduces in backward.
wo (a row-parallel linear under TP) leaves the region itself; w2 is inside the fused MLP, so its partial
output leaves the region after it.
"""
from __future__ import annotations

import torch
from torch import nn

from megacoat.fp8.config import FP8Config
from megacoat.fp8.formats import get_format
from megacoat.fp8.delayed_scaling import DelayedScale, drop_saved_history
from megacoat.fp8.linear import Fp8Linear, Fp8WeightCache
from megacoat.fp8.precision_flow import coat_mlp, coat_norm_qkv
from megacoat.ops.attention import causal_attention


class NoRegion:
    """The TP region of a block on one rank: entering and leaving it, and using a replicated weight inside
    it, are the identity. megacoat.parallel.layers.TPRegion has the same three methods."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def replicated(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


NO_REGION = NoRegion()


class CoatTransformerBlock(nn.Module):
    def __init__(self, block: nn.Module, fp8: FP8Config):
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
        self.group_size, self.fast_accum = fp8.group_size, fp8.fast_accum
        self.grad_dtype = get_format(fp8.grad_dtype).dtype
        self.qkv_cache, self.w13_cache, self.w2_cache = (Fp8WeightCache(fp8.weight_cache)
                                                         for _ in range(3))
        # delayed scaling sites (megacoat.fp8.delayed_scaling): SwiGLU's and the [q|k|v] output's gradients; the two
        # norms' and SwiGLU's outputs, and wo's input (attention's output)
        sites = dict.fromkeys(("swiglu_grad_scale", "qkv_grad_scale"), fp8.grad_scaling == "delayed")
        sites.update(dict.fromkeys(("qkv_norm_out_scale", "mlp_norm_out_scale", "swiglu_out_scale", "wo_in_scale"),
                                   fp8.activation_scaling == "delayed"))
        for name, delayed in sites.items():
            setattr(self, name, DelayedScale(fp8.amax_history_len) if delayed else None)
            if not delayed:
                drop_saved_history(self, name)
        self.region = NO_REGION

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, add: torch.Tensor | None = None,
                add_carrier: torch.Tensor | None = None, defer: bool = False):
        """→ the block's output. One rank only (run_coat_layers): add, add_carrier: the previous block's deferred
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
                            (a.wq.weight, a.wk.weight, a.wv.weight), self.qkv_cache, self.attention_norm.eps,
                            self.group_size, self.grad_dtype, cos, sin, a.head_dim, self.fast_accum,
                            self.qkv_norm_out_scale, residual=fused, grad_scale=self.qkv_grad_scale, add=add,
                            add_carrier=add_carrier)
        core = causal_attention(*out[:3])
        mlp = (region.replicated(self.ffn_norm.weight), ff.w1.weight, ff.w3.weight, ff.w2.weight, self.w13_cache,
               self.w2_cache, self.ffn_norm.eps, self.group_size, self.grad_dtype, self.fast_accum,
               self.swiglu_grad_scale, self.mlp_norm_out_scale, self.swiglu_out_scale)
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


def run_coat_layers(layers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT.run_layers for COAT blocks (convert_to_fp8 sets it): each block's output addition h + out is deferred to
    the next block's attention norm, whose kernel makes the sum as it reads it (one [M, H] pass less a block), and
    whose backward kernel folds the amax of the sum's gradient into the carrier of the previous block's w2, which
    casts its output gradient without a reduction of its own. The same bytes as the blocks run one by one: the
    sum is rounded as torch's addition, and a max in any order is the same max. Blocks that cannot take a
    deferred output (tensor parallelism) run one by one."""
    pending = {}
    for i, layer in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        defer = _takes(layer) and _takes(nxt)
        out = layer(h, cos, sin, **pending, defer=defer)
        h, pending = (out[0], {"add": out[1], "add_carrier": out[2]}) if defer else (out, {})
    return h


def _takes(layer) -> bool:
    return isinstance(layer, CoatTransformerBlock) and layer.takes_deferred_output()
