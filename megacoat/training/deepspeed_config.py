"""The DeepSpeed JSON config: written from megacoat's flags, or read from --deepspeed_config and checked
against them (a user file that disagrees with the flags is an error, not a silent override)."""
from __future__ import annotations

import json

from megacoat.config import MegacoatConfig


def use_bf16(cfg: MegacoatConfig, on_cuda: bool) -> bool:
    precision = cfg.training.precision
    return precision == "bf16" or (precision == "auto" and on_cuda)


def build_deepspeed_config(cfg: MegacoatConfig, data_parallel_size: int, on_cuda: bool) -> dict:
    t = cfg.training
    gas = t.gradient_accumulation_steps(data_parallel_size)
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.optim.clip_grad,
        "bf16": {"enabled": use_bf16(cfg, on_cuda)},
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        # megacoat hands DeepSpeed its own optimizer object (AdamW or CoatAdamW): allow it under ZeRO.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # megacoat logs; keep DeepSpeed's own step printing out of the way
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on and synchronized by default: a full device synchronize at every
        # micro-batch's forward and every engine.step(). Each drains the GPU's queue, which then idles while the
        # host launches the next kernels and does all of the optimizer step's Python work; megacoat measures
        # throughput itself, at its log interval.
        "timers": {"throughput": {"enabled": False}},
    }
    if cfg.parallel.pipeline_model_parallel_size > 1 and cfg.parallel.sequence_parallel:
        # DeepSpeed's pipeline splits each stage's output over the TP ranks and re-gathers it on the next stage,
        # assuming TP ranks hold the same activation; under sequence parallelism each holds its own shard.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if t.deepspeed_config is None:
        return ds
    with open(t.deepspeed_config) as f:
        try:
            user = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--deepspeed_config {t.deepspeed_config}: not valid JSON ({e})") from None
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in user and user[key] != ds[key]:
            raise ValueError(f"--deepspeed_config {t.deepspeed_config}: {key}={user[key]} disagrees with the "
                             f"flags (--global-batch-size/--micro-batch-size give {ds[key]})")
    if "optimizer" in user or "scheduler" in user:
        raise ValueError(f"--deepspeed_config {t.deepspeed_config}: remove 'optimizer'/'scheduler'; megacoat "
                         "builds them from its --lr/--adam-*/--fp8-optimizer flags")
    stage = user.get("zero_optimization", {}).get("stage")
    if stage is not None and stage != cfg.parallel.zero_stage:
        raise ValueError(f"--deepspeed_config {t.deepspeed_config}: zero stage {stage} disagrees with "
                         f"--zero-stage {cfg.parallel.zero_stage}")
    merged = dict(ds)
    merged.update(user)  # the user's file wins for everything else (e.g. communication tuning)
    merged["zero_optimization"] = {**ds["zero_optimization"], **user.get("zero_optimization", {})}
    return merged
