"""The COAT block on tensor-parallel shards: CoatTransformerBlock's FP8 precision flow (fused RMSNorm → FP8
GEMM, fused MLP) run on this rank's heads and FFN columns.

COAT fuses each norm into the GEMM after it, so the region is entered *before* the norm: every rank
normalises the whole (replicated or, under SP, all-gathered) input, and the norm weight's gradient, computed
from this rank's share of the GEMM's gradient only, is a partial sum: copy_to_tp on the weight all-reduces it.
The MLP's w2 is inside the fused function, so its partial output leaves the region after it.
"""
from __future__ import annotations

import torch
from torch import nn

from megacoat.fp8.blocks import attention_core
from megacoat.fp8.formats import get_format
from megacoat.fp8.linear import Fp8WeightCache
from megacoat.fp8.precision_flow import coat_mlp, coat_norm_linear
from megacoat.parallel.layers import TPRegion
from megacoat.parallel.mappings import copy_to_tp


class TensorParallelCoatBlock(nn.Module):
    def __init__(self, block: nn.Module, region: TPRegion, fp8):
        super().__init__()
        self.layer_id = getattr(block, "layer_id", None)
        self.attention_norm, self.attention = block.attention_norm, block.attention
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward
        self.region = region
        self.group_size = fp8.group_size
        self.grad_dtype = get_format(fp8.grad_dtype).dtype
        self.qkv_cache, self.w13_cache, self.w2_cache = (Fp8WeightCache(fp8.persistent_weight_cache)
                                                         for _ in range(3))

    def _norm_weight(self, norm: nn.Module) -> torch.Tensor:
        return copy_to_tp(norm.weight, self.region.group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, ff = self.attention, self.feed_forward
        xin = self.region.enter(x)
        qkv = coat_norm_linear(xin, self._norm_weight(self.attention_norm), (a.wq.weight, a.wk.weight, a.wv.weight),
                               self.qkv_cache, self.attention_norm.eps, self.group_size, self.grad_dtype)
        h = x + a.wo(attention_core(a, qkv, cos, sin))  # RowParallelLinear (FP8) leaves the region
        hin = self.region.enter(h)
        out = coat_mlp(hin, self._norm_weight(self.ffn_norm), ff.w1.weight, ff.w3.weight, ff.w2.weight,
                       self.w13_cache, self.w2_cache, self.ffn_norm.eps, self.group_size, self.grad_dtype)
        return h + self.region.exit(out)
