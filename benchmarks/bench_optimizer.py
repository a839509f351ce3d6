"""Optimizer step: torch.optim.AdamW(fused=True) (fp32 moments) against CoatAdamW (FP8 moments) per backend.

The parameters are flat fp32 buffers of odd lengths, as DeepSpeed ZeRO-1/2 hands them to the optimizer (fp32
gradients). For each optimizer: median step time (CUDA events, after warm-up), the bytes the step must move at the
least (each input read once, each output written once), achieved GB/s, and that as a fraction of a device-to-device
copy measured in the same run; optimizer-state bytes per parameter and torch.cuda.max_memory_allocated.

    python benchmarks/bench_optimizer.py [--params 1e9] [--chunks 8] [--out benchmarks/results/bench_optimizer.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megacoat.optim.coat_adamw import CoatAdamW  # noqa: E402


def timed(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """GB/s of a device-to-device copy, bytes read + written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = median(timed(lambda: dst.copy_(src), iters, 3))
    del src, dst
    return 2 * nbytes / (t * 1e-3) / 1e9


def make_params(n_params: int, chunks: int, seed: int):
    """`chunks` flat fp32 partitions summing to n_params, lengths not multiples of 128, with random grads."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = n_params // chunks
    sizes = [base + 37 * (i % 3) + 1 for i in range(chunks)]
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device="cuda", generator=g) * 0.02)
        # Adam moments of real runs span many decades: gradients with magnitudes over 10^-6..10^-2
        p.grad = torch.randn(n, device="cuda", generator=g) * torch.pow(
            10.0, torch.empty(n, device="cuda").uniform_(-6, -2, generator=g))
        params.append(p)
    return params, sum(sizes)


def bench_one(name: str, make_opt, n_params: int, chunks: int, args, bytes_per_param: float, copy_gbps: float):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    params, n = make_params(n_params, chunks, args.seed)
    opt = make_opt(params)
    opt.step()  # creates the state (and builds/compiles kernels)
    torch.cuda.synchronize()
    ms = median(timed(opt.step, args.iters, args.warmup))
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.device.type == "cuda")
    moved = bytes_per_param * n
    gbps = moved / (ms * 1e-3) / 1e9
    row = dict(optimizer=name, params=n, step_ms=round(ms, 3), bytes_per_param_moved=round(bytes_per_param, 4),
               gb_per_step=round(moved / 1e9, 3), achieved_gbps=round(gbps, 1),
               fraction_of_copy_bw=round(gbps / copy_gbps, 3), state_bytes_per_param=round(state / n, 4),
               max_memory_allocated_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3))
    if isinstance(opt, CoatAdamW):
        row["nonfinite_groups"] = opt.nonfinite_groups()
    del opt, params
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--chunks", type=int, default=8, help="flat partitions (one launch covers all of them)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bench_optimizer.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_optimizer.py needs a CUDA GPU")
    n_params, G = int(args.params), args.group_size
    copy_gbps = copy_bandwidth(4 << 30, args.iters)
    hp = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rows = []
    # fused AdamW: read p, g, m, v (fp32), write p, m, v
    rows.append(bench_one("torch.optim.AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, fused=True, **hp),
                          n_params, args.chunks, args, 28.0, copy_gbps))
    # CoatAdamW: read p, g (fp32), m, v (FP8) and per group 2 x (fp32 scale + bf16 k); write p, m, v, scales, k
    coat_bytes = 4 + 4 + 1 + 1 + 4 + 1 + 1 + 2 * 2 * 6 / G
    for backend in args.backends.split(","):
        # the CUDA kernel is built in two variants (kernels/coat_adamw.cu, STEP): both slices of a chunk loaded
        # before computing (interleave=1, default) or one at a time (interleave=0)
        for variant in (("1", "0") if backend == "cuda" else (None,)):
            if variant is not None:
                os.environ["MEGACOAT_COAT_ADAMW_INTERLEAVE"] = variant
            for expand in (True, False):
                tag = f", interleave={variant}" if variant is not None else ""
                name = f"CoatAdamW({backend}, expand={expand}{tag})"
                rows.append(bench_one(name, lambda ps: CoatAdamW(ps, group_size=G, expand=expand, backend=backend,
                                                                 **hp),
                                      n_params, args.chunks, args, coat_bytes, copy_gbps))
                print(rows[-1], flush=True)
        os.environ.pop("MEGACOAT_COAT_ADAMW_INTERLEAVE", None)
    base = rows[0]["step_ms"]
    for r in rows:
        r["speedup_vs_fused_adamw"] = round(base / r["step_ms"], 3)
    result = dict(
        benchmark="bench_optimizer", command=" ".join([sys.executable] + sys.argv),
        device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
        triton=__import__("triton").__version__, python=platform.python_version(),
        date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        git_commit=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
        copy_gbps=round(copy_gbps, 1), group_size=G, chunks=args.chunks, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\ndevice {result['device']}, copy {copy_gbps:.0f} GB/s, {n_params / 1e9:.2f} B params in {args.chunks} "
          f"flat partitions, G={G}")
    print(f"{'optimizer':54s} {'ms':>8s} {'B/param':>8s} {'GB/s':>8s} {'of copy':>8s} {'state B/p':>9s} "
          f"{'vs fused':>8s} {'peak GB':>8s}")
    for r in rows:
        print(f"{r['optimizer']:54s} {r['step_ms']:8.2f} {r['bytes_per_param_moved']:8.2f} {r['achieved_gbps']:8.0f} "
              f"{r['fraction_of_copy_bw']:8.2f} {r['state_bytes_per_param']:9.3f} {r['speedup_vs_fused_adamw']:8.2f} "
              f"{r['max_memory_allocated_gb']:8.2f}")


if __name__ == "__main__":
    main()
