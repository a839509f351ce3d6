"""How a COAT block is sharded: the TP region it runs in, which megacoat.parallel.apply_tp gives it.

apply_tp makes a block's linears column- and row-parallel whatever the block; a `RegionBlock` (the COAT block) then
keeps its norms, fused into its GEMMs, and enters its region with `enter_tp_region`.

COAT fuses each norm into the GEMM after it, so a COAT block enters its region *before* the norm: every rank
normalises the whole (replicated or, under sequence parallelism, all-gathered) input, and the norm weight's
gradient, computed from this rank's share of the GEMM's gradient only, is a partial sum that
`region.replicated` all-reduces in backward. wo (a row-parallel linear) leaves the region itself; w2 is inside
the fused MLP, so its partial output leaves the region after it. Under sequence parallelism the fused norm's first
step, rounding its input to 1xG E4M3 groups, is what the region's all-gather carries (`region.carrying_fp8`):
the rows arrive as those groups' values, and the norm's own rounding of them gives back the same codes.
"""
from __future__ import annotations

import torch
from torch import nn

from megacoat.coat.linear import check_gemm_dims


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


class RegionBlock(nn.Module):
    """A block that runs inside one TP region (NO_REGION on one rank), entered before its fused norms."""

    LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
               "feed_forward.w2", "feed_forward.w3")

    def enter_tp_region(self, region, prefix: str = "") -> tuple[nn.Parameter, ...]:
        """Run inside `region` from now on (apply_tp has made the linears shards, which the fused functions multiply
        by directly: their dims must suit FP8 GEMMs). Returns the norm weights, replicated inside the region."""
        for path in self.LINEARS:
            out_features, in_features = self.get_submodule(path).weight.shape
            check_gemm_dims(**{f"{prefix}{path} shard's in_features": in_features,
                               f"{prefix}{path} shard's out_features": out_features})
        self.region = region.carrying_fp8(self.group_size)
        return self.attention_norm.weight, self.ffn_norm.weight
