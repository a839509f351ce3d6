"""convert_to_coat(model, recipe), the model converter, and after_optimizer_step(model), its upkeep.

The converter swaps modules of the plain GPT from outside and keeps every parameter object and name, so
checkpoints and optimizers see the same parameters. Per `recipe.mode`:
  * `bf16`:       nothing changes.
  * `fp8-linear`: every nn.Linear of the blocks becomes an Fp8Linear; a block's linears share one
                  Fp8InputCache, so wq/wk/wv (and w1/w3) quantize their input once.
  * `coat`:       each block becomes a CoatTransformerBlock, run by CoatLayers (megacoat.coat.flow).
The embedding stays in high precision; the output head becomes the FP8 head where `recipe.output_layer` says so
(megacoat.coat.head). Run it on the full model, before megacoat.parallel.apply_tp shards what it finds.

After each optimizer step and after a load, call after_optimizer_step(model): it rewrites the FP8 weight copies
in place (compiled forwards only read them) and makes the data-parallel replicas' amax histories agree.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from megacoat.coat.delayed_scaling import AmaxHistorySync
from megacoat.coat.flow import CoatLayers, CoatTransformerBlock
from megacoat.coat.head import Fp8Head
from megacoat.coat.linear import Fp8InputCache, Fp8Linear, persistent_weight_caches, refresh_fp8_weights
from megacoat.coat.recipe import CoatRecipe


def _check_linears(model: nn.Module) -> None:
    for name, mod in model.layers.named_modules():
        if hasattr(mod, "weight") and mod.weight.dim() == 2 and not isinstance(mod, nn.Linear):
            raise TypeError(f"convert_to_coat runs on the full model, before apply_tp: layers.{name} is a "
                            f"{type(mod).__name__}")
        if isinstance(mod, nn.Linear):
            for what, n in (("in_features", mod.in_features), ("out_features", mod.out_features)):
                if n % 16:
                    raise ValueError(f"FP8 mode needs every block linear's dims to be multiples of 16; "
                                     f"layers.{name}.{what} = {n}")


def convert_to_coat(model: nn.Module, recipe: CoatRecipe) -> nn.Module:
    """Convert `model` (a megacoat GPT, before any DeepSpeed wrapping) in place and return it."""
    if recipe.mode == "bf16":
        return model
    if not recipe.resolved:
        raise ValueError("convert_to_coat needs a resolved recipe: pass recipe.for_layout(...)")
    if not hasattr(model, "layers"):
        raise TypeError(f"convert_to_coat expects a megacoat GPT with .layers, got {type(model).__name__}")
    _check_linears(model)
    for i, block in enumerate(model.layers):
        if isinstance(block, CoatTransformerBlock):
            continue  # already converted: converting twice is a no-op
        if recipe.mode == "coat":
            model.layers[i] = CoatTransformerBlock(block, recipe)
        elif recipe.mode == "fp8-linear":
            shared = Fp8InputCache()
            block.register_forward_hook(shared.clear)  # a compiled forward's entry ends with the block
            for parent in block.modules():
                for child_name, child in list(parent.named_children()):
                    if type(child) is nn.Linear:
                        setattr(parent, child_name,
                                Fp8Linear(child, recipe.grad_dtype, shared, recipe.weight_cache, recipe.fast_accum))
        else:
            raise ValueError(f"unknown FP8 activation mode {recipe.mode!r}")
    if recipe.mode == "coat":
        model.layers = CoatLayers(model.layers)  # each block's output addition made by the next block's norm
    if recipe.output_layer and type(model.output) is nn.Linear:
        try:
            model.output = Fp8Linear(model.output, recipe.grad_dtype, None, recipe.weight_cache, recipe.fast_accum)
        except ValueError as e:  # a vocabulary or hidden size off the FP8 GEMM alignment
            raise ValueError(f"--fp8-output-layer: {e}") from None
        model.head = Fp8Head(model.head.ignore_index)  # with labels: the loss writes the logits' FP8 gradient
    return model


_UPKEEP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def after_optimizer_step(model: nn.Module, dp_group=None, dp_size: int = 1, cuda_graph: bool = False) -> None:
    """The FP8 upkeep after an optimizer step (or a checkpoint load) of `model`: every persistent FP8 weight copy
    re-quantized in place (as one CUDA graph once warm with cuda_graph: the weights' addresses must be fixed, as
    DeepSpeed's flat buffers keep them), then each amax history made the maximum over the data-parallel group
    (dp_group of dp_size ranks). The first call fixes the settings for that model."""
    upkeep = _UPKEEP.get(model)
    if upkeep is None:
        refresh = GraphedWeightRefresh(model) if cuda_graph else (lambda: refresh_fp8_weights(model))
        upkeep = _UPKEEP[model] = (refresh, AmaxHistorySync(model, dp_group, dp_size))
    for step in upkeep:
        step()


class GraphedWeightRefresh:
    """refresh_fp8_weights(model) replayed as one CUDA graph: the same kernels (a concatenation, an amax and a
    cast per FP8 weight copy, and the in-place copies) without a host launch
    each, which the host would issue after the optimizer step with the GPU idle.

    Sound because every address it touches is fixed for the run: DeepSpeed updates the weights in place (views of
    its flat buffers), and the copies are rewritten in place. The first calls run eagerly (they create the copies
    and warm up the kernels); the third is captured and replayed. A compiled forward reads the copies without
    checking them (the check is Python, which a replay does not run), as it does with the eager refresh."""

    WARMUP = 2

    def __init__(self, model: nn.Module):
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
