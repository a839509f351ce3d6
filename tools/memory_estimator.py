"""Estimate per-GPU memory of a megacoat run before launching it: weights, gradients, optimizer states and
activations in bf16, fp8-linear and coat modes (the model in megacoat/training/memory.py).

    python tools/memory_estimator.py --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 \
        --num-attention-heads 32 --seq-length 4096 --vocab-size 32000 --micro-batch-size 1 \
        --data-parallel-size 8 --zero-stage 1            # prints all three modes, AdamW and CoatAdamW
    python tools/memory_estimator.py ... --zero-stage 1 --main-params-dtype bf16-remainder   # CoatAdamW, no fp32 master

"step" is the gradient copy the optimizer step makes (it replaces the activations at the peak, never adds to them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacoat.coat.recipe import (DEFAULT_OUTPUT_LAYER, DEFAULT_WEIGHT_CACHE, OUTPUT_LAYER_CHOICES,  # noqa: E402
                                  WEIGHT_CACHES, CoatRecipe)
from megacoat.model.config import ModelConfig  # noqa: E402
from megacoat.optim.config import default_main_params_dtype  # noqa: E402
from megacoat.training.memory import MAIN_GRADS_DTYPES, MAIN_PARAMS_DTYPES, MODES, estimate_memory  # noqa: E402

GiB = 2**30


def build_parser() -> argparse.ArgumentParser:
    d = ModelConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--ffn-hidden-size", type=int, default=d.ffn_hidden_size)
    p.add_argument("--num-attention-heads", type=int, default=d.num_attention_heads)
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=d.seq_length)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--fp8-group-size", type=int, default=128)
    p.add_argument("--fp8-weight-cache", choices=WEIGHT_CACHES, default=None,
                   help=f"as training: default {DEFAULT_WEIGHT_CACHE}, none under --zero-stage 3")
    p.add_argument("--mode", choices=MODES, default=None, help="one activation mode (default: all three)")
    p.add_argument("--fp8-optimizer", action="store_true", help="CoatAdamW only (default: AdamW and CoatAdamW)")
    p.add_argument("--main-grads-dtype", choices=MAIN_GRADS_DTYPES, default="bf16")
    p.add_argument("--main-params-dtype", choices=MAIN_PARAMS_DTYPES, default=None,
                   help="bf16-remainder: CoatAdamW's remainders instead of the fp32 master (CoatAdamW rows only); "
                        "default: as training, the remainders where they run (CoatAdamW, ZeRO-1/2, no pipeline, "
                        "bf16 main gradients), else fp32")
    p.add_argument("--compile", action="store_true",
                   help="activations of compiled blocks and loss (--compile / --enable-cuda-graph runs)")
    p.add_argument("--graphed-accumulation", action="store_true",
                   help="--enable-cuda-graph runs with more than one micro-batch a step (their gradients are copied out "
                        "of the graph pool after the first micro-batch and lie flat: ZeRO-1 on one rank reads them "
                        "in place)")
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="as training: DeepSpeed's two smaller reduction buckets instead of its one")
    p.add_argument("--fp8-output-layer", nargs="?", const="on", default=DEFAULT_OUTPUT_LAYER,
                   choices=OUTPUT_LAYER_CHOICES,
                   help="the output layer in FP8 too (its input saved as E4M3, its weight cached like the block "
                        "linears'), as training takes the flag: auto (default): in the coat rows without TP or PP "
                        "and with vocabulary and hidden sizes multiples of 16; on (the flag alone): in every FP8 "
                        "mode's rows; off: in no row")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                          num_query_groups=args.num_query_groups, seq_length=args.seq_length,
                          vocab_size=args.vocab_size, tie_embeddings=not args.untie_embeddings_and_output_weights)
        rows = []
        for mode in [args.mode] if args.mode else MODES:
            only_coat = args.fp8_optimizer or args.main_params_dtype == "bf16-remainder"
            for fp8_opt in [True] if only_coat else [False, True]:
                master = args.main_params_dtype or default_main_params_dtype(
                    fp8_opt, True, args.zero_stage, args.pipeline_model_parallel_size, args.main_grads_dtype)
                head = {"on": True, "off": False}.get(args.fp8_output_layer, args.fp8_output_layer)
                fp8_head = mode != "bf16" and CoatRecipe(mode=mode, output_layer=head).for_layout(
                    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, cfg.vocab_size,
                    cfg.hidden_size).output_layer
                est = estimate_memory(cfg, mode, micro_batch_size=args.micro_batch_size,
                                      data_parallel_size=args.data_parallel_size, zero_stage=args.zero_stage,
                                      tensor_parallel_size=args.tensor_model_parallel_size,
                                      pipeline_parallel_size=args.pipeline_model_parallel_size,
                                      fp8_optimizer=fp8_opt, fp8_group_size=args.fp8_group_size,
                                      fp8_weight_cache=args.fp8_weight_cache or (
                                          "none" if args.zero_stage == 3 else DEFAULT_WEIGHT_CACHE),
                                      main_grads_dtype=args.main_grads_dtype,
                                      main_params_dtype=master, compiled=args.compile,
                                      graphed_accumulation=args.graphed_accumulation,
                                      overlap_grad_reduce=args.overlap_grad_reduce,
                                      fp8_output_layer=fp8_head)
                rows.append({"mode": mode, "optimizer_class": "CoatAdamW" if fp8_opt else "AdamW",
                             "main_params_dtype": master, "fp8_output_layer": fp8_head, **est.as_dict()})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"parameters": cfg.num_parameters(), "estimates": rows}, indent=1))
        return 0
    print(f"{cfg.num_parameters() / 1e9:.3f} B parameters; micro-batch {args.micro_batch_size} x {cfg.seq_length} "
          f"tokens; TP {args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size} "
          f"DP {args.data_parallel_size} ZeRO-{args.zero_stage}  (GiB per GPU)")
    fp8_head_modes = ", ".join(dict.fromkeys(r["mode"] for r in rows if r["fp8_output_layer"])) or "none"
    print(f"main grads {args.main_grads_dtype}, main params "
          f"{args.main_params_dtype or 'default (bf16-remainder for CoatAdamW where it runs, else fp32)'}; "
          f"the output layer in FP8 (--fp8-output-layer {args.fp8_output_layer}): {fp8_head_modes}")
    print(f"{'mode':<11} {'optimizer':<10} {'weights':>8} {'grads':>8} {'optim':>8} {'activ.':>8} {'step':>8} "
          f"{'total':>8}")
    for r in rows:
        print(f"{r['mode']:<11} {r['optimizer_class']:<10} " + " ".join(
            f"{r[k] / GiB:>8.2f}" for k in ("weights", "gradients", "optimizer", "activations", "step_gradients",
                                            "total")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
