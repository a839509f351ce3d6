"""The sequence-parallel all-gather in front of a COAT block, alone: bf16 (`gather_from_sp`) against E4M3 codes with
1xG scales (`gather_fp8_from_sp`: quantize, one uint8 collective, dequantize), forward and forward + backward (the
backward is the same bf16 reduce-scatter in both), per call, on N ranks of one host.

    python -m benchmarks.parallel.sp_gather --gpus 4 --hidden-size 4096 --seq-length 2048 --micro-batch-size 1 2
    # CPU check (gloo)
    python -m benchmarks.parallel.sp_gather --gpus 2 --hidden-size 128 --seq-length 64 --iters 3 --warmup 1

Each rank gathers its [micro-batch, seq / N, hidden] shard; a row reports the median time per call over --iters calls
after --warmup (CUDA events on GPUs), the bytes each rank sends, and the FP8 gather's time against bf16's. With
--compile each variant runs compiled (as the trainer's --compile runs the blocks that call it), so the
quantization and dequantization are fused kernels.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import RESULTS, environment, free_port, write_json

VARIANTS = ("bf16", "fp8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="ranks (GPUs; CPU ranks on a machine without CUDA)")
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[1, 2])
    p.add_argument("--group-size", type=int, default=128, help="the FP8 gather's 1xG groups (--fp8-group-size)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--compile", action="store_true", help="each variant under torch.compile")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/sp_gather_<N>gpu.json)")
    args = p.parse_args(argv)
    if args.seq_length % args.gpus:
        raise SystemExit(f"error: --seq-length {args.seq_length} is not divisible by --gpus {args.gpus}")
    if args.gpus < 2 or args.iters < 1 or args.warmup < 0:
        raise SystemExit("error: --gpus must be at least 2, --iters positive")
    return args


def _gather(variant: str, group_size: int):
    from megacoat.parallel.mappings import gather_fp8_from_sp, gather_from_sp

    group = dist.group.WORLD
    if variant == "fp8":
        return lambda x: gather_fp8_from_sp(x, group, group_size)
    return lambda x: gather_from_sp(x, group)


def _timed(fn, warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds per call."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def _bytes_sent(fn, x) -> int:
    """What this rank puts on the wire in one forward: the all-gathers' input bytes."""
    sent, real = [], dist.all_gather_into_tensor

    def counted(out, inp, *a, **kw):
        sent.append(inp.numel() * inp.element_size())
        return real(out, inp, *a, **kw)

    from megacoat.parallel import mappings

    mappings.dist.all_gather_into_tensor = counted
    try:
        with torch.no_grad():
            fn(x)
    finally:
        mappings.dist.all_gather_into_tensor = real
    return sum(sent)


def _rank(rank: int, args: argparse.Namespace, port: int, rows: dict) -> None:
    on_cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if on_cuda else "gloo", rank=rank, world_size=args.gpus)
    device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    shard = args.seq_length // args.gpus
    for mb in args.micro_batch_size:
        x = torch.randn(mb, shard, args.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(mb, args.seq_length, args.hidden_size, device=device, dtype=torch.bfloat16)
        for variant in VARIANTS:
            gather = _gather(variant, args.group_size)
            sent = _bytes_sent(gather, x)
            fn = torch.compile(gather) if args.compile else gather
            forward = _timed(lambda: fn(x.detach()), args.warmup, args.iters, device)
            both = _timed(lambda: fn(x).backward(grad), args.warmup, args.iters, device)
            if rank == 0:
                rows[f"mb{mb}/{variant}"] = {"variant": variant, "micro_batch_size": mb, "ms_forward": forward,
                                             "ms_forward_backward": both, "bytes_sent_per_rank": sent,
                                             "bytes_per_element": sent / x.numel()}
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if torch.cuda.is_available() and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"error: --gpus {args.gpus}: this machine has {torch.cuda.device_count()}")
    with mp.Manager() as manager:
        rows = manager.dict()
        mp.spawn(_rank, args=(args, free_port(), rows), nprocs=args.gpus)
        rows = dict(rows)
    for mb in args.micro_batch_size:
        fp8, bf16 = rows[f"mb{mb}/fp8"], rows[f"mb{mb}/bf16"]
        fp8["speedup_vs_bf16_forward"] = bf16["ms_forward"] / fp8["ms_forward"]
        fp8["speedup_vs_bf16_forward_backward"] = bf16["ms_forward_backward"] / fp8["ms_forward_backward"]
    env = environment()
    out = {"environment": env, "gpus": args.gpus, "hidden_size": args.hidden_size, "seq_length": args.seq_length,
           "group_size": args.group_size, "compile": args.compile,
           "method": {"warmup_calls": args.warmup, "timed_calls": args.iters, "statistic": "median per call"},
           "rows": rows}
    path = os.path.abspath(args.out or os.path.join(RESULTS, f"sp_gather_{args.gpus}gpu.json"))
    write_json(path, out)
    for key, r in rows.items():
        print(key, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    print("wrote", path)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
