"""Cross-entropy over logits split along the vocabulary (megatron-core's vocab-parallel cross-entropy): the
full [tokens, vocab] logits never exist on one rank. Three all-reduces of [tokens] vectors (max, target
logit, sum of exponentials) replace an all-gather of [tokens, vocab]. fp32 throughout, as the plain loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megacoat.model.gpt import IGNORE_INDEX, cross_entropy_loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group):
        """logits [N, V/tp] (fp32), labels [N] global ids → per-token loss [N] (0 where ignored)."""
        v_local = logits.shape[-1]
        start = dist.get_rank(group) * v_local
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local = labels - start
        mine = (local >= 0) & (local < v_local)
        local = local.masked_fill(~mine, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        dist.all_reduce(target, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        ignored = labels == IGNORE_INDEX
        loss = (sum_exp.log() - target).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local, mine & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, hit, ignored = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target), per token
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= hit.to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """Mean loss over labels != IGNORE_INDEX; logits [batch, seq, V/tp] this rank's vocabulary slice."""
    if group is None or dist.get_world_size(group) == 1:
        return cross_entropy_loss(logits, labels)
    per_token = _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), labels.flatten(), group)
    # Like F.cross_entropy's mean with ignore_index: NaN when every label is ignored.
    return per_token.sum() / (labels != IGNORE_INDEX).sum()
