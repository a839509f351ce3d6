"""What the trainer does around blocks graphed by --enable-cuda-graph (torch.compile mode "reduce-overhead"):
gradients copied out of the graph pool, and the optimizer's gradient groups found once. The settings a capture
cannot run with are refused by megacoat.config.check_cuda_graph."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


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
    so a step that reads a flat partition finds them already flat (deepspeed_patches.py)."""
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
