"""A plain Llama training loop with no DeepSpeed and no megacoat trainer: the reference that shows what the
trainer's own per-step host work costs.

    python -m benchmarks.e2e.plain_llama --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 \
        --num-attention-heads 16 --seq-length 2048 --vocab-size 32000 --micro-batch-size 2 --global-batch-size 4 \
        --train-iters 40 --log-interval 5 --eval-iters 0 --compile --log-json log.jsonl

It reads pretrain_gpt.py's flags, builds the same model (megacoat's GPT is a plain Llama) and compiles each block
as the trainer's --compile does, and gives the device the work the trainer's bf16 ZeRO-1 engine gives it: bf16
weights and gradients for compute, fp32 master weights and moments in torch's fused AdamW, gradients accumulated
over global/micro micro-batches (the loss divided by their count), global-norm clipping on the fp32 gradients,
the same learning-rate schedule. What it leaves out is the engine's host work: nothing is read back from the
device between log lines. Tokens are random (as --mock-data), pinned once on the host and copied per
micro-batch without blocking. It writes the trainer's --log-json lines (same keys) and honours --profile-dir, so
benchmarks/e2e/speed.py reads both the same way.

One process, one device: flags for what the loop does not do (FP8, parallelism, checkpoints, data files,
evaluation) stop it with an error naming the flag.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from torch.profiler import record_function

from megacoat.arguments import parse_config  # noqa: E402
from megacoat.config import MegacoatConfig  # noqa: E402
from megacoat.model import GPT  # noqa: E402
from megacoat.optim import WarmupDecayLR, param_groups  # noqa: E402
from megacoat.training.deepspeed_config import use_bf16  # noqa: E402
from megacoat.training.flops import flops_per_token, peak_flops  # noqa: E402
from megacoat.training.logger import TrainingLogger  # noqa: E402
from megacoat.training.model_builder import apply_compile  # noqa: E402
from megacoat.training.profiling import PHASE_PREFIX, StepProfiler  # noqa: E402
from megacoat.training.trainer import max_memory_bytes, max_memory_reserved_bytes  # noqa: E402

BATCHES = 4  # distinct random batches cycled through: enough that no step reuses the previous one's tokens


def refuse_unsupported(cfg: MegacoatConfig) -> None:
    t, p = cfg.training, cfg.parallel
    unsupported = {
        "--fp8-activations/--fp8-optimizer": cfg.fp8.enabled or cfg.optim.fp8_optimizer,
        "--tensor-model-parallel-size/--pipeline-model-parallel-size": max(p.tensor_model_parallel_size,
                                                                           p.pipeline_model_parallel_size) > 1,
        "--save/--load": bool(t.save or t.load),
        "--data-path (tokens are random)": bool(cfg.data.data_path),
        "--eval-iters (pass 0: no evaluation)": t.eval_iters > 0,
        "--deepspeed_config": t.deepspeed_config is not None,
        "--tensorboard-dir/--wandb-project": bool(t.tensorboard_dir or t.wandb_project),
    }
    for flag, bad in unsupported.items():
        if bad:
            raise SystemExit(f"error: {flag}: not supported by the plain loop (benchmarks/e2e/plain_llama.py)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("error: WORLD_SIZE > 1: the plain loop runs one process on one device")


class MasterWeights:
    """fp32 master copies of bf16 parameters (what DeepSpeed's bf16 optimizers keep): the optimizer steps the
    masters, whose .grad receives the bf16 gradients; the bf16 weights are refreshed from them after the step.
    Both copies are one `_foreach_copy_` each: a few launches, no host work per parameter."""

    def __init__(self, groups: list[dict]):
        self.groups = [dict(g, params=[p.detach().float() for p in g["params"]]) for g in groups]
        self.model = [p for g in groups for p in g["params"]]
        self.master = [p for g in self.groups for p in g["params"]]
        for m in self.master:
            m.grad = torch.zeros_like(m)

    def gradients_in(self) -> None:
        torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.model])

    @torch.no_grad()
    def weights_out(self) -> None:
        torch._foreach_copy_(self.model, self.master)


def train(cfg: MegacoatConfig) -> None:
    t, o = cfg.training, cfg.optim
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(t.seed)
    with device:
        model = GPT(cfg.model)
    groups = param_groups(model, o.weight_decay)
    bf16 = use_bf16(cfg, on_cuda=device.type == "cuda")
    masters = None
    if bf16:
        masters = MasterWeights(groups)  # fp32 copies taken before the model's weights become bf16
        model.to(torch.bfloat16)
        groups = masters.groups
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                  weight_decay=o.weight_decay, fused=device.type == "cuda")
    scheduler = WarmupDecayLR(optimizer, o, t.train_iters)
    fp32_params = [p for g in groups for p in g["params"]]
    if t.compile:
        apply_compile(model)
    accum = t.global_batch_size // t.micro_batch_size
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCHES, accum, t.micro_batch_size, cfg.model.seq_length + 1))
    tokens = tokens.pin_memory() if device.type == "cuda" else tokens

    logger = TrainingLogger(t.log_json, enabled=True)
    profiler = StepProfiler(t.profile_dir, t.profile_step_start, t.profile_step_end, rank=0)
    logger.info(f"plain loop: {cfg.model.num_parameters() / 1e6:.2f}M parameters, micro-batch {t.micro_batch_size}, "
                f"gradient accumulation {accum}, {'bf16 + fp32 master weights' if bf16 else 'fp32'}, "
                f"compile {t.compile}, device {device}")
    flops, peak = flops_per_token(cfg.model), peak_flops(device)
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    # The trainer's phase names (profiling.annotate_engine), so both profiles split the GPU's idle time alike.
    phase = (lambda name: record_function(PHASE_PREFIX + name)) if t.profile_dir else \
        (lambda name: contextlib.nullcontext())
    last_time, last_iter = time.perf_counter(), 0
    for it in range(1, t.train_iters + 1):
        lr = scheduler.get_last_lr()[0]
        losses = []
        for micro in range(accum):
            batch = tokens[it % BATCHES, micro].to(device, non_blocking=True)
            with phase("forward"):
                loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
            with phase("backward"):
                (loss / accum).backward()
            losses.append(loss.detach())
        with phase("step"):
            if masters is not None:
                masters.gradients_in()
            grad_norm = torch.nn.utils.clip_grad_norm_(fp32_params, o.clip_grad if o.clip_grad > 0 else float("inf"),
                                                       foreach=True)
            optimizer.step()
            scheduler.step()
            if masters is not None:
                masters.weights_out()
            model.zero_grad(set_to_none=True)
        if it % t.log_interval == 0 or it == t.train_iters:
            loss_value = float(torch.stack(losses).mean())  # synchronises the device: the timing is honest
            now = time.perf_counter()
            tokens_per_s = (it - last_iter) * tokens_per_step / (now - last_time)
            tflops = flops * tokens_per_s / 1e12
            logger.log_train({"iteration": it, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                              "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
                              "mfu": None if peak is None else tflops * 1e12 / peak,
                              "max_memory_bytes": max_memory_bytes(device),
                              "max_memory_reserved_bytes": max_memory_reserved_bytes(device), "skipped_steps": 0},
                             t.train_iters)
            last_time, last_iter = time.perf_counter(), it
        if profiler.step(it):
            last_time = time.perf_counter()  # writing the trace is not training time
    logger.close()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    refuse_unsupported(cfg)
    train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
