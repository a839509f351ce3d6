"""Communication at the edges of tensor-parallel regions, as small autograd functions (megatron-core's
mappings.py). Each names what it does forward; backward is its adjoint:

    copy_to_tp            identity     | all-reduce     (enter a TP region with a replicated input)
    reduce_from_tp        all-reduce   | identity       (leave it: sum the partial outputs)
    gather_from_sp        all-gather   | reduce-scatter (enter with a sequence-sharded input, --sequence-parallel)
    reduce_scatter_to_sp  reduce-scatter | all-gather   (leave it back onto sequence shards)
    gather_logits         all-gather of the vocab dim | keep my shard (full logits for inference)

Sequence shards are along dim 1 ([batch, seq, hidden], the model's layout). All of them are the identity
when the group has one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    x = x.movedim(dim, 0).contiguous()  # collectives work on the leading dim of contiguous tensors
    out = x.new_empty((n * x.shape[0],) + x.shape[1:])
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim).contiguous()  # a no-op at micro-batch 1; pipeline sends need it


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter over {n} ranks: dim {dim} has {x.shape[dim]} entries, not divisible")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // n,) + x.shape[1:])
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim).contiguous()  # a no-op at micro-batch 1; pipeline sends need it


def _my_chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"splitting over {n} ranks: dim {dim} has {x.shape[dim]} entries, not divisible")
    return x.chunk(n, dim)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, SEQ_DIM, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, SEQ_DIM, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, g):
        return _my_chunk(g, g.dim() - 1, ctx.group), None


def _apply(fn, x, group):
    return x if _size(group) == 1 else fn.apply(x, group)


def copy_to_tp(x, group):
    return _apply(_CopyToTP, x, group)


def reduce_from_tp(x, group):
    return _apply(_ReduceFromTP, x, group)


def gather_from_sp(x, group):
    return _apply(_GatherFromSP, x, group)


def reduce_scatter_to_sp(x, group):
    return _apply(_ReduceScatterToSP, x, group)


def gather_logits(x, group):
    return _apply(_GatherLastDim, x, group)
