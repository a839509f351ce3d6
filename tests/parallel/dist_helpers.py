"""Run a function on N CPU ranks (gloo) in fresh processes; each rank's return value comes back in rank order."""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        import deepspeed  # its comm layer wraps torch's default group (parallel state builds DeepSpeed's grid)

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        queue.put((rank, fn(*args), None))
    except BaseException:  # the parent reports it with the rank that failed
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 240):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, value, error = queue.get(timeout=timeout)
            if error:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world)]
