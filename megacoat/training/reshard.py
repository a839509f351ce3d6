"""Resuming across layouts and optimizers: a checkpoint that DeepSpeed cannot load as is (another tensor- or
pipeline-parallel size, another data-parallel size under ZeRO-1/2, another ZeRO stage, AdamW <-> CoatAdamW or
other CoatAdamW settings) is converted once to the layout-free form (megacoat.checkpoint), next to its DeepSpeed
files as `iter_N/layout_free/`, and every rank of the new layout loads its own slices from there.

Rank 0 converts (offline work on the CPU: the same as `tools/convert_checkpoint.py`); the others wait. A
conversion that fails (a read-only directory, a form the converter does not read) is one error on every rank
naming the command that converts the checkpoint elsewhere. Every file is read as data (weights_only) and
checked against the sha256 its megacoat.json records.
"""
from __future__ import annotations

import json
import os

import torch.distributed as dist

from megacoat.checkpoint.from_deepspeed import to_layout_free
from megacoat.checkpoint.integrity import verify_manifest_shared
from megacoat.checkpoint.into_engine import load_into_engine
from megacoat.checkpoint.layout_free import META_FILE, LayoutFreeCheckpoint
from megacoat.training.rng_state import load_rng_file

LAYOUT_FREE_DIR = "layout_free"
# CoatAdamW settings that give its stored state a meaning (OptimizerConfig names)
FP8_STATE_SETTINGS = ("fp8_m_dtype", "fp8_v_dtype", "fp8_group_size", "fp8_expand")


def optimizer_changes(saved_optim: dict, now_optim: dict) -> list[str]:
    """What differs between the optimizer state a checkpoint holds and the one this run keeps."""
    saved, now = saved_optim.get("fp8_optimizer"), now_optim.get("fp8_optimizer")
    if saved != now:
        return [f"fp8_optimizer: saved {saved}, now {now}"]
    if not now:
        return []
    return [f"{k}: saved {saved_optim[k]!r}, now {now_optim[k]!r}" for k in FP8_STATE_SETTINGS
            if k in saved_optim and k in now_optim and saved_optim[k] != now_optim[k]]


def convert_command(path: str) -> str:
    return (f"python tools/convert_checkpoint.py --load {path} --output OUT (then --load OUT)")


def ensure_layout_free(path: str, need_state: bool) -> str:
    """The layout-free form of the DeepSpeed checkpoint at `path` (collective): made by rank 0 if absent, with
    the optimizer state (weights only where that cannot be read and `need_state` is false)."""
    target = os.path.join(path, LAYOUT_FREE_DIR)
    error = [None]
    if dist.get_rank() == 0:
        meta = None
        if os.path.isfile(os.path.join(target, META_FILE)):
            with open(os.path.join(target, META_FILE)) as f:
                meta = json.load(f)
        try:
            if meta is None or (need_state and meta.get("optimizer") is None):
                try:
                    to_layout_free(path, target, with_state=True)
                except ValueError:
                    if need_state:
                        raise
                    to_layout_free(path, target, with_state=False)
        except (OSError, ValueError) as e:
            error[0] = f"{e}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ValueError(f"--load {path}: converting to the layout-free form failed ({error[0]}); convert it "
                         f"elsewhere with: {convert_command(path)}")
    return target


def load_layout_free(engine, path: str, tp_rank: int, num_layers: int, tp_size: int, finetune: bool) -> dict:
    """Load the layout-free checkpoint at `path` into `engine`; returns its megacoat.json. With `finetune`
    only the weights: optimizer, LR schedule, RNG and position start fresh."""
    ckpt = LayoutFreeCheckpoint(path)
    if ckpt.meta.get("files"):
        verify_manifest_shared(path, ckpt.meta["files"])
    load_into_engine(engine, ckpt, tp_rank, tp_size, num_layers, load_optimizer=not finetune)
    if hasattr(engine, "global_steps") and not finetune:
        engine.global_steps, engine.global_samples = ckpt.meta["iteration"], ckpt.meta["consumed_samples"]
    if not finetune:
        sched = ckpt.meta.get("lr_scheduler")
        if sched is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(sched)
        rng = ckpt.rng_file(dist.get_rank())
        if rng is not None:
            load_rng_file(rng)
    return ckpt.meta


def describe_resume(path: str, config_dict: dict, layout, finetune: bool = False) -> list[str]:
    """Log lines for what a resume changes: the parallel layout, the optimizer, the global batch."""
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    lines = []
    saved_layout = meta.get("layout") or {}
    keys = ("data_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "zero_stage")
    moved = [f"{k} {saved_layout[k]} -> {layout.__dict__[k]}" for k in keys
             if k in saved_layout and saved_layout[k] != layout.__dict__[k]]
    if moved:
        lines.append("checkpoint layout changed: " + ", ".join(moved))
    changed = [] if finetune or not meta.get("optimizer", True) else \
        optimizer_changes(meta["megacoat_config"].get("optim", {}), config_dict.get("optim", {}))
    if changed:
        lines.append("optimizer state converted: " + "; ".join(changed))
    saved_gb = meta["megacoat_config"]["training"]["global_batch_size"]
    now_gb = config_dict["training"]["global_batch_size"]
    if saved_gb != now_gb and not finetune:
        lines.append(f"global batch changed: saved {saved_gb}, now {now_gb} (the data position continues at the "
                     f"consumed sample count)")
    return lines
