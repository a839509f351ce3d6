"""How a COAT block is sharded: the TP region it runs in and the plan apply_tp follows for it.

COAT fuses each norm into the GEMM after it, so a COAT block enters its region *before* the norm: every rank
normalises the whole (replicated or, under sequence parallelism, all-gathered) input, and the norm weight's
gradient, computed from this rank's share of the GEMM's gradient only, is a partial sum that
`region.replicated` all-reduces in backward. wo (a row-parallel linear) leaves the region itself; w2 is inside
the fused MLP, so its partial output leaves the region after it.
"""
from __future__ import annotations

import torch


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
