"""MegacoatConfig: every package's config dataclass in one object, built by megacoat.arguments and passed down;
TrainingConfig, the trainer's own settings, lives here too so that no config import reaches into training/."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from megacoat.data.config import DataConfig
from megacoat.coat.recipe import CoatRecipe
from megacoat.model.config import ModelConfig
from megacoat.optim.config import OptimizerConfig
from megacoat.parallel.config import ParallelConfig

PRECISIONS = ("auto", "bf16", "fp32")
CUBLAS_WORKSPACES = ("auto", "default", "none")  # --cublas-workspace (megacoat.training.runtime)
# --distributed-timeout-minutes: Megatron's default, far below torch's 30 minutes; long enough for rank 0's
# one-off work (a save, the embedded corpus's first preparation) while the other ranks wait.
DEFAULT_TIMEOUT_MINUTES = 10.0


@dataclass
class TrainingConfig:
    micro_batch_size: int = 8
    global_batch_size: int = 16
    train_iters: int = 200
    seed: int = 1234
    # auto: bf16 on CUDA, fp32 on CPU (bf16 matmuls on a CPU are slow and gain nothing).
    precision: str = "auto"
    log_interval: int = 10
    log_json: str | None = None
    eval_interval: int = 100
    eval_iters: int = 10
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    deepspeed_config: str | None = None  # a user JSON; None: written from these flags
    keep_last: int | None = None  # keep the newest K checkpoints under --save (None: all)
    exit_interval: int | None = None  # save and exit when iteration % N == 0
    exit_duration_in_mins: float | None = None  # save and exit after this much wall time
    # Non-finite steps are skipped; this many in a row stop the run (a diverged run, not a stray spike).
    max_skipped_steps: int | None = 10
    # bf16 ZeRO-1/2: refuse a non-finite step with DeepSpeed's host check (holds the LR schedule, drains the GPU's
    # queue every step) instead of on the device (training/deepspeed_patches.py)
    host_overflow_check: bool = False
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    compile: bool = False  # torch.compile each transformer block (fuses norms, RoPE, SwiGLU element-wise work)
    enable_cuda_graph: bool = False  # compile the blocks in mode reduce-overhead (CUDA graphs); needs compile
    cublas_workspace: str = "auto"  # "none": cuBLAS(Lt) without a workspace; auto: none with FP8 GEMMs
    profile_dir: str | None = None  # torch.profiler trace + top operators of iterations (start, end]
    profile_step_start: int = 10
    profile_step_end: int = 12
    debug: bool = False  # show an error's traceback instead of its one `error:` line
    # Loading another run's checkpoint: weights only, everything else from zero (Megatron's --finetune); convert
    # an optimizer state of another kind or settings (AdamW <-> CoatAdamW) instead of refusing it.
    finetune: bool = False
    override_optimizer_state: str | None = None  # None or "convert"
    # How long a collective waits for a stopped or hung rank before the others fail (every process group).
    distributed_timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES

    def __post_init__(self):
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval", "eval_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.eval_iters < 0:
            raise ValueError(f"--eval-iters must be >= 0, got {self.eval_iters}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"--global-batch-size ({self.global_batch_size}) must be divisible by "
                             f"--micro-batch-size ({self.micro_batch_size})")
        if self.save_interval is not None and self.save_interval <= 0:
            raise ValueError(f"--save-interval must be positive, got {self.save_interval}")
        if self.save_interval is not None and self.save is None:
            raise ValueError("--save-interval needs --save DIR")
        for name in ("keep_last", "exit_interval", "max_skipped_steps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ValueError(f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}")
        if self.profile_dir is not None and not 0 <= self.profile_step_start < self.profile_step_end <= self.train_iters:
            raise ValueError(f"need 0 <= --profile-step-start ({self.profile_step_start}) < --profile-step-end "
                             f"({self.profile_step_end}) <= --train-iters ({self.train_iters})")
        if self.keep_last is not None and self.save is None:
            raise ValueError("--keep-last needs --save DIR")
        if self.finetune and self.load is None:
            raise ValueError("--finetune needs --load DIR")
        if self.override_optimizer_state not in (None, "convert"):
            raise ValueError(f"--override-optimizer-state must be 'convert', got {self.override_optimizer_state!r}")
        if self.cublas_workspace not in CUBLAS_WORKSPACES:
            raise ValueError(f"--cublas-workspace must be one of {', '.join(CUBLAS_WORKSPACES)}, got "
                             f"{self.cublas_workspace!r}")
        if self.enable_cuda_graph and not self.compile:
            raise ValueError("--enable-cuda-graph captures the compiled blocks: it needs --compile")

    def gradient_accumulation_steps(self, data_parallel_size: int) -> int:
        """Micro-batches per rank per step; the global batch must split evenly over the DP ranks."""
        per_step = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size ({self.global_batch_size}) must be divisible by --micro-batch-size "
                f"({self.micro_batch_size}) x data-parallel size ({data_parallel_size})")
        return self.global_batch_size // per_step


@dataclass
class MegacoatConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    fp8: CoatRecipe = field(default_factory=CoatRecipe)  # resolved by CoatRecipe.for_layout before use
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def to_dict(self) -> dict:
        return asdict(self)


def check_cuda_graph(parallel: ParallelConfig, cuda_available: bool | None = None) -> None:
    """Raise ValueError naming the flag for a setting --enable-cuda-graph cannot run with: no CUDA device, or
    ZeRO-3. Pipeline stages are captured per micro-batch slot (megacoat.parallel.stage_graphs)."""
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        raise ValueError("--enable-cuda-graph needs a CUDA device (CUDA graphs replay GPU work; none is available)")
    if parallel.zero_stage == 3:
        raise ValueError("--enable-cuda-graph does not support --zero-stage 3 (each block all-gathers its weights "
                         "into new memory on every call; a CUDA graph replays fixed addresses)")


def zero3_weight_cache(zero_stage: int) -> str | None:
    """The --fp8-weight-cache a ZeRO-3 run takes when the flag is not given (None: the recipe's own)."""
    return "none" if zero_stage == 3 else None


def check_zero3(parallel: ParallelConfig, fp8: CoatRecipe) -> None:
    """Raise ValueError naming the flag for a setting --zero-stage 3 cannot run with: DeepSpeed's pipeline engine
    (ZeRO-0/1 only), tensor parallelism (untested with ZeRO-3's gathers), and FP8 weight copies kept between steps
    (a full copy of each weight on every rank, made after the step from weights ZeRO-3 holds partitioned)."""
    if parallel.zero_stage != 3:
        return
    if parallel.pipeline_model_parallel_size > 1:
        raise ValueError("--zero-stage 3 does not support --pipeline-model-parallel-size > 1 (DeepSpeed's pipeline "
                         f"engine runs ZeRO-0/1 only), got {parallel.pipeline_model_parallel_size}")
    if parallel.tensor_model_parallel_size > 1:
        raise ValueError("--zero-stage 3 does not support --tensor-model-parallel-size > 1 (untested), got "
                         f"{parallel.tensor_model_parallel_size}")
    if fp8.enabled and fp8.weight_cache != "none":
        raise ValueError(f"--fp8-weight-cache {fp8.weight_cache} keeps a full FP8 copy of every weight, which "
                         "--zero-stage 3 partitions: use --fp8-weight-cache none (the ZeRO-3 default)")
