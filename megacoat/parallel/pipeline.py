"""Pipeline parallelism through DeepSpeed's PipelineModule (its 1F1B schedule), built from the plain GPT's own
modules (already FP8-converted and/or tensor-parallel): no second model.

Layer list (partitioned over stages by parameter count):
    [embedding] [block 0] ... [block L-1] [final norm] [head's weight]
The embedding and the head are one TiedLayerSpec when the model ties them: the first and last stage each hold
the table, DeepSpeed broadcasts it at start and all-reduces its gradient between the two stages every step.
Stages pass a single activation tensor [batch, seq (or this rank's sequence shard), hidden]. The last layer only
holds the head's weight and passes the final norm's output on: the PipelineModule's loss_fn is the model's own
head, `model.head(model.output, h, labels)` (vocab-parallel under TP, the FP8 head's fused loss where it runs), so
the last stage computes exactly what the one-stage model's forward does after its final norm.
"""
from __future__ import annotations

import torch
from torch import nn

from megacoat.parallel.stage_graphs import GraphedBlock, StageGraphs
from megacoat.parallel.state import ParallelState


class EmbeddingPipe(nn.Module):
    """The token table; first stage: lookup, last stage (tied): the head's weight (pass_through)."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.tok_embeddings = embedding
        self._head: tuple[nn.Module, ...] = ()  # the output layer it serves on the last stage, not a submodule

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def serve_head(self, output: nn.Module) -> None:
        """On the last stage: `output` (the head, which reads this table's weight) runs in the loss; its FP8
        weight copies are this layer's to refresh (megacoat.coat.linear.refresh_fp8_weights)."""
        self._head = (output,)

    def fp8_weight_caches(self):
        return tuple(pair for output in self._head if hasattr(output, "fp8_weight_caches")
                     for pair in output.fp8_weight_caches())


def pass_through(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The tied last layer's forward: h on to the loss, which runs the head (see the module's docstring)."""
    return h


class BlockPipe(nn.Module):
    """One transformer block with its rotary tables (stages only pass the hidden state); with `graphs`, run
    through the stage's per-slot CUDA graphs (megacoat.parallel.stage_graphs)."""

    def __init__(self, block: nn.Module, rope: tuple[torch.Tensor, torch.Tensor], graphs: StageGraphs | None = None):
        super().__init__()
        self.block = block
        self._rope_cpu = rope  # plain attributes, not buffers: fp32 whatever the model's dtype (as in GPT)
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # in a tuple: not a submodule (it holds no state of its own; the block's parameters stay the block's)
        self._graphed = () if graphs is None else (GraphedBlock(block, self.rope, graphs),)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self._graphed:
            return self._graphed[0](h)
        return self.block(h, *self.rope(h))

    def rope(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) on h's device."""
        if h.device not in self._rope_cache:
            self._rope_cache[h.device] = tuple(t.to(h.device) for t in self._rope_cpu)
        return self._rope_cache[h.device]


class HeadPipe(nn.Module):
    """Untied: holds the GPT's `output` module (a ColumnParallelLinear over the vocabulary under TP, an Fp8Linear
    for the FP8 head) on the last stage and passes h on to the loss, which runs it."""

    def __init__(self, output: nn.Module):
        super().__init__()
        self.output = output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


def build_pipeline(model: nn.Module, state: ParallelState, micro_batches: int = 1, cuda_graph: bool = False):
    """A deepspeed PipelineModule over `model`'s modules, on DeepSpeed's topology for `state`'s sizes. Only this
    stage's layers move to the device; the others are dropped with `model`. cuda_graph: the stage's blocks run
    through per-slot CUDA graphs, one slot per micro-batch the 1F1B schedule holds in flight on this stage
    (pp - stage, at most `micro_batches`, the micro-batches a step)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    if model.cfg.num_layers % state.pp_size:
        raise ValueError(f"--num-layers ({model.cfg.num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({state.pp_size})")
    rope = model._rope_cpu
    tied = model.cfg.tie_embeddings
    layers: list = []
    if tied:
        layers.append(TiedLayerSpec("embed", EmbeddingPipe, model.tok_embeddings,
                                    tied_weight_attr=["tok_embeddings.weight"]))
    else:
        layers.append(LayerSpec(EmbeddingPipe, model.tok_embeddings))
    graphs = StageGraphs() if cuda_graph else None
    layers += [LayerSpec(BlockPipe, block, rope, graphs) for block in model.layers]
    layers.append(model.norm)  # a module: a stage holds it as is (ParallelRMSNorm enters the TP region)
    if tied:
        layers.append(TiedLayerSpec("embed", EmbeddingPipe, model.tok_embeddings, forward_fn=pass_through,
                                    tied_weight_attr=["tok_embeddings.weight"]))
    else:
        layers.append(LayerSpec(HeadPipe, model.output))
    head, output = model.head, model.output

    def head_loss(h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return head(output, h, labels)

    pipe = PipelineModule(layers=layers, topology=state.grid.topology(), loss_fn=head_loss,
                          partition_method="parameters")
    if graphs is not None:
        graphs.set_slots(min(pipe.num_stages - pipe.stage_id, micro_batches))
    if tied and pipe.stage_id == pipe.num_stages - 1:
        pipe.tied_modules["embed"].serve_head(output)
    return pipe
