"""ZeRO-3 (DeepSpeed's stage 3) and the modules that read weights they do not own.

Under ZeRO-3 each weight lives partitioned over the data-parallel ranks and is all-gathered by forward and
backward hooks on the module that owns it, just before that module runs. COAT's fused block functions read the
weights of wq/wk/wv, w1/w3/w2 and the two norms, whose modules never run (the block calls the fused functions with
their weights); the FP8 head reads `output.weight` likewise. `register_read_weights` tells DeepSpeed that the
running module (the block, the head) uses them, so its hooks gather them for its forward and its backward.
"""
from __future__ import annotations

import contextlib

from torch import nn

from megacoat.coat.flow import CoatTransformerBlock
from megacoat.coat.head import Fp8Head


def weights_read_outside_their_module(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """(reader, weight) pairs: every weight of a COAT block except those of the submodules that run (wo, an
    Fp8Linear called by the block), and the output projection's weight under the FP8 head."""
    pairs = []
    for block in model.modules():
        if isinstance(block, CoatTransformerBlock):
            running = {id(p) for p in block.attention.wo.parameters()}
            pairs += [(block, p) for p in block.parameters() if id(p) not in running]
    head, output = getattr(model, "head", None), getattr(model, "output", None)
    if isinstance(head, Fp8Head) and output is not None:
        pairs.append((head, output.weight))
    return pairs


def register_read_weights(model: nn.Module) -> int:
    """Register each weight of weights_read_outside_their_module with DeepSpeed as an external parameter of its
    reader (deepspeed.zero.register_external_parameter); returns how many. DeepSpeed would otherwise find them
    only when an eager forward touches them, never under torch.compile, and gather them one by one."""
    import deepspeed

    pairs = weights_read_outside_their_module(model)
    for reader, weight in pairs:
        deepspeed.zero.register_external_parameter(reader, weight)
    return len(pairs)


def gathered(module: nn.Module, zero_stage: int):
    """A context in which `module`'s weights are whole on this rank (read-only): DeepSpeed's GatheredParameters
    under ZeRO-3, nothing to do otherwise."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
