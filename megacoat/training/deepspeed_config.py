"""The DeepSpeed JSON config: written from megacoat's flags, or read from --deepspeed_config and checked
against them (a user file that disagrees with the flags is an error, not a silent override)."""
from __future__ import annotations

import json
import logging
from dataclasses import replace

from megacoat.config import MegacoatConfig
from megacoat.optim.config import default_main_params_dtype

UNTESTED_OPTIMIZER_WARNING = "You are using ZeRO with an untested optimizer"
# --overlap-grad-reduce: Megatron-LM's default bucket (elements), max(40 M, 1 M x the data-parallel size); DeepSpeed's
# own (5e8) is too coarse for overlap at megacoat's model sizes (docs/design.md, section 10)
OVERLAP_BUCKET_ELEMENTS = 40_000_000


def overlap_bucket_size(data_parallel_size: int) -> int:
    """reduce_bucket_size under --overlap-grad-reduce: elements of one of DeepSpeed's two gradient buckets."""
    return max(OVERLAP_BUCKET_ELEMENTS, 1_000_000 * data_parallel_size)


def zero_settings(cfg: MegacoatConfig, data_parallel_size: int) -> dict:
    """DeepSpeed's `zero_optimization`: the stage, and under --overlap-grad-reduce (ZeRO-1/2) `overlap_comm` with
    Megatron's bucket size. With overlap_comm DeepSpeed's gradient hooks copy each gradient into one of two
    buckets as autograd makes it (ZeRO-1: on the step's last micro-batch only; ZeRO-2: on every one) and reduce a
    full bucket on its reduction stream while backward goes on; without it ZeRO-1 reduces every bucket after
    backward, and ZeRO-2 reduces in the hooks on the compute stream."""
    zero: dict = {"stage": cfg.parallel.zero_stage}
    if cfg.parallel.overlap_grad_reduce:
        zero.update(overlap_comm=True, reduce_bucket_size=overlap_bucket_size(data_parallel_size))
    return zero


def quiet_tested_optimizer_warning(record: logging.LogRecord) -> bool:
    """A filter for DeepSpeed's logger: drops its "untested optimizer" warning, which it gives for every client
    optimizer under ZeRO. megacoat only hands it AdamW or CoatAdamW, both tested under ZeRO-1/2 here
    (tests/optim/test_coat_adamw_deepspeed.py, tests/training/test_checkpoint_resume.py)."""
    return UNTESTED_OPTIMIZER_WARNING not in record.getMessage()


def use_bf16(cfg: MegacoatConfig, on_cuda: bool) -> bool:
    """--bf16, or the default on CUDA, or asked for by --main-grads-dtype bf16 / --main-params-dtype bf16-remainder."""
    precision = cfg.training.precision
    asked = cfg.optim.main_grads_dtype == "bf16" or cfg.optim.main_params_dtype == "bf16-remainder"
    return precision == "bf16" or (precision == "auto" and (on_cuda or asked))


def resolve_main_params(cfg: MegacoatConfig, on_cuda: bool, saved: str | None = None) -> MegacoatConfig:
    """cfg with --main-params-dtype decided when the flag was not given: the checkpoint being resumed keeps the
    master weights it was saved with (`saved`, fp32 always fits), a new run gets default_main_params_dtype."""
    o = cfg.optim
    if o.main_params_dtype is not None:
        return cfg
    bf16 = use_bf16(cfg, on_cuda)
    natural = default_main_params_dtype(o.fp8_optimizer, bf16, cfg.parallel.zero_stage,
                                        cfg.parallel.pipeline_model_parallel_size,
                                        o.main_grads_dtype or ("bf16" if bf16 else "fp32"))
    dtype = saved if saved in ("fp32", natural) else natural
    return replace(cfg, optim=replace(o, main_params_dtype=dtype))


def precision_settings(cfg: MegacoatConfig, bf16: bool) -> dict:
    """DeepSpeed's keys for --main-grads-dtype and --main-params-dtype (bf16 runs; fp32 runs are fp32 throughout).

    Gradients (DeepSpeed 0.19.8, ZeRO-1/2): with `data_types.grad_accum_dtype` bf16 the bf16 gradients are summed
    in place over the micro-batches (ZeRO-1: autograd into param.grad; ZeRO-2: into this rank's partition buffer) and
    reduced in bf16; fp32 makes both fp32 (ZeRO-1 then runs DeepSpeed's BF16_Optimizer, which keeps a full fp32
    gradient buffer; ZeRO-2 an fp32 partition) and `communication_data_type` fp32 keeps the reduction in fp32.
    Master weights: `bf16.bf16_master_weights_and_grads` makes the ZeRO optimizer's "fp32" partition bf16 and hands
    the optimizer bf16 gradients; `bf16_optimizer_states` is DeepSpeed's switch that allows it without CPU offload
    (it changes nothing for a client optimizer, whose state is its own: CoatAdamW keeps the remainders there).
    """
    if not bf16:
        return {}
    grads = cfg.optim.main_grads_dtype or "bf16"
    out: dict = {"data_types": {"grad_accum_dtype": grads}}
    if grads == "fp32":
        out["communication_data_type"] = "fp32"
    if cfg.optim.main_params_dtype == "bf16-remainder":
        out["bf16"] = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    return out


def build_deepspeed_config(cfg: MegacoatConfig, data_parallel_size: int, on_cuda: bool) -> dict:
    t = cfg.training
    gas = t.gradient_accumulation_steps(data_parallel_size)
    bf16 = use_bf16(cfg, on_cuda)
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.optim.clip_grad,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero_settings(cfg, data_parallel_size),
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
    extra = precision_settings(cfg, bf16)
    ds["bf16"].update(extra.pop("bf16", {}))
    ds.update(extra)
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
    if cfg.parallel.overlap_grad_reduce and user.get("zero_optimization", {}).get("overlap_comm") is False:
        raise ValueError(f"--deepspeed_config {t.deepspeed_config}: overlap_comm false disagrees with "
                         "--overlap-grad-reduce")
    merged = dict(ds)
    merged.update(user)  # the user's file wins for everything else (e.g. communication tuning)
    merged["zero_optimization"] = {**ds["zero_optimization"], **user.get("zero_optimization", {})}
    return merged
