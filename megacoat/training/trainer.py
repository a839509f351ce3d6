"""The pretraining loop: build data, model and optimizer from a MegacoatConfig, hand them to the DeepSpeed
engine (data parallelism with ZeRO-0/1/2, its pipeline engine under PP, bf16, gradient accumulation and
clipping; tensor parallelism comes from megacoat.parallel), then train, evaluate, log and checkpoint."""
from __future__ import annotations

import functools

import logging
import math
import os
import resource
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from megacoat.config import MegacoatConfig
from megacoat.data.config import parse_data_path
from megacoat.coat import after_optimizer_step
from megacoat.parallel import initialize_parallel_state
from megacoat.parallel.grad_norm import global_grad_norm
from megacoat.training.banner import run_summary, startup_banner
from megacoat.training.checkpointing import (Layout, TrainState, check_compatible, file_identity, load_checkpoint,
                                             read_meta, resolve_load, save_checkpoint, scaling_changes)
from megacoat.training.cuda_graph import gradient_groups, own_graph_gradients
from megacoat.training.deepspeed_config import (build_deepspeed_config, quiet_tested_optimizer_warning,
                                                resolve_main_params)
from megacoat.training.deepspeed_patches import patch_zero_optimizer
from megacoat.training.reshard import describe_resume
from megacoat.training.distributed import all_reduce_mean, init_distributed, is_main_process
from megacoat.training.flops import flops_per_token, peak_flops
from megacoat.training.logger import TrainingLogger
from megacoat.training.model_builder import ModelConverter, build_engine, build_model
from megacoat.training.profiling import StepProfiler, annotate_engine
from megacoat.training.runtime import apply_cublas_workspace, default_allocator_settings
from megacoat.training.signals import ExitConditions
from megacoat.training.stability import StabilityGuard, clear_skip_flag, skip_fp32_step
from megacoat.training.zero3_fp8_gather import install_fp8_weight_gather


def check_data_paths(cfg: MegacoatConfig) -> None:
    """Fail before any work when a --data-path shard or the tokenizer file is missing."""
    _, prefixes = parse_data_path(cfg.data.data_path) if cfg.data.data_path else (None, [])
    for item in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.exists(item + ext):
                raise FileNotFoundError(f"--data-path {item}: {item + ext} does not exist")
    if cfg.data.tokenizer_model and not os.path.exists(cfg.data.tokenizer_model):
        raise FileNotFoundError(f"--tokenizer-model {cfg.data.tokenizer_model} does not exist")


def resolve_data(cfg: MegacoatConfig, logger: TrainingLogger) -> MegacoatConfig:
    """No --data-path and no --mock-data: the embedded default corpus (the Python standard library's sources),
    prepared once by rank 0 and reused from the cache by everyone else."""
    if cfg.data.data_path or cfg.data.mock_data:
        data = cfg.data
    else:
        from megacoat.data import prepare_default_corpus

        if is_main_process():
            corpus = prepare_default_corpus(cfg.data.cache_dir, vocab_size=cfg.model.vocab_size)
        dist.barrier()
        if not is_main_process():
            corpus = prepare_default_corpus(cfg.data.cache_dir, vocab_size=cfg.model.vocab_size, progress=False)
        logger.info(f"data: embedded default corpus {corpus.data_prefix}")
        data = replace(cfg.data, data_path=[corpus.data_prefix], tokenizer_model=corpus.tokenizer_model)
    if data.tokenizer_model:
        from megacoat.data import SentencePieceTokenizer

        vocab = SentencePieceTokenizer(data.tokenizer_model).vocab_size
        if vocab > cfg.model.vocab_size:
            raise ValueError(f"--vocab-size {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                             f"({vocab}, {data.tokenizer_model})")
    return replace(cfg, data=data)


# The validation samples do not depend on --seed: runs of different seeds are evaluated on the same batches, so
# their validation losses differ only by what training did.
VALIDATION_SEED = 0


def build_data(cfg: MegacoatConfig):
    from megacoat.data import build_train_valid_test_datasets

    t = cfg.training
    evals = t.train_iters // t.eval_interval + 1 if t.eval_iters else 0
    return build_train_valid_test_datasets(
        cfg.data, cfg.model.seq_length,
        train_samples=t.train_iters * t.global_batch_size,
        valid_samples=t.eval_iters * t.global_batch_size if evals else 0,
        test_samples=0, seed=t.seed, vocab_size=cfg.model.vocab_size, eval_seed=VALIDATION_SEED)


def max_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS on CPU (Linux reports KiB)


def max_memory_reserved_bytes(device: torch.device) -> int | None:
    """The allocator's peak reservation on a GPU (None elsewhere): what it held from the device, private CUDA-graph
    pools included. A graph's replays do not call the allocator, so with --enable-cuda-graph max_memory_bytes may
    fall below what the step really uses; this peak does not."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


class Trainer:
    def __init__(self, cfg: MegacoatConfig, model_converter: ModelConverter | None = None):
        """model_converter: see `build_model` (how a benchmark trains a model megacoat does not build itself)."""
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)  # megacoat prints its own log; DeepSpeed's INFO lines drown it
        ds_logger.addFilter(quiet_tested_optimizer_warning)
        check_data_paths(cfg)
        self.allocator_settings = default_allocator_settings()  # before the first CUDA allocation
        # before the first GEMM; a model converter (torchao's float8 linears, the benchmarks' peer) has FP8 GEMMs too
        fp8_gemms = torch.cuda.is_available() and (cfg.fp8.enabled or model_converter is not None)
        self.cublas_workspace = apply_cublas_workspace(cfg.training.cublas_workspace, fp8_gemms)
        self.device = init_distributed(cfg.training.distributed_timeout_minutes)
        self.world_size = dist.get_world_size()
        # Groups before anything else: the DP rank/size (data sharding, batch arithmetic) come from them.
        self.parallel = initialize_parallel_state(cfg.parallel, cfg.model)
        self.dp_rank, self.dp_size = self.parallel.dp_rank, self.parallel.dp_size
        self.pipelined = self.parallel.pp_size > 1
        t = cfg.training
        self.logger = TrainingLogger(t.log_json, enabled=is_main_process(), resume=bool(t.load),
                                     tensorboard_dir=t.tensorboard_dir, wandb_project=t.wandb_project,
                                     wandb_run_name=t.wandb_run_name, run_config=cfg.to_dict())
        cfg = resolve_data(cfg, self.logger)
        # The checkpoint --load names, found and read once: its layout decides an unset --main-params-dtype (the
        # master it was saved with), and check_load holds the rest of it against the flags.
        self.resume = resolve_load(t.load, t.save) if t.load else None
        meta = read_meta(*self.resume) if self.resume else None
        saved_master = None if meta is None or t.finetune else (meta.get("layout") or {}).get("main_params_dtype")
        cfg = resolve_main_params(cfg, self.device.type == "cuda", saved_master)
        self.cfg = cfg
        self.ds_config = build_deepspeed_config(cfg, self.dp_size, on_cuda=self.device.type == "cuda")
        self.grad_accum = self.ds_config["gradient_accumulation_steps"]
        self.layout = Layout(world_size=self.world_size, data_parallel_size=self.dp_size,
                             tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
                             pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
                             zero_stage=cfg.parallel.zero_stage, fp8_optimizer=cfg.optim.fp8_optimizer,
                             main_params_dtype=cfg.optim.main_params_dtype,
                             main_grads_dtype=self.ds_config.get("data_types", {}).get("grad_accum_dtype", "fp32"))
        self.tokenizer_identity = file_identity(cfg.data.tokenizer_model)

        # What can be checked without the model is checked before it is built: the checkpoint --load names
        # (its metadata against the flags) and the data (shards opened and validated, token ids, splits).
        self.check_load(meta)
        self.train_ds, self.valid_ds, _ = build_data(cfg)
        self.logger.info(startup_banner(cfg, self.parallel, self.world_size, self.grad_accum,
                                        self.ds_config["bf16"]["enabled"], self.device.type == "cuda",
                                        self.allocator_settings, self.cublas_workspace))

        model = build_model(cfg, self.device, self.parallel, model_converter)
        self.engine, self.scheduler = build_engine(cfg, model, self.ds_config, self.device, self.parallel)
        # FP8 upkeep after each optimizer step and load; as one CUDA graph under --enable-cuda-graph
        upkeep = functools.partial(after_optimizer_step, self.engine.module, self.parallel.dp_group, self.dp_size,
                                   t.enable_cuda_graph)
        # ZeRO-3: the blocks' weights all-gathered in FP8, their shards quantized after each step (zero3_fp8_gather.py)
        gather = install_fp8_weight_gather(self.engine, cfg.parallel.zero_stage, cfg.parallel.zero3_weight_gather,
                                           log=self.logger.info)
        self.after_optimizer_step = upkeep if gather is None else lambda: (gather.refresh(), upkeep())
        self.after_optimizer_step()  # FP8 weight copies of the weights as the engine holds them
        # The optimizer's groups are fixed once the engine exists: found once, not at every step's copy
        self.grad_groups = gradient_groups(self.engine) if t.enable_cuda_graph else None
        if t.profile_dir:
            annotate_engine(self.engine)  # the profiled window's idle time, split by phase (profiling.py)
        # Plain fp32 data parallelism is the one engine that would apply a non-finite step (stability.py).
        self.plain_fp32 = not cfg.parallel.zero_stage and not self.ds_config["bf16"]["enabled"]
        self.guard = StabilityGuard(t.max_skipped_steps)
        # DeepSpeed's ZeRO-1/2 step patched (deepspeed_patches.py); in bf16 it refuses a non-finite step on the
        # device, and the refusals are read at log and save time
        self.device_skips = patch_zero_optimizer(
            self.engine, share_master=cfg.optim.main_params_dtype == "bf16-remainder",
            device_skip=not (t.host_overflow_check or self.pipelined), log=self.logger.info)
        self.profiler = StepProfiler(t.profile_dir, t.profile_step_start, t.profile_step_end, dist.get_rank())
        self.state = TrainState()
        self.resumed_from = None  # the checkpoint loaded (load_checkpoint)
        self.saved_checkpoint: str | None = None  # the last checkpoint this run wrote (for the run summary)
        if self.resume:
            self.load_checkpoint(*self.resume)
        if t.load:
            self.logger.truncate_after(self.state.iteration)
        self.exit = ExitConditions(self.device, t.exit_interval, t.exit_duration_in_mins)
        self.flops_per_token = flops_per_token(cfg.model)
        self.peak = peak_flops(self.device)

    # --- data -------------------------------------------------------------------------------------------
    def _loader(self, dataset, consumed_samples: int):
        from megacoat.data import build_pretraining_data_loader

        return iter(build_pretraining_data_loader(dataset, consumed_samples, self.cfg.training.micro_batch_size,
                                                  self.dp_rank, self.dp_size, self.cfg.data.num_workers))

    def _split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.device, non_blocking=True)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    # --- one step -----------------------------------------------------------------------------------------
    def train_step(self, data_iter) -> tuple[torch.Tensor, torch.Tensor | float | None, bool]:
        """One optimizer step over grad_accum micro-batches. Returns (mean loss, grad norm, skipped): a
        non-finite gradient leaves weights, optimizer state and LR schedule untouched (stability.py). Loss and
        grad norm stay as the engine gives them (device tensors): the loop reads them on the host only when it
        logs, so a step never waits for the GPU on their account."""
        if self.pipelined:
            return self._pipeline_step(data_iter)
        losses = []
        applied = True
        graphed = self.cfg.training.enable_cuda_graph
        for micro in range(self.grad_accum):
            tokens, labels = self._split(next(data_iter))
            if graphed:  # a new micro-batch: earlier graph outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            loss = self.engine(tokens, labels)
            self.engine.backward(loss)
            if graphed and micro == 0 and self.grad_accum > 1:
                own_graph_gradients(self.grad_groups)  # the next replay would overwrite them
            grad_norm = self._grad_norm_if_boundary()
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary and self.plain_fp32 and not math.isfinite(grad_norm):
                skip_fp32_step(self.engine)  # grads are all-reduced: every rank decides the same
            self.engine.step()
            if boundary:  # DeepSpeed updates weights through .data, which autograd's version counter misses
                clear_skip_flag(self.engine)
                applied = self.engine.was_step_applied()
                if self.device_skips is not None:
                    self.device_skips.record()
                self.after_optimizer_step()  # FP8 weight copies in place, amax histories synced
            losses.append(loss.detach())
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = grad_norm
        loss = all_reduce_mean(torch.stack(losses).mean().float())
        return loss, norm, not applied

    def _micro_batches(self, data_iter, count: int):
        """(tokens, labels) pairs for DeepSpeed's pipeline engine (its first stage reads tokens, its last labels)."""
        return iter([self._split(next(data_iter)) for _ in range(count)])

    def _pipeline_step(self, data_iter) -> tuple[torch.Tensor, torch.Tensor | float | None, bool]:
        """One step of DeepSpeed's 1F1B schedule over grad_accum micro-batches; the loss it returns is already
        averaged over micro-batches and data-parallel ranks and broadcast to every stage."""
        loss = self.engine.train_batch(self._micro_batches(data_iter, self.grad_accum))
        self.after_optimizer_step()
        return loss.detach().float(), self.engine.get_global_grad_norm(), not self.engine.was_step_applied()

    def _grad_norm_if_boundary(self) -> float | None:
        """ZeRO-1/2 and bf16 report their global grad norm through the engine; plain fp32 data parallelism
        (ZeRO-0) does not, so take it here, after DeepSpeed's all-reduce and before clipping."""
        if self.cfg.parallel.zero_stage or not self.engine.is_gradient_accumulation_boundary():
            return None
        if self.ds_config["bf16"]["enabled"]:
            return None
        return global_grad_norm(self.engine.module.parameters(), self.parallel)  # TP shards counted once

    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.eval()
        it = self._loader(self.valid_ds, 0)  # the same validation batches every time: comparable curves
        total = torch.zeros((), device=self.device)
        if self.pipelined:  # eval_batch: grad_accum micro-batches through the pipeline, loss averaged
            for _ in range(self.cfg.training.eval_iters):
                loss = self.engine.eval_batch(self._micro_batches(it, self.grad_accum))
                total += loss.float().reshape(()) * self.grad_accum
        else:
            for _ in range(self.cfg.training.eval_iters * self.grad_accum):
                tokens, labels = self._split(next(it))
                if self.cfg.training.enable_cuda_graph:  # as in training: each forward may reuse graph outputs
                    torch.compiler.cudagraph_mark_step_begin()
                total += self.engine(tokens, labels).float()
        self.engine.train()
        return float(all_reduce_mean(total / (self.cfg.training.eval_iters * self.grad_accum)))

    # --- checkpoints ----------------------------------------------------------------------------------------
    def read_device_skips(self) -> None:
        """Fold the steps refused on the device since the last read into the count, the log and the guard."""
        if self.device_skips is None:
            return
        refused, run, longest = self.device_skips.read()
        it = self.state.iteration
        if refused:
            self.state.skipped_steps += refused
            self.logger.info(f"iter {it}: non-finite loss or gradient, {refused} step(s) skipped since the last "
                             f"log (the longest {longest} in a row)")
        self.guard.absorb(refused, run, longest, it)

    def save_checkpoint(self, directory: str) -> None:
        self.read_device_skips()
        self.guard.check()  # never save after --max-skipped-steps refusals in a row
        # logs "saved checkpoint ...", or why it was not saved again (resumed from it, no step since)
        self.saved_checkpoint = save_checkpoint(self.engine, directory, self.state, self.cfg.to_dict(), self.layout,
                                                self.tokenizer_identity, self.cfg.training.keep_last,
                                                resumed_from=self.resumed_from, log=self.logger.info)

    def check_load(self, meta: dict | None) -> None:
        """Hold the metadata of the checkpoint to resume (self.resume) against the flags; without one, say why the
        run starts from scratch (the first run of a job whose --load is its --save directory)."""
        t = self.cfg.training
        if not t.load:
            return
        if self.resume is None:
            self.logger.info(f"--load {t.load}: no checkpoint yet in this --save directory, starting from scratch")
            return
        check_compatible(os.path.join(*self.resume), meta, self.cfg.to_dict(), self.layout, self.tokenizer_identity,
                         finetune=t.finetune, convert_optimizer=t.override_optimizer_state == "convert")
        for note in scaling_changes(meta, self.cfg.to_dict()):
            self.logger.info(note)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        t = self.cfg.training
        path, self.state = load_checkpoint(self.engine, directory, self.cfg.to_dict(), self.layout,
                                           self.tokenizer_identity, tag=tag, tp_rank=self.parallel.tp_rank,
                                           finetune=t.finetune, convert_optimizer=t.override_optimizer_state == "convert")
        self.resumed_from = None if t.finetune else path  # not saved again until a step changes it
        self.after_optimizer_step()
        schedule_note = self.scheduler.resume()  # the rates of the flags, not the ones the optimizer state holds
        if schedule_note:
            self.logger.info(schedule_note)
        for line in describe_resume(path, self.cfg.to_dict(), self.layout, t.finetune):
            self.logger.info(line)
        self.logger.info(f"{'fine-tuning from' if t.finetune else 'resumed from'} {path} "
                         f"at iteration {self.state.iteration}")

    # --- the loop ---------------------------------------------------------------------------------------------
    def train(self) -> dict:
        t = self.cfg.training
        data_iter = self._loader(self.train_ds, self.state.consumed_samples)
        tokens_per_step = t.global_batch_size * self.cfg.model.seq_length
        history = {"loss": [], "val_loss": []}
        last_time, last_iter = time.perf_counter(), self.state.iteration
        start_time, start_iteration = last_time, last_iter
        while self.state.iteration < t.train_iters:
            lr = self.scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler moves on after it)
            loss, grad_norm, skipped = self.train_step(data_iter)
            self.state.iteration += 1
            self.state.consumed_samples += t.global_batch_size  # a skipped step's batch is consumed too
            self.state.skipped_steps += skipped
            it = self.state.iteration
            if skipped:
                self.logger.info(f"iter {it}: non-finite loss or gradient, step skipped "
                                 f"({self.guard.consecutive + 1} in a row)")
            self.guard.record(skipped, it, loss, grad_norm)  # the loss stays a tensor: no sync here
            if it % t.log_interval == 0 or it == t.train_iters:
                self.read_device_skips()
                loss_value = float(loss)  # synchronises the device: the timing below is honest
                now = time.perf_counter()
                tokens_per_s = (it - last_iter) * tokens_per_step / (now - last_time)
                tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
                self.logger.log_train({
                    "iteration": it, "loss": loss_value, "lr": lr,
                    "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                    "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
                    "mfu": None if self.peak is None else tflops * 1e12 / self.peak,
                    "max_memory_bytes": max_memory_bytes(self.device),
                    "max_memory_reserved_bytes": max_memory_reserved_bytes(self.device),
                    "skipped_steps": self.guard.pop_since_log()}, t.train_iters)
                history["loss"].append((it, loss_value))
                last_time, last_iter = time.perf_counter(), it
            if self.profiler.step(it):
                last_time = time.perf_counter()  # writing the trace is not training time
            self.guard.check()  # after --max-skipped-steps skips in a row: stop, before any save
            if t.eval_iters and (it % t.eval_interval == 0 or it == t.train_iters):
                val = self.evaluate()
                self.logger.log_eval(it, val)
                history["val_loss"].append((it, val))
                last_time = time.perf_counter()  # evaluation time is not training throughput
            saved = False
            if t.save and t.save_interval and it % t.save_interval == 0:
                self.save_checkpoint(t.save)
                saved = True
                last_time = time.perf_counter()
            reason = self.exit.should_exit(it) if it < t.train_iters else None
            if reason:
                if t.save and not saved:
                    self.save_checkpoint(t.save)
                self.logger.info(f"exiting at iteration {it}: {reason}" +
                                 ("" if t.save else " (no --save: nothing was saved)"))
                break
        else:
            if t.save and (not t.save_interval or self.state.iteration % t.save_interval):
                self.save_checkpoint(t.save)
        self.exit.restore()
        self.logger.info(run_summary(self, history, time.perf_counter() - start_time, start_iteration))
        self.logger.close()
        return history


def pretrain(cfg: MegacoatConfig, model_converter: ModelConverter | None = None) -> dict:
    return Trainer(cfg, model_converter).train()
