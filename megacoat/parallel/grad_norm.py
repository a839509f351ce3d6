"""The global gradient norm of a model split over TP and PP ranks: each gradient element counted once."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megacoat.parallel.state import ParallelState


def global_grad_norm(params, state: ParallelState) -> float:
    """Sharded parameters (`tensor_model_parallel`) count on every TP rank, replicated ones on TP rank 0 only,
    a tied copy that DeepSpeed marks `ds_pipe_replicated` not at all; the sum runs over this data-parallel
    replica's TP x PP ranks (call after the data-parallel gradient all-reduce)."""
    squares = []
    for p in params:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if state.tp_rank > 0 and not getattr(p, "tensor_model_parallel", False):
            continue
        squares.append(p.grad.float().pow(2).sum())
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if state.grid is not None and state.tp_size * state.pp_size > 1:
        dist.all_reduce(total, group=state.grid.get_model_parallel_group())
    return float(total.sqrt())
