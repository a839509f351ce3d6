"""torchtitan's float8 training on N GPUs, the peer that benchmarks/parallel/speed.py measures in the same run as
megacoat's default: the same Llama (megacoat's GPT, a plain Llama), flags, mock tokens and log lines as a megacoat
rank, trained as torchtitan's llama3 trains it: torchao's `convert_to_float8_training` on the block linears, each
block compiled, then FSDP2 (`fully_shard` per block and at the root; bf16 compute, fp32 master weights and gradient
reductions), AdamW on the shards.

    deepspeed --num_gpus 4 --module benchmarks.parallel.torchtitan_peer <pretrain_gpt.py flags> \
        --float8 tensorwise --compile --log-json log.jsonl
    # CPU check (gloo, torchao emulates the FP8 GEMMs)
    deepspeed --num_gpus 2 --module benchmarks.parallel.torchtitan_peer --num-layers 2 --hidden-size 128 \
        --ffn-hidden-size 256 --num-attention-heads 4 --seq-length 64 --vocab-size 256 --fp32 --mock-data \
        --eval-iters 0 --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --float8 tensorwise

--float8 tensorwise: dynamic per-tensor scales, and FSDP2 all-gathers the weights in FP8 (torchao's
enable_fsdp_float8_all_gather, each step's weight scales computed at once after the optimizer step:
precompute_float8_dynamic_scale_for_fsdp); rowwise: per-row scales, weights gathered in bf16; none: compiled bf16.
As torchtitan does, the output head stays in bf16. torchtitan itself is not needed: what it applies is torchao's
converter and torch's FSDP2, applied here in its order. Gradients are reduced every micro-batch (torchtitan's
default). Under speed.py (BENCH_PARALLEL_RESULT set) rank 0 also writes every rank's peak memory, counted from
the first step: the whole fp32 model each rank builds before sharding it is not (torchtitan builds on the meta
device and never holds it).

torchao is a benchmark-only dependency (`pip install -e ".[bench]"`); without it this stops with one error line.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.e2e.torchao_pretrain import MISSING, keep_linear_in_float8
from megacoat.arguments import parse_config
from megacoat.config import MegacoatConfig
from megacoat.model import GPT
from megacoat.optim import WarmupDecayLR, param_groups
from megacoat.training.deepspeed_config import use_bf16
from megacoat.training.flops import flops_per_token, peak_flops
from megacoat.training.logger import TrainingLogger
from megacoat.training.model_builder import apply_compile
from megacoat.training.profiling import StepProfiler
from megacoat.training.trainer import max_memory_bytes, max_memory_reserved_bytes

FLOAT8_RECIPES = ("tensorwise", "rowwise", "none")
BATCHES = 4  # distinct random batches cycled through, as benchmarks/e2e/plain_llama.py


def refuse_unsupported(cfg: MegacoatConfig) -> None:
    t, p = cfg.training, cfg.parallel
    unsupported = {
        "--fp8-activations/--coat-fp8/--fp8-optimizer (torchao's float8 is this peer's FP8)":
            cfg.fp8.enabled or cfg.optim.fp8_optimizer,
        "--tensor-model-parallel-size/--pipeline-model-parallel-size (the peer runs FSDP2 only)":
            max(p.tensor_model_parallel_size, p.pipeline_model_parallel_size) > 1,
        "--save/--load": bool(t.save or t.load),
        "--data-path (tokens are random)": bool(cfg.data.data_path),
        "--eval-iters (pass 0: no evaluation)": t.eval_iters > 0,
    }
    for flag, bad in unsupported.items():
        if bad:
            raise SystemExit(f"error: {flag}: not supported by benchmarks/parallel/torchtitan_peer.py")


def float8_config(recipe: str, on_cuda: bool):
    """torchao's recipe as torchtitan's float8 converter sets it (None: no float8)."""
    if recipe == "none":
        return None
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config if on_cuda else dataclasses.replace(config, emulate=True)


def build(cfg: MegacoatConfig, recipe: str, device: torch.device, world: int):
    """The model, float8-converted, compiled per block and sharded (torchtitan's order); whether it is bf16."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(cfg.training.seed)
    with device:
        model = GPT(cfg.model)
    config = float8_config(recipe, device.type == "cuda")
    if config is not None:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=config, module_filter_fn=keep_linear_in_float8)
    if cfg.training.compile:
        apply_compile(model)
    bf16 = use_bf16(cfg, on_cuda=device.type == "cuda")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, config


def float8_summary(model: torch.nn.Module) -> str:
    """How many linears run float8 GEMMs, and how many weights FSDP2 all-gathers in FP8."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    gathered = sum(isinstance(getattr(m.weight, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
                   for m in linears)
    return f"{len(linears)} float8 linears, {gathered} weights all-gathered in FP8"


def train(cfg: MegacoatConfig, recipe: str) -> None:
    t, o = cfg.training, cfg.optim
    on_cuda = torch.cuda.is_available()
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "0")):
        os.environ.setdefault(name, value)  # started without a launcher: one rank (benchmarks/e2e/speed.py's modes)
    dist.init_process_group("nccl" if on_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    accum, rest = divmod(t.global_batch_size, t.micro_batch_size * world)
    if rest or not accum:
        raise SystemExit(f"error: --global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size "
                         f"{t.micro_batch_size} x {world} ranks")
    model, config = build(cfg, recipe, device, world)
    if on_cuda:  # each rank built the whole fp32 model before sharding it (torchtitan builds on the meta device)
        torch.cuda.reset_peak_memory_stats(device)
    precompute = config is not None and config.enable_fsdp_float8_all_gather
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                  eps=o.adam_eps, weight_decay=o.weight_decay, fused=on_cuda)
    scheduler = WarmupDecayLR(optimizer, o, t.train_iters)
    g = torch.Generator().manual_seed(t.seed + rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCHES, accum, t.micro_batch_size, cfg.model.seq_length + 1),
                           generator=g)
    tokens = tokens.pin_memory() if on_cuda else tokens

    logger = TrainingLogger(t.log_json, enabled=rank == 0)
    profiler = StepProfiler(t.profile_dir, t.profile_step_start, t.profile_step_end, rank=rank)
    logger.info(f"torchtitan peer: float8 {recipe}" + (f" ({float8_summary(model)})" if config else "")
                + f", FSDP2 over {world} ranks, micro-batch {t.micro_batch_size}, gradient accumulation {accum}, "
                f"compile {t.compile}, device {device}")
    flops, peak = flops_per_token(cfg.model), peak_flops(device)
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    last_time, last_iter = time.perf_counter(), 0
    for it in range(1, t.train_iters + 1):
        lr = scheduler.get_last_lr()[0]
        losses = []
        for micro in range(accum):
            batch = tokens[it % BATCHES, micro].to(device, non_blocking=True)
            loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
            (loss / accum).backward()
            losses.append(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad if o.clip_grad > 0 else float("inf"),
                                                   foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if precompute:  # every weight's amax in one all-reduce, for the next step's FP8 all-gathers
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        if it % t.log_interval == 0 or it == t.train_iters:
            loss_mean = torch.stack(losses).mean().reshape(1)
            dist.all_reduce(loss_mean)  # synchronises every rank: the timing is honest
            now = time.perf_counter()
            tokens_per_s = (it - last_iter) * tokens_per_step / (now - last_time)
            tflops = flops * tokens_per_s / world / 1e12
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            logger.log_train({"iteration": it, "loss": float(loss_mean) / world, "lr": lr, "grad_norm": float(norm),
                              "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
                              "mfu": None if peak is None else tflops * 1e12 / peak,
                              "max_memory_bytes": max_memory_bytes(device),
                              "max_memory_reserved_bytes": max_memory_reserved_bytes(device), "skipped_steps": 0},
                             t.train_iters)
            last_time, last_iter = time.perf_counter(), it
        if profiler.step(it):
            last_time = time.perf_counter()  # writing the trace is not training time
    logger.close()
    write_result(device, world, accum)
    dist.destroy_process_group()


def write_result(device: torch.device, world: int, accum: int) -> None:
    """What speed.py's worker writes for a megacoat run: every rank's peak memory and the layout."""
    path = os.environ.get("BENCH_PARALLEL_RESULT")
    if not path:
        return
    peak = torch.tensor([max_memory_bytes(device)], dtype=torch.float64, device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"max_memory_bytes_per_rank": [int(p.item()) for p in peaks], "tp": 1, "pp": 1, "dp": world,
                       "grad_accum": accum}, f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--float8", choices=FLOAT8_RECIPES, default="tensorwise")
    ours, rest = p.parse_known_args(argv)
    if ours.float8 != "none" and importlib.util.find_spec("torchao") is None:
        raise SystemExit(f"error: {MISSING}")
    cfg = parse_config(rest)
    refuse_unsupported(cfg)
    train(cfg, ours.float8)


if __name__ == "__main__":
    main(sys.argv[1:])
