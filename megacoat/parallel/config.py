"""ParallelConfig: tensor / pipeline sizes (data parallel is what is left of the world)."""
from __future__ import annotations

from dataclasses import dataclass

# what a COAT block's sequence-parallel all-gather carries: the 1xG E4M3 groups its fused norm rounds its input to
# (codes and scales, megacoat.parallel.mappings.gather_fp8_from_sp), or the input in the run's dtype
SEQUENCE_PARALLEL_GATHERS = ("fp8", "bf16")
# what ZeRO-3's all-gather of a COAT block's GEMM weights carries: E4M3 codes and one scale, or the weights' dtype
ZERO3_WEIGHT_GATHERS = ("fp8", "bf16")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 1
    # bf16 by default until the FP8 gathers are measured on several GPUs (the CPU tests hold them bit for bit)
    sequence_parallel_gather: str = "bf16"  # SEQUENCE_PARALLEL_GATHERS
    zero3_weight_gather: str = "bf16"  # ZERO3_WEIGHT_GATHERS
    # ZeRO-1/2: each gradient bucket reduced as soon as backward has made it, overlapping the rest of backward
    # (DeepSpeed's overlap_comm; Megatron's --overlap-grad-reduce). Off until measured on several GPUs.
    overlap_grad_reduce: bool = False

    def __post_init__(self):
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if self.zero3_weight_gather not in ZERO3_WEIGHT_GATHERS:
            raise ValueError(f"--zero3-weight-gather must be one of {ZERO3_WEIGHT_GATHERS}, "
                             f"got {self.zero3_weight_gather!r}")
        if self.overlap_grad_reduce and self.zero_stage not in (1, 2):
            raise ValueError(f"--overlap-grad-reduce needs --zero-stage 1 or 2 (DeepSpeed's ZeRO-1/2 optimizer reduces "
                             f"the buckets; ZeRO-3 overlaps its own), got {self.zero_stage}")
        if self.overlap_grad_reduce and self.pipeline_model_parallel_size > 1:
            raise ValueError("--overlap-grad-reduce does not support --pipeline-model-parallel-size > 1 (DeepSpeed's "
                             "pipeline engine reduces after its schedule), got "
                             f"{self.pipeline_model_parallel_size}")
        if self.sequence_parallel_gather not in SEQUENCE_PARALLEL_GATHERS:
            raise ValueError(f"--sequence-parallel-gather must be one of {SEQUENCE_PARALLEL_GATHERS}, "
                             f"got {self.sequence_parallel_gather!r}")
