"""Parallel state: the one place that builds and owns the tensor (TP), pipeline (PP) and data (DP) process
groups (megatron-core's parallel_state, without module globals: the object is passed down explicitly).

The groups come from DeepSpeed's own `PipeModelDataParallelTopology` through its `PipelineParallelGrid`, with
or without pipelining, so DeepSpeed's engines (which take the grid as `mpu`) and megacoat's tensor-parallel
layers agree on every rank's coordinates. Rank layout (DeepSpeed's axis order pipe, data, model): TP ranks are
adjacent (one NVLink island first), then DP, then PP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megacoat.model.config import ModelConfig
from megacoat.parallel.config import ParallelConfig


def check_parallel_sizes(world_size: int, parallel: ParallelConfig, model: ModelConfig) -> int:
    """Validate the split of the world and of the model; return the data-parallel size. Errors name numbers."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp} = {tp * pp}")
    for what, n in (("--num-attention-heads", model.num_attention_heads),
                    ("--num-query-groups", model.num_query_groups),
                    ("--ffn-hidden-size", model.ffn_hidden_size),
                    ("--vocab-size", model.vocab_size)):
        if n % tp:
            raise ValueError(f"{what} ({n}) must be divisible by --tensor-model-parallel-size ({tp})")
    if parallel.sequence_parallel and model.seq_length % tp:
        raise ValueError(f"--sequence-parallel: --seq-length ({model.seq_length}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if model.num_layers % pp:
        raise ValueError(f"--num-layers ({model.num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({pp})")
    if pp > 1 and parallel.zero_stage > 1:
        raise ValueError(f"--zero-stage {parallel.zero_stage} with --pipeline-model-parallel-size {pp}: DeepSpeed's "
                         "pipeline engine supports ZeRO-0/1 only (stage 2 partitions gradients, which the 1F1B "
                         "schedule accumulates across micro-batches); use --zero-stage 1")
    return world_size // (tp * pp)


@dataclass
class ParallelState:
    """This rank's coordinates and groups. `grid` is DeepSpeed's PipelineParallelGrid (None for plain data
    parallelism, where DeepSpeed's defaults are the groups)."""
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    sequence_parallel: bool = False
    sequence_parallel_gather: str = "bf16"  # ParallelConfig's
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    grid: object = None

    @property
    def tp_group(self):
        return None if self.grid is None else self.grid.get_slice_parallel_group()

    @property
    def dp_group(self):
        """The ranks holding the same model shard (None: the default group, plain data parallelism)."""
        return None if self.grid is None else self.grid.get_data_parallel_group()

    @property
    def mpu(self):
        """What deepspeed.initialize takes as `mpu`: model-parallel grad norms, checkpoint shard names."""
        return self.grid


def initialize_parallel_state(parallel: ParallelConfig, model: ModelConfig) -> ParallelState:
    """Build the groups (collective: every rank calls it, once, after the default group exists)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = check_parallel_sizes(world, parallel, model)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    state = ParallelState(tp_size=tp, pp_size=pp, dp_size=dp, sequence_parallel=parallel.sequence_parallel,
                          sequence_parallel_gather=parallel.sequence_parallel_gather)
    if tp * pp == 1:  # plain data parallelism: every rank is its own model replica
        state.dp_rank = dist.get_rank() if dist.is_initialized() else 0
        return state
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp))
    state.grid = grid
    state.tp_rank, state.pp_rank = grid.get_slice_parallel_rank(), grid.get_pipe_parallel_rank()
    state.dp_rank = grid.get_data_parallel_rank()
    return state
