"""OptimizerConfig: AdamW / CoatAdamW hyper-parameters and the learning-rate schedule."""
from __future__ import annotations

from dataclasses import dataclass

from megacoat.ops.numerics import GROUP_SIZES

DECAY_STYLES = ("constant", "linear", "cosine")
FP8_MOMENT_DTYPES = ("e4m3", "e5m2")
MAIN_GRADS_DTYPES = ("fp32", "bf16")
MAIN_PARAMS_DTYPES = ("fp32", "bf16-remainder")


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 20
    lr_decay_iters: int | None = None  # None: decay over all training iterations
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # CoatAdamW (FP8 moments); off means torch AdamW with fp32 moments.
    fp8_optimizer: bool = False
    fp8_m_dtype: str = "e4m3"
    fp8_v_dtype: str = "e4m3"
    fp8_group_size: int = 128
    fp8_expand: bool = True
    # Megatron's names. Gradients: accumulated over micro-batches, reduced over data-parallel ranks and read by the
    # optimizer in this dtype (None: the run's precision). Master weights: an fp32 copy, or none (bf16 parameters
    # + CoatAdamW's int16 remainders, the same fp32 values in 2 bytes instead of 4); None: default_main_params_dtype.
    main_grads_dtype: str | None = None
    main_params_dtype: str | None = None

    def __post_init__(self):
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}) and --lr > 0")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError("--weight-decay and --clip-grad must be >= 0")
        for name in ("fp8_m_dtype", "fp8_v_dtype"):
            if getattr(self, name) not in FP8_MOMENT_DTYPES:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {FP8_MOMENT_DTYPES}")
        if self.main_grads_dtype is not None and self.main_grads_dtype not in MAIN_GRADS_DTYPES:
            raise ValueError(f"--main-grads-dtype must be one of {MAIN_GRADS_DTYPES}, got {self.main_grads_dtype!r}")
        if self.main_params_dtype is not None and self.main_params_dtype not in MAIN_PARAMS_DTYPES:
            raise ValueError(f"--main-params-dtype must be one of {MAIN_PARAMS_DTYPES}, got {self.main_params_dtype!r}")
        if self.main_params_dtype == "bf16-remainder":
            if not self.fp8_optimizer:
                raise ValueError("--main-params-dtype bf16-remainder keeps the remainders in CoatAdamW: add "
                                 "--fp8-optimizer (or --coat-fp8)")
            if self.main_grads_dtype == "fp32":
                raise ValueError("--main-params-dtype bf16-remainder needs --main-grads-dtype bf16 (DeepSpeed hands "
                                 "the optimizer its gradients in the master weights' dtype)")
        if self.fp8_group_size not in GROUP_SIZES:
            raise ValueError(f"--fp8-group-size must be one of {'/'.join(map(str, GROUP_SIZES))}, "
                             f"got {self.fp8_group_size}")


def default_main_params_dtype(fp8_optimizer: bool, bf16: bool, zero_stage: int, pipeline_parallel: int,
                              main_grads_dtype: str) -> str:
    """The master weights of a run without --main-params-dtype: bf16-remainder wherever it runs (CoatAdamW, bf16,
    ZeRO-1/2, no pipeline, bf16 main gradients), fp32 elsewhere. The remainders hold the fp32 master bit for bit in
    2 bytes per parameter instead of 4, and spare the step its fp32 round trip of the gradients and weights."""
    fits = fp8_optimizer and bf16 and zero_stage in (1, 2) and pipeline_parallel == 1 and main_grads_dtype == "bf16"
    return "bf16-remainder" if fits else "fp32"
