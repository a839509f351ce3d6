"""convert_to_fp8(model, fp8_config): the model converter for the FP8 activation modes (torchtitan-style).

It swaps modules of the plain model from outside and keeps every parameter object and name, so checkpoints
and an optimizer built before or after see the same parameters:
  * `bf16`:       nothing changes.
  * `fp8-linear`: every nn.Linear inside the transformer blocks becomes an Fp8Linear (FP8 GEMMs, the FP8
                  input saved); norms, SwiGLU and attention stay in the activation dtype. The linears of a
                  block share one Fp8InputCache, so wq/wk/wv (and w1/w3) quantize and save their input once.
  * `coat`:       each TransformerBlock becomes a CoatTransformerBlock (the full FP8 precision flow), and the
                  blocks run through run_coat_layers (each block's output addition made by the next one's norm).
The embedding stays in high precision in every mode, and so does the output head in FP8Config's default (as in
COAT and TransformerEngine): the vocabulary need not meet FP8 GEMM alignment, and the logits feed a softmax over
~1e4-1e5 classes. `FP8Config.output_layer` (--fp8-output-layer on, or auto, the trainer's default, in coat mode where
the FP8 head runs: megacoat.fp8.config.resolve_output_layer) makes the head an Fp8Linear too, sharing its weight
(with the embedding's, where they are tied): its GEMMs are the step's largest BF16 ones. With labels the model then
runs it through `model.head_loss` (megacoat.fp8.head_loss), whose loss writes the logits' gradient in FP8 itself.

It is the one way FP8 is applied, with or without tensor parallelism: it runs on the full model, before
megacoat.parallel.apply_tp shards whatever it finds (as torchtitan converts to float8 before apply_tp).

After an optimizer step, call megacoat.fp8.linear.refresh_fp8_weights(model): it rewrites the FP8 weight copies
in place, which compiled forwards need (they only read them). Eager forwards also notice in-place updates by
themselves, and writes behind autograd's back (`param.data`) after invalidate_fp8_weight_caches().
"""
from __future__ import annotations

from torch import nn

from megacoat.fp8.blocks import CoatTransformerBlock, run_coat_layers
from megacoat.fp8.config import FP8Config
from megacoat.fp8.head_loss import fp8_head_loss
from megacoat.fp8.linear import Fp8InputCache, Fp8Linear


def _check_linears(model: nn.Module) -> None:
    for name, mod in model.layers.named_modules():
        if hasattr(mod, "weight") and mod.weight.dim() == 2 and not isinstance(mod, nn.Linear):
            raise TypeError(f"convert_to_fp8 runs on the full model, before apply_tp: layers.{name} is a "
                            f"{type(mod).__name__}")
        if isinstance(mod, nn.Linear):
            for what, n in (("in_features", mod.in_features), ("out_features", mod.out_features)):
                if n % 16:
                    raise ValueError(f"FP8 mode needs every block linear's dims to be multiples of 16; "
                                     f"layers.{name}.{what} = {n}")


def convert_to_fp8(model: nn.Module, fp8: FP8Config) -> nn.Module:
    """Convert `model` (a megacoat GPT, before any DeepSpeed wrapping) in place and return it."""
    if fp8.mode == "bf16":
        return model
    if not hasattr(model, "layers"):
        raise TypeError(f"convert_to_fp8 expects a megacoat GPT with .layers, got {type(model).__name__}")
    _check_linears(model)
    for i, block in enumerate(model.layers):
        if isinstance(block, CoatTransformerBlock):
            continue  # already converted: converting twice is a no-op
        if fp8.mode == "coat":
            model.layers[i] = CoatTransformerBlock(block, fp8)
        elif fp8.mode == "fp8-linear":
            shared = Fp8InputCache()
            block.register_forward_hook(shared.clear)  # a compiled forward's entry ends with the block
            for parent in block.modules():
                for child_name, child in list(parent.named_children()):
                    if type(child) is nn.Linear:
                        setattr(parent, child_name,
                                Fp8Linear(child, fp8.grad_dtype, shared, fp8.weight_cache, fp8.fast_accum))
        else:
            raise ValueError(f"unknown FP8 activation mode {fp8.mode!r}")
    if fp8.mode == "coat":
        model.run_layers = run_coat_layers  # each block's output addition made by the next block's norm
    if fp8.output_layer and type(model.output) is nn.Linear:
        try:
            model.output = Fp8Linear(model.output, fp8.grad_dtype, None, fp8.weight_cache, fp8.fast_accum)
        except ValueError as e:  # a vocabulary or hidden size off the FP8 GEMM alignment
            raise ValueError(f"--fp8-output-layer: {e}") from None
        model.head_loss = fp8_head_loss  # with labels: the loss writes the logits' gradient in FP8 itself
    return model
