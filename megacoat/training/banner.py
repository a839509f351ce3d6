"""The start-up banner: what this run trains and how (model, precision, FP8, optimizer, parallel layout,
batch, data), in one block that rank 0 prints before the model is built; and the run's summary, the block it
prints at the end (`run_summary`)."""
from __future__ import annotations

from megacoat.config import MegacoatConfig
from megacoat.data.config import DataConfig, parse_data_path
from megacoat.data.indexed_dataset import IndexedDataset
from megacoat.coat.recipe import fp8_head_obstacle
from megacoat.parallel import ParallelState
from megacoat.training.fp8_report import fp8_row


def _precision(bf16: bool, on_cuda: bool, precision: str, main_params_dtype: str | None = "fp32") -> str:
    master = ("exact fp32 masters as the bf16 weights plus CoatAdamW's 16-bit remainders"
              if main_params_dtype == "bf16-remainder" else "fp32 master weights in the optimizer")
    dtype = f"bf16 weights and activations, {master}" if bf16 else "fp32 weights and activations"
    why = f"--{precision}" if precision != "auto" else ("the default on CUDA" if on_cuda else "the default on CPU")
    return f"{dtype} ({why})"


def _bf16_head_reason(cfg: MegacoatConfig) -> str:
    """Why coat mode's head stays in high precision: where the FP8 head does not run (TP or PP, sizes off the FP8
    GEMM alignment: auto keeps the BF16 head there, CoatRecipe.for_layout), else the flag."""
    if cfg.fp8.mode != "coat":
        return ""
    m, p = cfg.model, cfg.parallel
    why = fp8_head_obstacle(p.tensor_model_parallel_size, m.vocab_size, m.hidden_size)
    return f" ({why or '--fp8-output-layer off'})"


def _fp8(cfg: MegacoatConfig, bf16: bool) -> str:
    f = cfg.fp8
    if not f.enabled:
        return f"off (transformer blocks in {'bf16' if bf16 else 'fp32'}; --fp8-activations or --coat-fp8 turn it on)"
    accum = "; forward GEMMs with fast accumulation (--fp8-fast-accum)" if f.fast_accum else ""
    gemms = f"FP8 GEMMs (E4M3 inputs and weights, per-tensor scales; gradients {f.grad_dtype.upper()}{accum})"
    head = ("; the output layer in FP8 too (--fp8-output-layer)" if f.output_layer
            else f"; the output layer in high precision{_bf16_head_reason(cfg)}")
    if f.mode == "fp8-linear":
        return f"fp8-linear: {gemms}; norms, SwiGLU and attention in high precision{head}"
    sites = [what for what, on in (("SwiGLU's and the [q|k|v] output's gradients", f.grad_scaling == "delayed"),
                                   ("RMSNorm's and SwiGLU's outputs and wo's input",
                                    f.activation_scaling == "delayed")) if on]
    delayed = (f"; {' and '.join(sites)} with delayed scaling (history of {f.amax_history_len}, "
               f"--fp8-grad-scaling / --fp8-activation-scaling)" if sites else "")
    return (f"coat: {gemms}; RMSNorm and SwiGLU in E4M3 with 1x{f.group_size} group scales, FP8 tensors saved "
            f"for backward{delayed}{head}")


def _optimizer(cfg: MegacoatConfig) -> str:
    o = cfg.optim
    hyper = f"lr {o.lr:g} (min {o.min_lr:g}, {o.lr_decay_style} decay, {o.lr_warmup_iters} warm-up iterations), " \
            f"weight decay {o.weight_decay:g}, clip {o.clip_grad:g}"
    if not o.fp8_optimizer:
        return f"AdamW, fp32 moments; {hyper}"
    expansion = "on" if o.fp8_expand else "off (--fp8-no-expansion)"
    return (f"CoatAdamW: first moment {o.fp8_m_dtype.upper()}, second moment {o.fp8_v_dtype.upper()}, one scale "
            f"per group of {o.fp8_group_size}, dynamic range expansion {expansion}; {hyper}")


SHOWN_PREFIXES = 4  # the data line names this many shards, then counts the rest


def _data(d: DataConfig) -> str | None:
    """The shards (with their weights), their documents and tokens (read from the .idx files), the split."""
    if d.mock_data:
        return "random tokens (--mock-data)"
    if not d.data_path:
        return None
    weights, prefixes = parse_data_path(d.data_path)
    shards = [IndexedDataset(prefix) for prefix in prefixes]
    docs = sum(s.num_documents for s in shards)
    tokens = sum(s.num_tokens for s in shards)
    named = [prefix if weights is None else f"{prefix} (weight {w:g})"
             for prefix, w in zip(prefixes, weights or [None] * len(prefixes))]
    if len(named) > SHOWN_PREFIXES:
        named = named[:SHOWN_PREFIXES] + [f"and {len(named) - SHOWN_PREFIXES} more"]
    tokenizer = f"; tokenizer {d.tokenizer_model}" if d.tokenizer_model else ""
    return f"{', '.join(named)}: {docs:,} documents, {tokens:,} tokens; split {d.split}{tokenizer}"


def startup_banner(cfg: MegacoatConfig, state: ParallelState, world_size: int, grad_accum: int, bf16: bool,
                   on_cuda: bool, allocator: str | None = None, cublas_workspace: str = "default") -> str:
    m, t = cfg.model, cfg.training
    groups = m.num_query_groups or m.num_attention_heads
    rows = [
        ("model", f"{m.num_parameters() / 1e6:.2f}M parameters: {m.num_layers} layers, hidden {m.hidden_size}, FFN "
                  f"{m.ffn_hidden_size}, {m.num_attention_heads} heads ({groups} query groups), sequence "
                  f"{m.seq_length}, vocabulary {m.vocab_size}"),
        ("precision", _precision(bf16, on_cuda, t.precision, cfg.optim.main_params_dtype)),
        ("FP8", _fp8(cfg, bf16)),
        ("optimizer", _optimizer(cfg)),
        ("parallel", f"TP {state.tp_size} x PP {state.pp_size} x DP {state.dp_size}"
                     + (", sequence parallel" if state.sequence_parallel else "")
                     + f"; ZeRO-{cfg.parallel.zero_stage}; world size {world_size}"),
        ("batch", f"micro-batch {t.micro_batch_size}, global batch {t.global_batch_size} (gradient accumulation "
                  f"{grad_accum}), {t.train_iters} iterations of {t.global_batch_size * m.seq_length} tokens"),
    ]
    data = _data(cfg.data)
    if data is not None:
        rows.append(("data", data))
    if on_cuda and allocator is not None:
        rows.append(("CUDA allocator", f"{allocator} (PYTORCH_CUDA_ALLOC_CONF)"))
    if on_cuda and cublas_workspace != "default":
        rows.append(("cuBLAS workspace", cublas_workspace))
    return "\n".join(["megacoat run:"] + [f"  {k}: {v}" for k, v in rows])


def run_summary(trainer, history: dict, seconds: float, start_iteration: int) -> str:
    """The block rank 0 prints when a run ends: the iterations and tokens it trained and how long it took, the
    last train and validation losses, the checkpoint it wrote. `trainer` is the Trainer that ran; `history` what
    its `train()` returned; `start_iteration` where it started (a resumed run counts only its own work)."""
    t, m = trainer.cfg.training, trainer.cfg.model
    steps = trainer.state.iteration - start_iteration
    tokens = steps * t.global_batch_size * m.seq_length
    rate = f" ({tokens / seconds:,.0f} tokens/s)" if seconds > 0 else ""
    train = "train {1:.4f} (iteration {0})".format(*history["loss"][-1]) if history["loss"] else "train -"
    val = ("validation {1:.4f} (iteration {0})".format(*history["val_loss"][-1]) if history["val_loss"]
           else "no validation (--eval-iters 0)" if not t.eval_iters else "no validation yet")
    saved = trainer.saved_checkpoint or ("none (no --save)" if not t.save else "none")
    rows = [
        ("trained", f"{steps} iterations ({start_iteration} -> {trainer.state.iteration}), {tokens:,} tokens in "
                    f"{seconds:.1f} s{rate}"),
        ("final loss", f"{train}, {val}"),
        ("checkpoint", saved),
    ]
    fp8 = fp8_row(trainer, history["loss"][-1][1] if history["loss"] else None)
    if fp8 is not None:
        rows.append(("FP8", fp8))
    return "\n".join(["megacoat run done:"] + [f"  {k}: {v}" for k, v in rows])
