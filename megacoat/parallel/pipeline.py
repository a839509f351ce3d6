"""Pipeline parallelism through DeepSpeed's PipelineModule (its 1F1B schedule), built from the plain GPT's own
modules (already FP8-converted and/or tensor-parallel): no second model.

Layer list (partitioned over stages by parameter count):
    [embedding] [block 0] ... [block L-1] [final norm] [head]
The embedding and the head are one TiedLayerSpec when the model ties them: the first and last stage each hold
the table, DeepSpeed broadcasts it at start and all-reduces its gradient between the two stages every step.
Stages pass a single activation tensor [batch, seq (or this rank's sequence shard), hidden]; the model's own
loss (`model.head.loss`: vocab-parallel under TP) is the PipelineModule's loss_fn.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megacoat.parallel.state import ParallelState


class EmbeddingPipe(nn.Module):
    """The token table; first stage: lookup, last stage (tied): the head's projection."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.tok_embeddings = embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)


def project_to_vocab(embedding_pipe: EmbeddingPipe, h: torch.Tensor) -> torch.Tensor:
    """The tied head: logits (this TP rank's vocabulary slice) from the embedding's rows."""
    return F.linear(h, embedding_pipe.tok_embeddings.weight)


class BlockPipe(nn.Module):
    """One transformer block with its rotary tables (stages only pass the hidden state)."""

    def __init__(self, block: nn.Module, rope: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.block = block
        self._rope_cpu = rope  # plain attributes, not buffers: fp32 whatever the model's dtype (as in GPT)
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.device not in self._rope_cache:
            self._rope_cache[h.device] = tuple(t.to(h.device) for t in self._rope_cpu)
        cos, sin = self._rope_cache[h.device]
        return self.block(h, cos, sin)


class HeadPipe(nn.Module):
    """Untied head: the GPT's `output` module (a ColumnParallelLinear over the vocabulary under TP)."""

    def __init__(self, output: nn.Module):
        super().__init__()
        self.output = output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(h)


def build_pipeline(model: nn.Module, state: ParallelState):
    """A deepspeed PipelineModule over `model`'s modules, on DeepSpeed's topology for `state`'s sizes. Only this
    stage's layers move to the device; the others are dropped with `model`."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    if model.cfg.num_layers % state.pp_size:
        raise ValueError(f"--num-layers ({model.cfg.num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({state.pp_size})")
    rope = model._rope_cpu
    layers: list = []
    if model.cfg.tie_embeddings:
        layers.append(TiedLayerSpec("embed", EmbeddingPipe, model.tok_embeddings,
                                    tied_weight_attr=["tok_embeddings.weight"]))
    else:
        layers.append(LayerSpec(EmbeddingPipe, model.tok_embeddings))
    layers += [LayerSpec(BlockPipe, block, rope) for block in model.layers]
    layers.append(model.norm)  # a module: a stage holds it as is (ParallelRMSNorm enters the TP region)
    if model.cfg.tie_embeddings:
        layers.append(TiedLayerSpec("embed", EmbeddingPipe, model.tok_embeddings, forward_fn=project_to_vocab,
                                    tied_weight_attr=["tok_embeddings.weight"]))
    else:
        layers.append(LayerSpec(HeadPipe, model.output))
    return PipelineModule(layers=layers, topology=state.grid.topology(),
                          loss_fn=model.head.loss, partition_method="parameters")
