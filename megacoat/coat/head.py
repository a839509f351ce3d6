"""The FP8 vocabulary head: the output layer and its cross-entropy as one autograd function, and `Fp8Head`.

The loss's backward writes the logits' gradient as FP8 codes itself (megacoat.ops.cross_entropy_fp8), one pass over
the logits, and returns each label entry's rounding error r, which the head adds back in float32 through its BF16
weight and its FP8 input: dx_t += r_t W[y_t], dW[y] += sum over tokens t labelled y of r_t x_t
(megacoat.ops.label_corrections). The row's other entries keep E5M2's rounding.

`Fp8Head` is the model's head module that convert_to_coat swaps in: with labels it runs `fp8_head_loss`, without
them the output layer (an Fp8Linear) returns the logits.

Vocabulary-parallel (a TP group): each rank holds a slice of the vocabulary's rows and of the logits; two all-reduces
of [2, T] give every rank the whole row's log-sum-exp, label logit and gradient amax (`vocab_parallel_stats`), so
every rank computes the one-rank loss and one gradient scale; its backward writes its slice's FP8 gradient, and its
dx, a partial sum over the slices, is summed by the TP region the head's input entered.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megacoat.coat.linear import Fp8Linear, Fp8LinearFunction, check_gemm_dims, fp8_linear_grads, quantize_x, scaled_mm
from megacoat.ops.cross_entropy_fp8 import cross_entropy_grad_fp8, cross_entropy_stats
from megacoat.ops.formats import get_format
from megacoat.ops.label_corrections import label_corrections


class Fp8HeadLossFunction(torch.autograd.Function):
    """mean cross-entropy(x @ W^T, labels) over the counted tokens, the GEMMs in FP8 as Fp8LinearFunction's. x
    [T, K] in the activation dtype, labels [T] int64; the weight's and x's FP8 copies made by the caller. Keeps the
    logits (in x's dtype, as a compiled loss does), their log-sum-exp, x8^T and a few scalars; the label entries'
    rounding is added back in backward (megacoat.ops.label_corrections).

    The logits are kept on ctx, not through save_for_backward, so that backward can free them as soon as their FP8
    gradient is written: autograd holds saved tensors until the node's backward returns, and the logits (2 bytes a
    logit) would sit beside the GEMMs' outputs, dx and dW. Freed,
    the head's peak is the logits and their gradient, as a compiled BF16 loss's. Backward therefore runs once per
    forward (retain_graph is refused with one error)."""

    @staticmethod
    def forward(ctx, x, weight, labels, w8, w8t, w_scale, x8, x8t, x_scale, grad_dtype, ignore_index, fast_accum,
                group=None):
        logits = scaled_mm(x8, w8.t(), x_scale, w_scale, x.dtype, fast_accum)
        if group is None:
            loss_per_token, lse, amax = cross_entropy_stats(logits, labels, ignore_index)
        else:  # labels become this slice's columns (vocab_parallel_stats)
            loss_per_token, lse, amax, labels = vocab_parallel_stats(logits, labels, ignore_index, group)
        count = (labels != ignore_index).sum()
        ctx.logits = logits
        ctx.save_for_backward(labels, lse, amax, count, x8t, x_scale, weight)
        Fp8LinearFunction.save_weight(ctx, weight, w8t, w_scale, grad_dtype)
        ctx.ignore_index, ctx.x_dtype = ignore_index, x.dtype
        return loss_per_token.sum() / count  # F.cross_entropy's mean (NaN when no token counts)

    @staticmethod
    def backward(ctx, grad_loss):
        labels, lse, amax, count, x8t, x_scale, weight = ctx.saved_tensors
        logits, ctx.logits = ctx.logits, None
        if logits is None:
            raise RuntimeError("the FP8 head's backward frees its logits as it runs, so it runs once per forward: "
                               "backward through it twice (retain_graph) is not supported")
        need_dx, need_dw = ctx.needs_input_grad[:2]
        g8, g8t, g_scale, residual = cross_entropy_grad_fp8(logits, labels, lse, amax, grad_loss.float() / count,
                                                            ctx.grad_dtype, ctx.ignore_index, rowwise=need_dx,
                                                            transpose=need_dw)
        del logits  # before the GEMMs write dx and dW
        dx, dw = fp8_linear_grads(ctx, g8, g8t, g_scale, x8t, x_scale, ctx.x_dtype)
        # the FP8 gradient (2 bytes a logit) goes before the corrections' float32 dW (4 V K) comes, so that the two
        # never add up: the head's peak stays the logits and their gradient, as the BF16 head's
        del g8, g8t
        # an ignored token's residual is 0, and so is that of a label in another rank's slice
        label = torch.where((labels >= 0) & (labels < weight.shape[0]), labels, 0)
        label_corrections(dx, dw, residual, label, weight, x8t, x_scale)  # into the GEMMs' own outputs
        return (dx, dw, *(None,) * 11)


def vocab_parallel_stats(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, group):
    """cross_entropy_stats of rows split along the vocabulary over `group`: logits [T, V/n] this rank's slice
    (rank r holds columns r V/n to (r + 1) V/n), labels [T] global ids → (loss per token [T], log-sum-exp [T],
    gradient amax [1]) of the whole rows, the same on every rank, and the labels as this slice's columns: another
    slice's label becomes V/n (no column here), ignore_index stays. Two all-reduces of [2, T], float32."""
    v = logits.shape[1]
    local = labels - dist.get_rank(group) * v
    counted = labels != ignore_index
    here = counted & (local >= 0) & (local < v)
    index = torch.where(here, local, 0)[:, None]
    z = logits.to(torch.float32, copy=True)  # one float32 copy, its label column then left out in place
    z_label = z.gather(1, index)[:, 0]
    top = z.amax(1)
    z.scatter_(1, index, torch.where(here, float("-inf"), z_label)[:, None])
    maxes = torch.stack((top, z.amax(1)))
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    top, others_max = maxes
    exp_sum = torch.exp(z - top[:, None]).sum(1) + torch.where(here, torch.exp(z_label - top), 0.0)
    sums = torch.stack((exp_sum, torch.where(here, z_label, 0.0)))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    lse, z_label = top + sums[0].log(), sums[1]
    row_amax = torch.maximum(1.0 - torch.exp(z_label - lse), torch.exp(others_max - lse))
    amax = torch.where(counted, row_amax, 0.0).amax().reshape(1)
    columns = torch.where(here, local, torch.where(counted, v, ignore_index))
    return torch.where(counted, lse - z_label, 0.0), lse, amax, columns


def fp8_head_loss(head: nn.Module, x: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                  group=None) -> torch.Tensor:
    """The mean cross-entropy of head(x) against labels (ignore_index: tokens that do not count), the head's GEMMs
    in FP8 and the logits' gradient cast by the loss's backward. x [..., K], labels [...]. head: an Fp8Linear, or
    with a TP group this rank's vocabulary shard of one (an FP8 ColumnParallelLinear, whose x is the same on every
    rank of the group: its gradient leaves as a partial sum)."""
    x2 = x.reshape(-1, x.shape[-1])
    grad = torch.is_grad_enabled() and (x.requires_grad or head.weight.requires_grad)
    if grad:
        check_gemm_dims(tokens_per_micro_batch=x2.shape[0])  # wgrad contracts over the tokens
    x8, x8t, x_scale = quantize_x(x2, transpose=grad and head.weight.requires_grad)
    w8, w8t, w_scale = head.fp8_cache.get((head.weight,))
    grad_dtype = head.grad_dtype if isinstance(head, Fp8Linear) else head.fp8_grad_dtype
    return Fp8HeadLossFunction.apply(x2, head.weight, labels.reshape(-1), w8, w8t, w_scale, x8, x8t, x_scale,
                                     get_format(grad_dtype).dtype, ignore_index, head.fast_accum, group)


class Fp8Head(nn.Module):
    """The GPT's head with an FP8 output layer: output(h) → logits, or with labels the loss by fp8_head_loss."""

    def __init__(self, ignore_index: int):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, output: Fp8Linear, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return output(h) if labels is None else fp8_head_loss(output, h, labels, self.ignore_index)
