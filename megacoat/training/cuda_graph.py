"""--enable-cuda-graph: which settings CUDA graphs support (checked before any work), and the two things the
trainer does around the graphed blocks: gradients copied out of the graph pool, and the FP8 weight refresh as a
graph of its own.

The blocks are compiled with torch.compile's mode "reduce-overhead" (cudagraph trees: each block's forward and
backward are captured after warm-up and replayed from a private memory pool, so a step launches one graph per
block instead of its kernels one by one). That needs what a graph replay cannot change: a CUDA device, static
shapes (the trainer's micro-batches all have one shape), and no host work inside the block (the FP8 weight copies
are refreshed in place outside the blocks' graphs, after each optimizer step: GraphedWeightRefresh). DeepSpeed's pipeline engine
runs its own schedule of partial forwards and sends between stages, which this capture does not cover: refused.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megacoat.parallel.config import ParallelConfig


def check_cuda_graph(parallel: ParallelConfig, cuda_available: bool | None = None) -> None:
    """Raise ValueError naming the flag for a setting CUDA graphs cannot run with."""
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        raise ValueError("--enable-cuda-graph needs a CUDA device (CUDA graphs replay GPU work; none is available)")
    if parallel.pipeline_model_parallel_size > 1:
        raise ValueError("--enable-cuda-graph does not support --pipeline-model-parallel-size > 1 (DeepSpeed's "
                         f"pipeline schedule is not captured), got {parallel.pipeline_model_parallel_size}")


def own_graph_gradients(groups: Iterable[Iterable[nn.Parameter]]) -> int:
    """Copy parameter gradients out of the CUDA-graph memory pool; returns how many were copied.

    A graphed backward writes its gradients into the pool, and the next micro-batch's replay writes there again.
    Autograd's first accumulation into an empty .grad adopts the fresh gradient instead of copying it, so after
    the first micro-batch of a step .grad is pool memory (cudagraph trees then refuse the next accumulation:
    "accessing tensor output of CUDAGraphs that has been overwritten"). One copy after the first micro-batch
    gives .grad memory of its own; later micro-batches add into it in place. With one micro-batch per step the
    optimizer step reads the gradients before any replay, and nothing needs copying.

    `groups`: the parameters grouped and ordered as the optimizer's step lists their gradients
    (`gradient_groups`). Each group's gradients are copied by one concatenation into one buffer, in that order,
    so a step that reads a flat partition finds them already flat (zero_flat_grads.py)."""
    copied = 0
    for group in groups:
        params = [p for p in group if p.grad is not None]
        if not params:
            continue
        if len({(p.grad.dtype, p.grad.device) for p in params}) > 1:  # no one buffer for them: one copy each
            for p in params:
                p.grad = p.grad.clone()
            copied += len(params)
            continue
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n
        copied += len(params)
    return copied


def gradient_groups(engine) -> list[list[nn.Parameter]]:
    """Every parameter of the engine's module, grouped and ordered as its ZeRO-1/2 optimizer lists their
    gradients at the step (DeepSpeed's `bit16_groups`: with one data-parallel rank, each group's partition is the
    whole group in this order); parameters no group holds come last, as one more group."""
    groups = [list(g) for g in getattr(engine.optimizer, "bit16_groups", None) or []]
    held = {id(p) for g in groups for p in g}
    rest = [p for p in engine.module.parameters() if id(p) not in held]
    return groups + [rest] if rest else groups


class GraphedWeightRefresh:
    """refresh_fp8_weights(model) replayed as one CUDA graph: the same kernels (a concatenation, an amax and a
    cast per FP8 weight copy, and the in-place copies) without a host launch each, ~6 per copy and ~600 per step
    for a 24-layer model, which the host would issue after the optimizer step with the GPU idle.

    Sound because every address it touches is fixed for the run: DeepSpeed updates the weights in place (views of
    its flat buffers), and the copies are rewritten in place. The first calls run eagerly (they create the copies
    and warm up the kernels); the third is captured and replayed. A compiled forward reads the copies without
    checking them (the check is Python, which a replay does not run), as it does with the eager refresh."""

    WARMUP = 2

    def __init__(self, model: nn.Module):
        from megacoat.fp8.linear import persistent_weight_caches, refresh_fp8_weights

        self.model, self._refresh = model, refresh_fp8_weights
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.has_copies = any(True for _ in persistent_weight_caches(model))

    def __call__(self) -> None:
        if not self.has_copies:  # bf16 blocks or --fp8-weight-cache none: nothing to refresh (nor to capture)
            return
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
        elif self.calls <= self.WARMUP:
            stream = torch.cuda.Stream()  # warm-up on a side stream, as capture runs on one
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._refresh(self.model)
            torch.cuda.current_stream().wait_stream(stream)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records the kernels without running them
                self._refresh(self.model)
            self.graph = graph
            graph.replay()
