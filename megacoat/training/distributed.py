"""Process start-up: one rank per GPU (NCCL) or per CPU process (gloo), through DeepSpeed's launcher or alone."""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from megacoat.config import DEFAULT_TIMEOUT_MINUTES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce (`deepspeed_shm_comm_op`, about a
    minute of silence on the first run of a machine): its communication backend builds it at start-up, but
    only DeepSpeed's `inference_all_reduce` uses it; training's collectives go through torch.distributed
    (gloo on CPU). Without the op that function falls back to torch.distributed too."""
    import importlib

    # By module name: the package `deepspeed.comm` re-exports `torch` itself under the same attribute.
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_comm_torch, "build_shm_op"):
        ds_comm_torch.build_shm_op = lambda: None


def init_distributed(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> torch.device:
    """Join (or, run as plain `python`, create) the default process group; return this rank's device.

    timeout_minutes (--distributed-timeout-minutes): how long a collective waits for a stopped or hung rank
    before the waiting ranks fail, in every process group of the run (the default group, the ones megacoat's
    parallel state and DeepSpeed's ZeRO and pipeline build later: see `_groups_inherit_timeout`)."""
    import deepspeed

    if "RANK" not in os.environ:  # `python pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    on_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_cuda:
        torch.cuda.set_device(local_rank)
    else:
        skip_shm_comm_op()
    timeout = timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo", auto_mpi_discovery=False,
                                   verbose=False, timeout=timeout)
    _groups_inherit_timeout(timeout)
    return torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")


def _groups_inherit_timeout(timeout: timedelta) -> None:
    """Give every group made through `deepspeed.comm.new_group` the run's timeout. DeepSpeed builds its groups
    (ZeRO's data-parallel group, the pipeline grid megacoat's parallel state takes its TP/PP/DP groups from) by
    `torch.distributed.new_group(ranks)`, which takes torch's own default (30 minutes), not the default group's
    timeout nor DEEPSPEED_TIMEOUT."""
    import importlib

    cdb = importlib.import_module("deepspeed.comm.comm").cdb
    if cdb is None or not hasattr(cdb, "new_group"):
        return
    cdb.new_group = lambda ranks: dist.new_group(ranks, timeout=timeout)


def shutdown_distributed() -> None:
    """Leave the process group once every rank is done, before the interpreter exits.

    Left to interpreter exit, the process group's C++ threads are torn down in no set order, and a rank can
    abort after training finished ("terminate called without an active exception", status -6 under
    DeepSpeed's launcher). The barrier keeps a fast rank from closing its connections while a slow one still
    talks to it. Only for a run that ended normally: after an error another rank may never reach the barrier.
    Free the DeepSpeed engine first (pretrain_gpt.main): its work handles outliving the group aborted a rank too."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_mean(value: torch.Tensor, group=None) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value / dist.get_world_size(group)


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class StalledRankError(RuntimeError):
    """A collective gave up waiting for another rank after --distributed-timeout-minutes."""


@contextmanager
def stalled_rank_errors(timeout_minutes: float):
    """Name the flag when a collective times out: gloo raises a RuntimeError that says "Timed out" and points at
    its own source file. (NCCL's watchdog aborts the process itself once the timeout passes.)"""
    try:
        yield
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise
        raise StalledRankError(f"a collective waited --distributed-timeout-minutes {timeout_minutes:g} for another "
                               f"rank, which stopped or hung (its own output says why); this rank stops") from e
