"""The command line: Megatron-LM-style flags parsed here, once, into a MegacoatConfig (no global args object)."""
from __future__ import annotations

import argparse
import copy
import re

from megacoat.config import MegacoatConfig
from megacoat.data.config import DataConfig
from megacoat.fp8.config import (ACTIVATION_MODES, ACTIVATION_SCALINGS, AUTO, DEFAULT_OUTPUT_LAYER, FP8_DTYPES,
                                 GRAD_SCALINGS, OUTPUT_LAYER_CHOICES, WEIGHT_CACHES, FP8Config, fp8_head_obstacle,
                                 resolve_output_layer, resolve_scaling)
from megacoat.model.config import ModelConfig
from megacoat.optim.config import DECAY_STYLES, MAIN_GRADS_DTYPES, MAIN_PARAMS_DTYPES, OptimizerConfig
from megacoat.parallel.config import ParallelConfig
from megacoat.training.config import CUBLAS_WORKSPACES, TrainingConfig
from megacoat.training.cuda_graph import check_cuda_graph

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
    the range check and its message instead of "expected one argument"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # the attribute argparse consults (3.10-3.13)


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
    g.add_argument("--coat-fp8", action="store_true",
                   help="COAT: FP8 optimizer states (CoatAdamW) and the FP8 activation precision flow")
    g.add_argument("--fp8-optimizer", action="store_true", help="CoatAdamW: FP8 Adam moments")
    g.add_argument("--fp8-activations", nargs="?", const="coat", default=None, choices=ACTIVATION_MODES,
                   help="activation precision mode (flag alone: coat)")
    g.add_argument("--fp8-m-dtype", choices=FP8_DTYPES, default=o.fp8_m_dtype)
    g.add_argument("--fp8-v-dtype", choices=FP8_DTYPES, default=o.fp8_v_dtype)
    g.add_argument("--fp8-group-size", type=int, default=o.fp8_group_size)
    g.add_argument("--fp8-no-expansion", action="store_true", help="CoatAdamW without dynamic range expansion")
    g.add_argument("--fp8-grad-dtype", choices=FP8_DTYPES, default=FP8Config().grad_dtype)
    g.add_argument("--fp8-weight-cache", choices=WEIGHT_CACHES, default=FP8Config().weight_cache,
                   help="rowwise (the default): keep the FP8 weight copy W8 from one optimizer step to the next "
                        "(+1 byte per block-linear parameter) and transpose its bytes in backward; step: keep W8^T "
                        "too (+2 bytes, no transpose; the same results); none: make them per use (less memory, "
                        "slower)")
    g.add_argument("--fp8-fast-accum", action="store_true",
                   help="forward FP8 GEMMs accumulate without the tensor cores' periodic fp32 promotion (less "
                        "exact; TransformerEngine's and torchao's forward default; no gain measured for the 1.3 B "
                        "model on an H100); backward GEMMs always promote")
    g.add_argument("--fp8-output-layer", nargs="?", const="on", default=DEFAULT_OUTPUT_LAYER,
                   choices=OUTPUT_LAYER_CHOICES,
                   help="the output layer (vocabulary head) in FP8 too: current scaling, the loss writing the logits' "
                        "FP8 gradient and the label entries' rounding error, added back in float32 (~2%% faster "
                        "steps for a 1.3 B model on an H100; final loss against bf16 at 350 M +0.23%% [-0.01, "
                        "+0.47] over 24 same-card seed pairs, the BF16 head's -0.13%% [-0.48, +0.21]). auto "
                        "(default): on in coat mode without tensor or pipeline parallelism and with vocabulary and "
                        "hidden sizes multiples of 16, off elsewhere; on (the flag alone); off: the head in BF16, as "
                        "COAT, Megatron and torchtitan keep it")
    g.add_argument("--fp8-grad-scaling", choices=(AUTO, *GRAD_SCALINGS), default=AUTO,
                   help="auto (default): delayed in coat mode without pipeline parallelism, current otherwise; "
                        "current: every FP8 gradient scaled by its own amax; delayed (coat mode): SwiGLU's and the "
                        "[q|k|v] output's gradients scaled by the largest amax of their last --fp8-amax-history-len "
                        "backward calls, recording their own in the same pass (TransformerEngine's delayed scaling: "
                        "one pass of SwiGLU's backward instead of two, and RoPE's backward writes the FP8 [q|k|v] "
                        "gradient without a BF16 copy; values beyond the history's amax saturate)")
    g.add_argument("--fp8-activation-scaling", choices=(AUTO, *ACTIVATION_SCALINGS), default=AUTO,
                   help="auto (default): delayed in coat mode without pipeline parallelism, current otherwise; "
                        "current: every FP8 activation scaled by its own amax; delayed (coat mode): the FP8 outputs of "
                        "RMSNorm and SwiGLU and wo's input (attention's output) scaled by the largest amax of their "
                        "last --fp8-amax-history-len forwards with gradients, each cast in one pass that also records "
                        "its amax (one launch instead of two; values beyond the history's amax saturate; evaluation "
                        "scales just in time)")
    g.add_argument("--fp8-amax-history-len", type=int, default=FP8Config().amax_history_len,
                   help="delayed scaling: how many calls (micro-batches) of amaxes set the scale")

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
                   help="--compile with CUDA graphs: each block compiled in mode reduce-overhead (cudagraph trees: "
                        "replayed forward and backward, static shapes, a private memory pool); CUDA, no pipeline")
    g.add_argument("--cublas-workspace", choices=CUBLAS_WORKSPACES, default=t.cublas_workspace,
                   help="none: cuBLAS and cuBLASLt without a workspace (CUBLASLT_WORKSPACE_SIZE=0, "
                        "CUBLAS_WORKSPACE_CONFIG=:0:0): Hopper's FP8 GEMMs then run statically scheduled, without "
                        "a workspace memset before each; default: torch's workspace; auto (default): none where "
                        "FP8 GEMMs run (--coat-fp8, --fp8-activations fp8-linear) unless either variable is set")
    g.add_argument("--host-overflow-check", action="store_true",
                   help="bf16 ZeRO-1/2: refuse a step with a non-finite gradient norm by DeepSpeed's host check, "
                        "which also holds the LR schedule, instead of on the device (default: the optimizer skips "
                        "the step on a device flag, the GPU never waits for the host, the schedule moves on)")
    g.add_argument("--log-interval", type=int, default=t.log_interval)
    g.add_argument("--log-json", default=None, help="append one JSON object per logged iteration to this file")
    g.add_argument("--eval-interval", type=int, default=t.eval_interval)
    g.add_argument("--eval-iters", type=int, default=t.eval_iters)
    g.add_argument("--save", default=None, help="checkpoint directory: DIR/iter_0000100/ per save, DIR/latest")
    g.add_argument("--load", default=None,
                   help="resume from the --save directory DIR (its latest) or from DIR/iter_N; with no checkpoint "
                        "there it is an error, unless it is also the --save directory (a job's first run)")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (default: with --save, at the end only)")
    g.add_argument("--keep-last", type=int, default=None, help="keep only the newest K checkpoints under --save")
    g.add_argument("--finetune", action="store_true",
                   help="--load only the weights: iteration, data position, optimizer and LR schedule start at zero")
    g.add_argument("--override-optimizer-state", choices=("convert",), default=None,
                   help="convert: --load a checkpoint of another optimizer (AdamW <-> --fp8-optimizer, other "
                        "--fp8-m-dtype/--fp8-v-dtype/--fp8-group-size/--fp8-no-expansion) by converting its state")
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit when iteration %% N == 0")
    g.add_argument("--profile-dir", default=None,
                   help="torch.profiler over iterations (--profile-step-start, --profile-step-end]: a Chrome trace "
                        "and the top operators by device time per rank, written here")
    g.add_argument("--profile-step-start", type=int, default=t.profile_step_start)
    g.add_argument("--profile-step-end", type=int, default=t.profile_step_end)
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="save and exit after this wall time")
    g.add_argument("--max-skipped-steps", type=int, default=t.max_skipped_steps,
                   help="stop after this many steps in a row skipped for a non-finite loss or gradient")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here (rank 0)")
    g.add_argument("--wandb-project", default=None, help="log to wandb (optional dependency; offline without "
                                                         "WANDB_API_KEY)")
    g.add_argument("--wandb-run-name", default=None)
    g.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error instead of its one `error:` line (also: "
                        "MEGACOAT_DEBUG=1)")

    pc = ParallelConfig()
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=pc.tensor_model_parallel_size)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=pc.pipeline_model_parallel_size)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--zero-stage", type=int, default=pc.zero_stage, choices=(0, 1, 2))

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


def config_from_args(args: argparse.Namespace) -> MegacoatConfig:
    """Turn parsed flags into validated dataclasses. Errors name the flag."""
    fp8_activations = args.fp8_activations or ("coat" if args.coat_fp8 else "bf16")
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
        fp8_optimizer=args.fp8_optimizer or args.coat_fp8, fp8_m_dtype=args.fp8_m_dtype,
        fp8_v_dtype=args.fp8_v_dtype, fp8_group_size=args.fp8_group_size, fp8_expand=not args.fp8_no_expansion,
        main_grads_dtype=args.main_grads_dtype, main_params_dtype=args.main_params_dtype)
    data = DataConfig(data_path=list(args.data_path), split=args.split, tokenizer_model=args.tokenizer_model,
                      cache_dir=args.data_cache_dir, num_workers=args.num_workers, mock_data=args.mock_data)
    pp = args.pipeline_model_parallel_size
    fp8 = FP8Config(mode=fp8_activations, grad_dtype=args.fp8_grad_dtype, group_size=args.fp8_group_size,
                    weight_cache=args.fp8_weight_cache, fast_accum=args.fp8_fast_accum,
                    grad_scaling=resolve_scaling(args.fp8_grad_scaling, fp8_activations, pp),
                    activation_scaling=resolve_scaling(args.fp8_activation_scaling, fp8_activations, pp),
                    amax_history_len=args.fp8_amax_history_len,
                    output_layer=resolve_output_layer(args.fp8_output_layer, fp8_activations,
                                                      args.tensor_model_parallel_size, pp, args.vocab_size,
                                                      args.hidden_size))
    parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                              pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                              sequence_parallel=args.sequence_parallel, zero_stage=args.zero_stage)
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
        override_optimizer_state=args.override_optimizer_state)
    if precision == "fp32" and (optim.main_grads_dtype == "bf16" or optim.main_params_dtype == "bf16-remainder"):
        raise ValueError("--main-grads-dtype bf16 / --main-params-dtype bf16-remainder are bf16 training: drop --fp32")
    if optim.main_grads_dtype == "fp32" and precision != "fp32" and parallel.zero_stage == 0:
        raise ValueError("--main-grads-dtype fp32 in a bf16 run needs --zero-stage 1 or 2 (DeepSpeed accumulates bf16 "
                         "gradients in fp32 only in its ZeRO optimizers)")
    if optim.main_params_dtype == "bf16-remainder":
        if parallel.zero_stage not in (1, 2):
            raise ValueError("--main-params-dtype bf16-remainder needs --zero-stage 1 or 2 (DeepSpeed leaves the master "
                             "weights to the optimizer only in its ZeRO-1/2 optimizer)")
        if parallel.pipeline_model_parallel_size > 1:
            raise ValueError("--main-params-dtype bf16-remainder is not supported with --pipeline-model-parallel-size "
                             "> 1 (untested with DeepSpeed's pipeline engine)")
    if data.mock_data and data.data_path:
        raise ValueError("--mock-data and --data-path are exclusive")
    if fp8.fast_accum and not fp8.enabled:
        raise ValueError("--fp8-fast-accum needs FP8 GEMMs: add --coat-fp8 or --fp8-activations")
    head_obstacle = fp8_head_obstacle(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                      model.vocab_size, model.hidden_size)
    if fp8.output_layer and head_obstacle:  # auto never gets here: it keeps the BF16 head where there is an obstacle
        raise ValueError(f"--fp8-output-layer on: {head_obstacle} (got --vocab-size {model.vocab_size}, --hidden-size "
                         f"{model.hidden_size}, --tensor-model-parallel-size {parallel.tensor_model_parallel_size}, "
                         f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size})")
    if fp8.grad_scaling == "delayed" and parallel.pipeline_model_parallel_size > 1:
        raise ValueError("--fp8-grad-scaling delayed is not supported with --pipeline-model-parallel-size > 1 (the "
                         "pipeline schedule runs several forwards before the first backward records an amax)")
    if fp8.activation_scaling == "delayed" and parallel.pipeline_model_parallel_size > 1:
        raise ValueError("--fp8-activation-scaling delayed is not supported with --pipeline-model-parallel-size > 1 "
                         "(untested with DeepSpeed's pipeline engine)")
    if training.enable_cuda_graph:
        check_cuda_graph(parallel)
    return MegacoatConfig(model=model, optim=optim, data=data, fp8=fp8, parallel=parallel, training=training)


def parse_config(argv: list[str] | None = None) -> MegacoatConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
