"""Megatron-style tensor-parallel layers, each built from the plain model's module by slicing its full weight
(so TP=N from one seed holds exactly TP=1's weights), keeping the parameter name `weight`:

    ColumnParallelLinear   output features split: wq, wk, wv, w1, w3 (and the vocab head)
    RowParallelLinear      input features split, partial outputs summed on leaving the region: wo, w2
    VocabParallelEmbedding vocabulary rows split; each rank looks up its rows, the sum leaves the region
    ParallelRMSNorm        the norm in front of column-parallel layers; it *enters* the TP region once for all
                           the projections that read it (wq|wk|wv share one all-reduce / all-gather)

`TPRegion` says how a region is entered and left: with a replicated input (copy / all-reduce) or, under
--sequence-parallel, with sequence shards (all-gather / reduce-scatter); a COAT block's region gathers its
input as E4M3 codes with 1xG group scales (`carrying_fp8`, --sequence-parallel-gather fp8). Sharded parameters carry
`tensor_model_parallel = True`, which DeepSpeed's grad-norm and clipping read to count them on every TP rank
(replicated ones, the norms, only on TP rank 0).

The model is converted to FP8 (megacoat.coat.convert_to_coat) before it is sharded: a linear built from an
Fp8Linear runs its shard through megacoat.coat.linear.fp8_linear with the Fp8Linear's gradient format, weight
cache policy and shared input cache, and per-shard per-tensor scales: a column shard's input is replicated,
so every rank computes the same input amax anyway; a row shard's output is a partial sum added in BF16 after
the GEMM, so its own scales are exact for it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from megacoat.coat.linear import Fp8Linear, Fp8WeightCache, check_gemm_dims, fp8_linear
from megacoat.parallel.mappings import (copy_to_tp, gather_fp8_from_sp, gather_from_sp, reduce_from_tp,
                                        reduce_scatter_to_sp)


@dataclass
class TPRegion:
    group: object
    size: int
    rank: int
    sequence_parallel: bool = False
    fp8_gather: bool = False  # whether a block that rounds its input to 1xG E4M3 groups may gather it so
    fp8_group_size: int | None = None  # set by carrying_fp8: this region's all-gather carries E4M3 groups

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return copy_to_tp(x, self.group)
        if self.fp8_group_size is not None:
            return gather_fp8_from_sp(x, self.group, self.fp8_group_size)
        return gather_from_sp(x, self.group)

    def carrying_fp8(self, group_size: int) -> TPRegion:
        """This region for a block whose first op rounds its input to 1 x group_size E4M3 groups (COAT's fused
        norms): under sequence parallelism with fp8_gather, its all-gather carries those codes and scales."""
        return replace(self, fp8_group_size=group_size) if self.sequence_parallel and self.fp8_gather else self

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sp(x, self.group) if self.sequence_parallel else reduce_from_tp(x, self.group)

    def replicated(self, weight: torch.Tensor) -> torch.Tensor:
        """A replicated weight used inside the region (a norm fused into the GEMM after it): identity forward,
        its partial gradient all-reduced in backward."""
        return copy_to_tp(weight, self.group)


def _shard(weight: torch.Tensor, dim: int, region: TPRegion, what: str) -> nn.Parameter:
    if weight.shape[dim] % region.size:
        raise ValueError(f"{what}: dim {dim} of size {weight.shape[dim]} is not divisible by "
                         f"--tensor-model-parallel-size {region.size}")
    piece = weight.detach().chunk(region.size, dim)[region.rank].clone()
    p = nn.Parameter(piece, requires_grad=weight.requires_grad)
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


def mark_replicated(p: nn.Parameter) -> None:
    p.tensor_model_parallel = False


class _ShardedLinear(nn.Module):
    """This rank's shard of `linear`'s weight; FP8 GEMMs when `linear` is an Fp8Linear."""

    def __init__(self, linear: nn.Module, weight: nn.Parameter):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.fp8_grad_dtype = self.fp8_cache = self.input_cache = None
        self.fast_accum = self.save_input = False
        if isinstance(linear, Fp8Linear):
            check_gemm_dims(in_features=self.in_features, out_features=self.out_features)
            self.fp8_grad_dtype = linear.grad_dtype
            self.fp8_cache = Fp8WeightCache(linear.fp8_cache.policy)
            self.input_cache = linear.input_cache  # wq/wk/wv (w1/w3) shards read one input: quantized once
            self.fast_accum, self.save_input = linear.fast_accum, linear.save_input

    def _matmul(self, x: torch.Tensor, input_scale=None) -> torch.Tensor:
        if self.fp8_grad_dtype is None:
            return F.linear(x, self.weight)
        return fp8_linear(x, self.weight, self.fp8_cache, self.fp8_grad_dtype, self.input_cache, self.fast_accum,
                          input_scale=input_scale, save_input=self.save_input)

    def fp8_weight_caches(self):
        """(cache, weights) pairs for megacoat.coat.linear.refresh_fp8_weights."""
        return () if self.fp8_cache is None else ((self.fp8_cache, (self.weight,)),)

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_grad_dtype is None else f", fp8=e4m3, grad={self.fp8_grad_dtype}"
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank's shard){fp8}"


class ColumnParallelLinear(_ShardedLinear):
    """y_local = x W_local^T. x is already inside the region: the ParallelRMSNorm in front entered it once for
    all the projections that read it. The output stays split over the TP group (local heads, FFN columns or
    vocabulary rows)."""

    def __init__(self, linear: nn.Module, region: TPRegion, name: str = "linear"):
        super().__init__(linear, _shard(linear.weight, 0, region, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)


class RowParallelLinear(_ShardedLinear):
    """y = sum over ranks of x_local W_local^T, leaving the region (all-reduce, or reduce-scatter onto
    sequence shards)."""

    def __init__(self, linear: nn.Module, region: TPRegion, name: str = "linear"):
        super().__init__(linear, _shard(linear.weight, 1, region, name))
        self.region = region

    def forward(self, x: torch.Tensor, input_scale=None) -> torch.Tensor:
        """input_scale: x's delayed-scaling site (this rank's shard of x; megacoat.coat.linear.fp8_linear)."""
        return self.region.exit(self._matmul(x, input_scale))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, embedding: nn.Embedding, region: TPRegion):
        super().__init__()
        self.weight = _shard(embedding.weight, 0, region, "tok_embeddings")
        self.region = region
        self.vocab_start = region.rank * self.weight.shape[0]
        self.num_embeddings = embedding.num_embeddings

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.region.exit(out)  # one rank owns each token's row: the sum is that row

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]} of {self.num_embeddings}"


class ParallelRMSNorm(nn.Module):
    """RMSNorm, then enter the TP region. Under sequence parallelism it normalises only this rank's sequence
    shard, so its weight's gradient is a partial sum: copy_to_tp on the weight all-reduces it in backward,
    before DeepSpeed sees it."""

    def __init__(self, norm: nn.Module, region: TPRegion):
        super().__init__()
        self.weight = norm.weight
        mark_replicated(self.weight)
        self.eps = norm.eps
        self.region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.region.group) if self.region.sequence_parallel else self.weight
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * weight
        return self.region.enter(out)
