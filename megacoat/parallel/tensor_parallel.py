"""apply_tp(model, state, fp8): make the plain GPT tensor-parallel in place, by swapping its modules (in the
spirit of torchtitan's parallelize.apply_tp). A plan per block:

    attention_norm, ffn_norm, norm  → ParallelRMSNorm   (enter the TP region)
    attention.wq/wk/wv, ffn w1/w3   → ColumnParallelLinear (local heads / local FFN columns)
    attention.wo, ffn w2            → RowParallelLinear    (leave the region)
    tok_embeddings                  → VocabParallelEmbedding (leaves onto sequence shards under SP)
    output                          → ColumnParallelLinear over the vocabulary (tied: the embedding's shard)

With FP8 activations, the block linears run FP8 GEMMs on their shards (`fp8-linear`), or each block becomes a
TensorParallelCoatBlock (`coat`). The model's class is swapped for a subclass whose forward scatters onto
sequence shards and takes the vocab-parallel loss (as torch's fully_shard swaps a module's class); parameter
names are unchanged, so checkpoints and optimizer groups read the same.
"""
from __future__ import annotations

import torch
from torch import nn

from megacoat.parallel.cross_entropy import vocab_parallel_cross_entropy
from megacoat.parallel.layers import (ColumnParallelLinear, ParallelRMSNorm, RowParallelLinear, TPRegion,
                                      VocabParallelEmbedding, mark_replicated)
from megacoat.parallel.mappings import gather_logits
from megacoat.parallel.state import ParallelState

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def region_of(state: ParallelState) -> TPRegion:
    return TPRegion(state.tp_group, state.tp_size, state.tp_rank, state.sequence_parallel)


def _set(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, name = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _parallelize_block(block: nn.Module, region: TPRegion, fp8, prefix: str) -> nn.Module:
    # coat: the column shards' weights feed the fused norm+GEMM functions, their modules never run.
    column_fp8 = fp8 if fp8 is not None and fp8.mode == "fp8-linear" else None
    for path in COLUMN:
        _set(block, path, ColumnParallelLinear(block.get_submodule(path), region, column_fp8, name=prefix + path))
    for path in ROW:
        _set(block, path, RowParallelLinear(block.get_submodule(path), region, fp8, name=prefix + path))
    if fp8 is not None and fp8.mode == "coat":
        from megacoat.parallel.fp8_blocks import TensorParallelCoatBlock

        for norm in ("attention_norm", "ffn_norm"):
            mark_replicated(getattr(block, norm).weight)
        return TensorParallelCoatBlock(block, region, fp8)
    block.attention_norm = ParallelRMSNorm(block.attention_norm, region)
    block.ffn_norm = ParallelRMSNorm(block.ffn_norm, region)
    return block


class TensorParallelGPTMixin:
    """forward of a tensor-parallel GPT: the plain one's, plus the sequence scatter and the vocab-parallel
    loss (the head's logits stay split over the vocabulary)."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.seq_length:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds --seq-length {self.cfg.seq_length}")
        h = self.tok_embeddings(tokens)  # under SP it leaves the region already on sequence shards
        cos, sin = self._rope(h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        group = self.tp_region.group
        if labels is None:
            return gather_logits(logits, group)
        return vocab_parallel_cross_entropy(logits, labels, group)


def apply_tp(model: nn.Module, state: ParallelState, fp8=None) -> nn.Module:
    """Shard `model` (a plain megacoat GPT, full weights initialised identically on every rank) over the TP
    group in place; return it. `fp8`: the FP8Config when an FP8 activation mode is on, else None."""
    if state.tp_size == 1:
        return model
    if fp8 is not None and not fp8.enabled:
        fp8 = None
    region = region_of(state)
    cfg = model.cfg
    if cfg.seq_length % state.tp_size and state.sequence_parallel:
        raise ValueError(f"--sequence-parallel: --seq-length {cfg.seq_length} not divisible by TP {state.tp_size}")
    tied = cfg.tie_embeddings
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, region)
    for i, block in enumerate(model.layers):
        model.layers[i] = _parallelize_block(block, region, fp8, f"layers.{i}.")
    model.norm = ParallelRMSNorm(model.norm, region)
    # The head stays high precision in every FP8 mode (as convert_to_fp8 leaves it).
    model.output = ColumnParallelLinear(model.output, region, name="output")
    if tied:
        model.output.weight = model.tok_embeddings.weight  # the same vocabulary rows on this rank
    model.tp_region = region
    model.__class__ = type(f"TensorParallel{type(model).__name__}", (TensorParallelGPTMixin, type(model)), {})
    return model
