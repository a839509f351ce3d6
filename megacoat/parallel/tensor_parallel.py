"""apply_tp(model, state): make the GPT tensor-parallel in place, by swapping its modules (in the spirit of
torchtitan's parallelize.apply_tp). A plan per block:

    attention_norm, ffn_norm, norm  → ParallelRMSNorm   (enter the TP region)
    attention.wq/wk/wv, ffn w1/w3   → ColumnParallelLinear (local heads / local FFN columns)
    attention.wo, ffn w2            → RowParallelLinear    (leave the region)
    tok_embeddings                  → VocabParallelEmbedding (leaves onto sequence shards under SP)
    output                          → ColumnParallelLinear over the vocabulary (tied: the embedding's shard)

FP8 is applied first (megacoat.coat.convert_to_coat, as torchtitan converts to float8 before apply_tp), and apply_tp
shards whatever blocks it finds: the linears of an `fp8-linear` block are Fp8Linears and their shards keep running
FP8 GEMMs; a COAT block (megacoat.coat.tensor_parallel.RegionBlock) keeps its norms, fused into its GEMMs, and
enters the TP region it runs in. The GPT's `head` becomes a VocabParallelHead: the vocab-parallel loss (the FP8
head's own where convert_to_coat made one), and logits gathered over the vocabulary when no labels are given.
Parameter names are unchanged, so checkpoints and optimizer groups read the same.
"""
from __future__ import annotations

from torch import nn

from megacoat.coat.head import Fp8Head, fp8_head_loss
from megacoat.coat.tensor_parallel import RegionBlock
from megacoat.parallel.cross_entropy import vocab_parallel_cross_entropy
from megacoat.parallel.layers import (ColumnParallelLinear, ParallelRMSNorm, RowParallelLinear, TPRegion,
                                      VocabParallelEmbedding, mark_replicated)
from megacoat.parallel.mappings import gather_logits
from megacoat.parallel.state import ParallelState

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def region_of(state: ParallelState) -> TPRegion:
    return TPRegion(state.tp_group, state.tp_size, state.tp_rank, state.sequence_parallel,
                    fp8_gather=state.sequence_parallel_gather == "fp8")


def _set(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, name = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _parallelize_block(block: nn.Module, region: TPRegion, prefix: str) -> None:
    for path in COLUMN:
        _set(block, path, ColumnParallelLinear(block.get_submodule(path), region, name=prefix + path))
    for path in ROW:
        _set(block, path, RowParallelLinear(block.get_submodule(path), region, name=prefix + path))
    if isinstance(block, RegionBlock):  # the COAT block: its norms stay fused into its GEMMs
        for weight in block.enter_tp_region(region, prefix):
            mark_replicated(weight)
        return
    block.attention_norm = ParallelRMSNorm(block.attention_norm, region)
    block.ffn_norm = ParallelRMSNorm(block.ffn_norm, region)


def apply_tp(model: nn.Module, state: ParallelState) -> nn.Module:
    """Shard `model` (a megacoat GPT, FP8-converted or not, full weights initialised identically on every
    rank) over the TP group in place; return it."""
    if state.tp_size == 1:
        return model
    region = region_of(state)
    cfg = model.cfg
    if cfg.seq_length % state.tp_size and state.sequence_parallel:
        raise ValueError(f"--sequence-parallel: --seq-length {cfg.seq_length} not divisible by TP {state.tp_size}")
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, region)
    for i, block in enumerate(model.layers):
        _parallelize_block(block, region, f"layers.{i}.")
    model.norm = ParallelRMSNorm(model.norm, region)
    model.output = ColumnParallelLinear(model.output, region, name="output")  # an FP8 shard of an FP8 head
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # the same vocabulary rows on this rank
    model.head = VocabParallelHead(region.group, model.head.ignore_index, fp8=isinstance(model.head, Fp8Head))
    return model


class VocabParallelHead(nn.Module):
    """The GPT's head over a vocabulary split across the TP group: the loss reads the logits split, and full
    logits are gathered only when no labels are given. fp8: the FP8 head's loss (megacoat.coat.head), vocab-parallel."""

    def __init__(self, group, ignore_index: int, fp8: bool = False):
        super().__init__()
        self.group, self.ignore_index, self.fp8 = group, ignore_index, fp8

    def forward(self, output: nn.Module, h, labels=None):
        if labels is not None and self.fp8:
            return fp8_head_loss(output, h, labels, self.ignore_index, self.group)
        logits = output(h)
        return gather_logits(logits, self.group) if labels is None else self.loss(logits, labels)

    def loss(self, logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, group=self.group)
