"""Communication at the edges of tensor-parallel regions, as small autograd functions (megatron-core's
mappings.py). Each names what it does forward; backward is its adjoint:

    copy_to_tp            identity     | all-reduce     (enter a TP region with a replicated input)
    reduce_from_tp        all-reduce   | identity       (leave it: sum the partial outputs)
    gather_from_sp        all-gather   | reduce-scatter (enter with a sequence-sharded input, --sequence-parallel)
    gather_fp8_from_sp    all-gather of E4M3 codes and 1xG scales | reduce-scatter (as gather_from_sp, 1 + 4/G
                          bytes an element on the wire instead of 2; the rows come back dequantized)
    reduce_scatter_to_sp  reduce-scatter | all-gather   (leave it back onto sequence shards)
    gather_logits         all-gather of the vocab dim | keep my shard (full logits for inference)

Sequence shards are along dim 1 ([batch, seq, hidden], the model's layout). All of them are the identity
when the group has one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megacoat.ops.numerics import fp8_to_float32, group_dequantize, group_quantize

SEQ_DIM = 1
E4M3 = torch.float8_e4m3fn


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


def _all_gather_fp8(x: torch.Tensor, dim: int, group, group_size: int) -> torch.Tensor:
    """_all_gather of x quantized in 1xG E4M3 groups along its last dim: the codes (as bytes: gloo has no float8
    type) and the float32 group scales, each in a collective of its own, since a bitcast between types of different
    sizes (one packed buffer) does not compile on CUDA. Every group keeps its own scale, so no scale has to agree
    across ranks. Returns the gathered values in x's dtype."""
    codes, scales = quantize_groups(x, group_size)
    return dequantize_groups(_all_gather(codes, dim, group), _all_gather(scales, dim, group), group_size, x.dtype)


def quantize_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] → (uint8 codes [..., H], float32 scales [..., ceil(H / G)]): E4M3 with one scale per 1xG group
    (megacoat.ops.numerics.group_quantize)."""
    codes, scales = group_quantize(x.reshape(-1, x.shape[-1]), group_size, E4M3)
    return codes.view(torch.uint8).view(x.shape), scales.reshape(*x.shape[:-1], -1)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """quantize_groups' codes and scales → their values [..., H] in dtype."""
    hidden = codes.shape[-1]
    rows, row_scales = codes.reshape(-1, hidden).view(E4M3), scales.reshape(-1, scales.shape[-1])
    if hidden % group_size:
        values = group_dequantize(rows.contiguous(), row_scales.contiguous(), group_size)
    else:  # whole groups: a view per group, no pad (group_dequantize's layout without its copies)
        # traced, the plain conversion (fp8_to_float32's CPU table is an eager speed-up)
        decoded = rows.float() if torch.compiler.is_compiling() else fp8_to_float32(rows)
        values = decoded.reshape(rows.shape[0], -1, group_size) * row_scales[..., None]
    return values.reshape(codes.shape).to(dtype)


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


class _GatherFp8FromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, group_size):
        ctx.group = group
        return _all_gather_fp8(x, SEQ_DIM, group, group_size)

    @staticmethod
    def backward(ctx, g):
        # the partial gradients are summed across ranks: NCCL and gloo have no FP8 sum, and each rank's E5M2
        # rounding before the sum would add its error once per rank, so they travel in g's dtype as before
        return _reduce_scatter(g, SEQ_DIM, ctx.group), None, None


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


def gather_fp8_from_sp(x, group, group_size: int):
    """gather_from_sp carrying x as E4M3 codes with one float32 scale per 1 x group_size group (COAT's group
    scaling, megacoat.ops.numerics.group_quantize): its output is x's values rounded to those groups."""
    return x if _size(group) == 1 else _GatherFp8FromSP.apply(x, group, group_size)


def reduce_scatter_to_sp(x, group):
    return _apply(_ReduceScatterToSP, x, group)


def gather_logits(x, group):
    return _apply(_GatherLastDim, x, group)
