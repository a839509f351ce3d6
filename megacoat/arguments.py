"""The command line: Megatron-LM-style flags parsed here, once, into a MegacoatConfig (no global args object)."""
from __future__ import annotations

import argparse
import copy
import re
import sys
from dataclasses import replace

from megacoat.config import (CUBLAS_WORKSPACES, MegacoatConfig, TrainingConfig, check_cuda_graph, check_zero3,
                             zero3_weight_cache)
from megacoat.data.config import DataConfig
from megacoat.coat.recipe import (ACTIVATION_MODES, ACTIVATION_SCALINGS, AUTO, DEFAULT_WEIGHT_CACHE, FP8_DTYPES,
                                  GRAD_SCALINGS, OUTPUT_LAYER_CHOICES, RECIPES, WEIGHT_CACHES, CoatRecipe)
from megacoat.model.config import ModelConfig
from megacoat.optim.config import DECAY_STYLES, MAIN_GRADS_DTYPES, MAIN_PARAMS_DTYPES, OptimizerConfig
from megacoat.parallel.config import SEQUENCE_PARALLEL_GATHERS, ZERO3_WEIGHT_GATHERS, ParallelConfig

# A negative number, scientific notation included (-1e-3, -.5, -2E+4): a value, never a flag. argparse's own
# pattern (`^-\d+$|^-\d*\.\d+$`) misses exponents and takes `--lr -1e-3` for a missing argument.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, once: flags without help text included (argparse's
    ArgumentDefaultsHelpFormatter skips those), help that already states a default left as it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.default is None:
            default = "not set"
        elif isinstance(action.default, bool):
            default = "on" if action.default else "off"
        elif isinstance(action.default, list):
            default = " ".join(map(str, action.default)) or "none"
        else:
            default = "%(default)s"
        return f"{text} (default: {default})".strip()

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings:  # argparse prints no help line at all for None
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with negative numbers in scientific notation accepted as values, so that `--lr -1e-3` reaches
    the range check and its message instead of "expected one argument"; without prefix matching (Megatron's
    choice: a typo such as `--num-layer 3` is an error, not --num-layers); and a bad flag is one `error:` line
    with exit status 1, as for every other user error (megacoat.training.errors), not a usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # the attribute argparse consults (3.10-3.13)

    def error(self, message: str):
        from megacoat.training.errors import EXIT_STATUS, error_line, prints_errors

        if prints_errors():  # under a launcher, one line per node, not one per rank
            print(error_line(ValueError(message)), file=sys.stderr, flush=True)
        sys.exit(EXIT_STATUS)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        description="Pretrain a Llama-style GPT with megacoat (DeepSpeed + COAT FP8). With no flags it trains a "
                    "tiny model on the Python standard library's source files.",
        formatter_class=HelpFormatter)
    d = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=d.num_layers)
    g.add_argument("--hidden-size", type=int, default=d.hidden_size)
    g.add_argument("--ffn-hidden-size", type=int, default=d.ffn_hidden_size)
    g.add_argument("--num-attention-heads", type=int, default=d.num_attention_heads)
    g.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention (default: heads)")
    g.add_argument("--seq-length", type=int, default=d.seq_length)
    g.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="model vocabulary; must be >= the tokenizer's (padded up is fine)")
    g.add_argument("--norm-epsilon", type=float, default=d.norm_eps)
    g.add_argument("--rotary-base", type=float, default=d.rope_theta)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=d.init_std)

    o = OptimizerConfig()
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=o.lr)
    g.add_argument("--min-lr", type=float, default=o.min_lr)
    g.add_argument("--lr-warmup-iters", type=int, default=o.lr_warmup_iters)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default=o.lr_decay_style)
    g.add_argument("--weight-decay", type=float, default=o.weight_decay)
    g.add_argument("--adam-beta1", type=float, default=o.adam_beta1)
    g.add_argument("--adam-beta2", type=float, default=o.adam_beta2)
    g.add_argument("--adam-eps", type=float, default=o.adam_eps)
    g.add_argument("--clip-grad", type=float, default=o.clip_grad)
    g.add_argument("--main-grads-dtype", choices=MAIN_GRADS_DTYPES, default=None,
                   help="dtype gradients are accumulated over micro-batches, reduced over data-parallel ranks and "
                        "read by the optimizer in (default: the run's precision, bf16 under --bf16)")
    g.add_argument("--main-params-dtype", choices=MAIN_PARAMS_DTYPES, default=o.main_params_dtype,
                   help="master weights: an fp32 copy, or bf16-remainder: none, CoatAdamW keeps the low 16 bits of "
                        "each fp32 master beside the bf16 weight (exact; needs --fp8-optimizer, bf16, ZeRO-1/2)")

    g = p.add_argument_group("FP8 (COAT)")
    g.add_argument("--fp8-recipe", choices=sorted(RECIPES), default=None,
                   help="named FP8 recipe the --fp8-* flags below override (default: coat with --coat-fp8, else bf16)")
    g.add_argument("--coat-fp8", action="store_true", help="the coat recipe: FP8 optimizer states and precision flow")
    g.add_argument("--fp8-optimizer", action="store_true", help="CoatAdamW: FP8 Adam moments")
    g.add_argument("--fp8-activations", nargs="?", const="coat", default=None, choices=ACTIVATION_MODES,
                   help="activation precision mode (flag alone: coat)")
    g.add_argument("--fp8-m-dtype", choices=FP8_DTYPES, default=None, help="CoatAdamW's first moment (default: e4m3)")
    g.add_argument("--fp8-v-dtype", choices=FP8_DTYPES, default=None, help="CoatAdamW's second moment (default: e4m3)")
    g.add_argument("--fp8-group-size", type=int, default=None, help="1xG quantization group (default: 128)")
    g.add_argument("--fp8-no-expansion", action="store_true", help="CoatAdamW without dynamic range expansion")
    g.add_argument("--fp8-grad-dtype", choices=FP8_DTYPES, default=None,
                   help="FP8 format of the gradients fed to backward GEMMs (default: e5m2)")
    g.add_argument("--fp8-weight-cache", choices=WEIGHT_CACHES, default=None,
                   help="FP8 weight copies kept between optimizer steps: W8 (rowwise), W8 and W8^T (step), or none "
                        f"(default: {DEFAULT_WEIGHT_CACHE}; none under --zero-stage 3)")
    g.add_argument("--fp8-fast-accum", action="store_true",
                   help="forward FP8 GEMMs accumulate without periodic fp32 promotion (backward always promotes)")
    g.add_argument("--fp8-output-layer", nargs="?", const="on", default=None, choices=OUTPUT_LAYER_CHOICES,
                   help="the vocabulary head in FP8; auto: on in coat mode where it runs (sizes, and "
                        "vocabulary slices under TP, multiples of 16) (default: auto)")
    g.add_argument("--fp8-grad-scaling", choices=(AUTO, *GRAD_SCALINGS), default=None,
                   help="FP8 gradients scaled by their own amax (current) or an amax history (delayed, coat mode); "
                        "auto: delayed in coat mode (default: auto)")
    g.add_argument("--fp8-activation-scaling", choices=(AUTO, *ACTIVATION_SCALINGS), default=None,
                   help="as --fp8-grad-scaling, for the FP8 outputs of the norms and SwiGLU and wo's input "
                        "(default: auto)")
    g.add_argument("--fp8-amax-history-len", type=int, default=None,
                   help="delayed scaling: how many calls (micro-batches) of amaxes set the scale (default: 16)")

    t = TrainingConfig()
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=t.micro_batch_size)
    g.add_argument("--global-batch-size", type=int, default=t.global_batch_size)
    g.add_argument("--train-iters", type=int, default=t.train_iters)
    g.add_argument("--seed", type=int, default=t.seed)
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="bf16 mixed precision (default on CUDA)")
    prec.add_argument("--fp32", action="store_true", help="fp32 everywhere (default on CPU)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (as torchtitan does); first steps are slower")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="--compile with CUDA graphs (each block's forward and backward replayed; under pipeline "
                        "parallelism once per micro-batch slot); CUDA only, not with --zero-stage 3")
    g.add_argument("--cublas-workspace", choices=CUBLAS_WORKSPACES, default=t.cublas_workspace,
                   help="none: cuBLAS without a workspace; default: torch's workspace; auto: none where FP8 GEMMs run, "
                        "unless CUBLASLT_WORKSPACE_SIZE or CUBLAS_WORKSPACE_CONFIG is set (auto is the default)")
    g.add_argument("--host-overflow-check", action="store_true",
                   help="bf16 ZeRO-1/2: skip a non-finite step by DeepSpeed's host check (which also holds the LR "
                        "schedule) instead of on the device (default: off, the device skips it)")
    g.add_argument("--log-interval", type=int, default=t.log_interval)
    g.add_argument("--log-json", default=None, help="append one JSON object per logged iteration to this file")
    g.add_argument("--eval-interval", type=int, default=t.eval_interval)
    g.add_argument("--eval-iters", type=int, default=t.eval_iters)
    g.add_argument("--save", default=None, help="checkpoint directory: DIR/iter_0000100/ per save, DIR/latest")
    g.add_argument("--load", default=None,
                   help="resume from DIR (its latest) or DIR/iter_N; no checkpoint there is an error unless DIR is "
                        "also --save (a job's first run)")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (default: with --save, at the end only)")
    g.add_argument("--keep-last", type=int, default=None, help="keep only the newest K checkpoints under --save")
    g.add_argument("--finetune", action="store_true",
                   help="--load only the weights: iteration, data position, optimizer and LR schedule start at zero")
    g.add_argument("--override-optimizer-state", choices=("convert",), default=None,
                   help="convert: --load another optimizer's state (AdamW <-> CoatAdamW, other FP8 moment "
                        "settings) by converting it")
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit when iteration %% N == 0")
    g.add_argument("--profile-dir", default=None,
                   help="write a torch.profiler Chrome trace and top operators per rank here, for iterations "
                        "(--profile-step-start, --profile-step-end]")
    g.add_argument("--profile-step-start", type=int, default=t.profile_step_start)
    g.add_argument("--profile-step-end", type=int, default=t.profile_step_end)
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="save and exit after this wall time")
    g.add_argument("--max-skipped-steps", type=int, default=t.max_skipped_steps,
                   help="stop after this many steps in a row skipped for a non-finite loss or gradient")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here (rank 0)")
    g.add_argument("--wandb-project", default=None, help="log to wandb (optional dependency; offline without "
                                                         "WANDB_API_KEY)")
    g.add_argument("--wandb-run-name", default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=t.distributed_timeout_minutes,
                   help="a collective waiting this long for a stopped or hung rank ends the run, in every process group")
    g.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error instead of its one `error:` line (also: "
                        "MEGACOAT_DEBUG=1)")

    pc = ParallelConfig()
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=pc.tensor_model_parallel_size)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=pc.pipeline_model_parallel_size)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--sequence-parallel-gather", default=pc.sequence_parallel_gather, choices=SEQUENCE_PARALLEL_GATHERS,
                   help="what a COAT block's sequence-parallel all-gather carries: bf16, or its input's 1xG E4M3 groups")
    g.add_argument("--zero-stage", type=int, default=pc.zero_stage, choices=(0, 1, 2, 3),
                   help="DeepSpeed ZeRO: 1 partitions optimizer states, 2 also gradients, 3 also weights")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="ZeRO-1/2: reduce each gradient bucket on a side stream as soon as backward has made it, "
                        "overlapping the rest of backward (off until measured on several GPUs)")
    g.add_argument("--zero3-weight-gather", default=pc.zero3_weight_gather, choices=ZERO3_WEIGHT_GATHERS,
                   help="what ZeRO-3's all-gather of the COAT blocks' GEMM weights carries: bf16, or E4M3 codes")

    dc = DataConfig()
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=[],
                   help="shard prefix, or weights and prefixes: 0.7 A 0.3 B (default: the embedded stdlib corpus)")
    g.add_argument("--split", default=dc.split)
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece .model file")
    g.add_argument("--data-cache-dir", default=None,
                   help="where the embedded corpus and dataset indices are kept (default: $MEGACOAT_CACHE or "
                        "~/.cache/megacoat)")
    g.add_argument("--num-workers", type=int, default=dc.num_workers)
    g.add_argument("--mock-data", action="store_true", help="random tokens instead of a corpus")

    g = p.add_argument_group("DeepSpeed launcher")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                   help="DeepSpeed JSON config; default: written from megacoat's flags")
    g.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)  # accepted for DeepSpeed habits
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def recipe_from_args(args: argparse.Namespace) -> CoatRecipe:
    """The named recipe (--fp8-recipe, else coat with --coat-fp8, else bf16) with the --fp8-* flags given on top,
    every auto resolved for the run's layout."""
    base = RECIPES[args.fp8_recipe or ("coat" if args.coat_fp8 else "bf16")]
    given = {"mode": args.fp8_activations, "m_dtype": args.fp8_m_dtype, "v_dtype": args.fp8_v_dtype,
             "group_size": args.fp8_group_size, "grad_dtype": args.fp8_grad_dtype,
             "weight_cache": args.fp8_weight_cache or zero3_weight_cache(args.zero_stage),
             "grad_scaling": args.fp8_grad_scaling,
             "activation_scaling": args.fp8_activation_scaling, "amax_history_len": args.fp8_amax_history_len,
             "output_layer": {"on": True, "off": False}.get(args.fp8_output_layer, args.fp8_output_layer),
             "optimizer": args.fp8_optimizer or args.coat_fp8 or None, "fast_accum": args.fp8_fast_accum or None,
             "expand": False if args.fp8_no_expansion else None}
    recipe = replace(base, **{k: v for k, v in given.items() if v is not None})
    return recipe.for_layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.vocab_size,
                             args.hidden_size)


def config_from_args(args: argparse.Namespace) -> MegacoatConfig:
    """Turn parsed flags into validated dataclasses. Errors name the flag."""
    fp8 = recipe_from_args(args)
    model = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        seq_length=args.seq_length, vocab_size=args.vocab_size, norm_eps=args.norm_epsilon,
        rope_theta=args.rotary_base, tie_embeddings=not args.untie_embeddings_and_output_weights,
        init_std=args.init_method_std)
    optim = OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        fp8_optimizer=fp8.optimizer, fp8_m_dtype=fp8.m_dtype, fp8_v_dtype=fp8.v_dtype,
        fp8_group_size=fp8.group_size, fp8_expand=fp8.expand,
        main_grads_dtype=args.main_grads_dtype, main_params_dtype=args.main_params_dtype)
    data = DataConfig(data_path=list(args.data_path), split=args.split, tokenizer_model=args.tokenizer_model,
                      cache_dir=args.data_cache_dir, num_workers=args.num_workers, mock_data=args.mock_data)
    pp = args.pipeline_model_parallel_size
    parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                              pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                              sequence_parallel=args.sequence_parallel, zero_stage=args.zero_stage,
                              zero3_weight_gather=args.zero3_weight_gather,
                              overlap_grad_reduce=args.overlap_grad_reduce,
                              sequence_parallel_gather=args.sequence_parallel_gather)
    precision = "bf16" if args.bf16 else "fp32" if args.fp32 else "auto"
    training = TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, seed=args.seed, precision=precision, log_interval=args.log_interval,
        log_json=args.log_json, eval_interval=args.eval_interval, eval_iters=args.eval_iters, save=args.save,
        load=args.load, save_interval=args.save_interval, deepspeed_config=args.deepspeed_config,
        keep_last=args.keep_last, exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        max_skipped_steps=args.max_skipped_steps, tensorboard_dir=args.tensorboard_dir,
        wandb_project=args.wandb_project, wandb_run_name=args.wandb_run_name,
        compile=args.compile or args.enable_cuda_graph, enable_cuda_graph=args.enable_cuda_graph,
        cublas_workspace=args.cublas_workspace,
        host_overflow_check=args.host_overflow_check,
        profile_dir=args.profile_dir, profile_step_start=args.profile_step_start,
        profile_step_end=args.profile_step_end, debug=args.debug, finetune=args.finetune,
        override_optimizer_state=args.override_optimizer_state,
        distributed_timeout_minutes=args.distributed_timeout_minutes)
    if precision == "fp32" and (optim.main_grads_dtype == "bf16" or optim.main_params_dtype == "bf16-remainder"):
        raise ValueError("--main-grads-dtype bf16 / --main-params-dtype bf16-remainder are bf16 training: drop --fp32")
    if optim.main_grads_dtype == "fp32" and precision != "fp32" and parallel.zero_stage == 0:
        raise ValueError("--main-grads-dtype fp32 in a bf16 run needs --zero-stage 1 or 2 (DeepSpeed accumulates bf16 "
                         "gradients in fp32 only in its ZeRO optimizers)")
    if parallel.overlap_grad_reduce and parallel.zero_stage == 1 and optim.main_grads_dtype == "fp32" \
            and precision != "fp32":
        raise ValueError("--overlap-grad-reduce does not support --main-grads-dtype fp32 with --zero-stage 1 in a bf16 "
                         "run (DeepSpeed then runs its BF16_Optimizer, which reduces after backward)")
    if optim.main_params_dtype == "bf16-remainder":
        if parallel.zero_stage not in (1, 2):
            raise ValueError("--main-params-dtype bf16-remainder needs --zero-stage 1 or 2 (DeepSpeed leaves the master "
                             "weights to the optimizer only in its ZeRO-1/2 optimizer)")
        if parallel.pipeline_model_parallel_size > 1:
            raise ValueError("--main-params-dtype bf16-remainder is not supported with --pipeline-model-parallel-size "
                             "> 1 (untested with DeepSpeed's pipeline engine)")
    if data.mock_data and data.data_path:
        raise ValueError("--mock-data and --data-path are exclusive")
    if training.enable_cuda_graph:
        check_cuda_graph(parallel)
    check_zero3(parallel, fp8)
    fp8.check_micro_batch(training.micro_batch_size, model.seq_length)
    return MegacoatConfig(model=model, optim=optim, data=data, fp8=fp8, parallel=parallel, training=training)


def parse_config(argv: list[str] | None = None) -> MegacoatConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
