"""Model and engine construction: the plain GPT, then the converters applied to it from outside (FP8, tensor
parallelism, the pipeline split), then the optimizer and the DeepSpeed engine around it."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megacoat.coat.convert import convert_to_coat
from megacoat.config import MegacoatConfig
from megacoat.model import GPT, cross_entropy_loss
from megacoat.model.gpt import Head, RMSNorm
from megacoat.optim import WarmupDecayLR, build_optimizer, param_groups
from megacoat.parallel import ParallelState, apply_tp
from megacoat.training.zero3 import register_read_weights

ModelConverter = Callable[[nn.Module], nn.Module]


def build_model(cfg: MegacoatConfig, device: torch.device, state: ParallelState | None = None,
                model_converter: ModelConverter | None = None) -> nn.Module:
    """The model this rank trains: the plain GPT, FP8-converted (`convert_to_coat`), then sharded over TP
    (`apply_tp`) and, with pipelining, wrapped as this stage's deepspeed PipelineModule (which moves only its
    layers to `device`).

    model_converter: a function applied after megacoat's own converters and before compilation, which swaps
    modules from outside as they do; how a benchmark trains another library's conversion through this same
    trainer (`benchmarks/e2e/torchao_pretrain.py`: torchao's float8 linears) without the library knowing it."""
    # Same seed on every rank: data-parallel replicas start identical (DeepSpeed also broadcasts rank 0's) and
    # every TP rank holds the same full weights before slicing its shard, so TP=N starts as TP=1 does.
    torch.manual_seed(cfg.training.seed)
    pipelined = state is not None and state.pp_size > 1
    # Initialise where the model will live (a large model's normal_ is slow on the CPU); a pipeline
    # is built on the CPU and each stage moves only its own layers.
    with torch.device("cpu" if pipelined else device):
        model = GPT(cfg.model)
    model = convert_to_coat(model, cfg.fp8)  # on the full model: apply_tp then shards the FP8 modules
    if state is not None:
        model = apply_tp(model, state)
    if model_converter is not None:
        model = model_converter(model)
    if cfg.parallel.zero_stage == 3:
        register_read_weights(model)  # gathered by the modules that read them (training/zero3.py)
    graphed = cfg.training.enable_cuda_graph
    if cfg.training.compile:  # a pipeline stage captures its compiled blocks itself (per micro-batch slot)
        apply_compile(model, cuda_graph=graphed and not pipelined)
    if pipelined:
        from megacoat.parallel.pipeline import build_pipeline

        micro_batches = cfg.training.gradient_accumulation_steps(state.dp_size)
        return build_pipeline(model, state, micro_batches, cuda_graph=graphed)
    return model.to(device)


def apply_compile(model: nn.Module, cuda_graph: bool = False) -> None:
    """torch.compile each transformer block (as torchtitan does: one graph reused by every layer), the final norm
    and the loss. Compiled, the fp32 cross-entropy is fused with its cast: backward keeps the bf16 logits instead
    of the fp32 log-softmax, and the final norm keeps its bf16 input instead of fp32 copies, in a few launches
    instead of ~15 over the whole activation. A tensor-parallel model keeps its vocab-parallel loss.

    Every activation mode compiles a block as one graph (no graph break): the FP8 flow's kernels are megacoat::
    operators that torch.compile traces through. Compiled FP8 forwards read the FP8 weight copies without checking
    them: call megacoat.coat.linear.refresh_fp8_weights(model) once the weights are final (the trainer does, after
    building the engine, after each optimizer step and after loading a checkpoint).

    cuda_graph (--enable-cuda-graph without a pipeline): the blocks compile in mode "reduce-overhead" (cudagraph
    trees, see megacoat.training.cuda_graph); the loss stays in the default mode. A pipeline stage's schedule holds
    several micro-batches in flight, which one graph per block cannot serve: its compiled blocks are captured per
    micro-batch slot instead (megacoat.parallel.stage_graphs)."""
    for block in model.layers:
        block.compile(mode="reduce-overhead" if cuda_graph else None)
    if type(getattr(model, "norm", None)) is RMSNorm:  # the final norm (under TP, ParallelRMSNorm stays eager)
        model.norm.compile()
    if type(getattr(model, "head", None)) is Head and model.head.loss_fn is cross_entropy_loss:
        model.head = Head(torch.compile(cross_entropy_loss))


def build_engine(cfg: MegacoatConfig, model: nn.Module, ds_config: dict, device: torch.device,
                 state: ParallelState | None = None):
    """The DeepSpeed engine with megacoat's optimizer (AdamW or CoatAdamW) and LR schedule as client objects:
    a PipelineEngine for a PipelineModule (its own grid is the mpu), else the plain engine with the parallel
    state's grid as mpu (tensor-parallel grad norms and checkpoint shards). Returns (engine, scheduler)."""
    import deepspeed

    optimizer = build_optimizer(param_groups(model, cfg.optim.weight_decay), cfg.optim, device)
    pipelined = state is not None and state.pp_size > 1
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, dist_init_required=False,
        mpu=None if pipelined or state is None else state.mpu,
        lr_scheduler=lambda opt: WarmupDecayLR(opt, cfg.optim, cfg.training.train_iters))
    return engine, scheduler
