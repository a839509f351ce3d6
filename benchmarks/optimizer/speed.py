"""Optimizer step: torch.optim.AdamW(fused=True) (fp32 moments) against CoatAdamW's CUDA kernel (FP8 moments).

The parameters are flat fp32 buffers of odd lengths, as DeepSpeed ZeRO-1/2 hands them to the optimizer (fp32
gradients). For each optimizer: median step time (CUDA events, after warm-up), the bytes the step must move at the
least (each input read once, each output written once), achieved GB/s, and that as a fraction of a device-to-device
copy measured in the same run; optimizer-state bytes per parameter and torch.cuda.max_memory_allocated.

    python -m benchmarks.optimizer.speed [--params 1e9] [--chunks 8] [--out benchmarks/results/bench_optimizer.json]

CoatAdamW runs with and without dynamic range expansion. Without a GPU, `--sass` compiles kernels/coat_adamw.cu for
sm_90 and writes what can be judged statically (registers, spills, instructions per element, loads and stores by
width) to benchmarks/results/bench_optimizer_sass.json.
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
from megacoat.coat import CoatAdamW  # noqa: E402


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


_STATIC_FLAGS = ["-std=c++17", "-O3", "-arch=sm_90a", "-DCOAT_ADAMW_COMPILE_CHECK", "-D__CUDA_NO_HALF_OPERATORS__",
                 "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
                 "-D__CUDA_NO_HALF2_OPERATORS__"]
_BUILDS = {"full": [], "hot_path": ["-DCOAT_ADAMW_VECTOR_PATH_ONLY"],
           "expand_path": ["-DCOAT_ADAMW_VECTOR_PATH_ONLY", "-DCOAT_ADAMW_EXPAND_PATH_ONLY"]}


def sass_of_kernel(build: str) -> dict:
    """{param dtype: figures} for the G = 128 kernel. Builds: "full" (the extension's code); "hot_path"
    without the masked tail path (COAT_ADAMW_VECTOR_PATH_ONLY): whole aligned chunks; "expand_path" also without the
    k == 1 shortcuts, which the compiler builds as a second copy of the code: what is left is one straight path
    through a chunk with expansion on, so its static count is close to the dynamic one (loop and per-group
    branches aside). A thread handles 16 elements per chunk. Code after the last EXIT (slow paths of IEEE
    division, taken only for extreme operands) is not counted."""
    import collections
    import re
    import tempfile

    from benchmarks.kernels.sass import CLASSES, INSTR, tool
    from megacoat.ops.op_builder import kernels_dir

    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        cmd = ["nvcc", "-cubin", *_STATIC_FLAGS, "-Xptxas", "-v", str(kernels_dir() / "coat_adamw.cu"), "-o", cubin]
        cmd += _BUILDS[build]
        ptxas = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    spills = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'.*?\n(.*?Used \d+ registers)", ptxas, re.S):
        st, ld = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body).groups()
        spills[name] = (int(re.search(r"Used (\d+) registers", body).group(1)), int(st), int(ld))
    out = {}
    for name, text in re.findall(r"Function : (\w+)\n(.*?)(?=Function :|\Z)", sass, re.S):
        types = re.search(r"coat_adamw_kernelILi128E(\w+?)EEv", name).group(1)
        lines = text.splitlines()
        exits = [i for i, line in enumerate(lines) if re.search(r"\bEXIT\b", line)]
        lines = lines[: exits[-1] + 1] if exits else lines
        ops = [m.group(1) for m in map(INSTR.search, lines) if m and m.group(1) != "NOP"]
        mix = collections.Counter(CLASSES.get(op.split(".")[0], "other") for op in ops)
        mem = collections.Counter(op for op in ops
                                  if re.match(r"(LD|ST|RED)", op) and not op.startswith(("LDC", "LDS")))
        regs, spill_st, spill_ld = spills[name]
        per_thread = 16  # elements a thread handles per chunk
        out["bf16" if "bfloat16" in types else "fp32"] = dict(
            registers=regs, spill_store_bytes=spill_st, spill_load_bytes=spill_ld, instructions=len(ops),
            instructions_per_element=round(len(ops) / per_thread, 1),
            mix_per_element={k: round(v / per_thread, 2) for k, v in mix.most_common()},
            memory_ops=dict(sorted(mem.items())))
    return out


def static_sass(args):
    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()

    result = dict(benchmark="bench_optimizer --sass", command=" ".join([sys.executable] + sys.argv), arch="sm_90a",
                  nvcc=run("nvcc", "--version").splitlines()[-1], git_commit=run("git", "rev-parse", "HEAD"),
                  date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), group_size=128, kernels={})
    for build in _BUILDS:
        for dtype, row in sorted(sass_of_kernel(build).items()):
            result["kernels"].setdefault(f"coat_adamw {dtype}", {})[build] = row
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'kernel':22s} {'build':11s} {'regs':>4s} {'spill B':>8s} {'instr/elem':>10s}  "
          "memory instructions (whole kernel)")
    for key, builds in result["kernels"].items():
        for build, r in builds.items():
            print(f"{key:22s} {build:11s} {r['registers']:4d} {r['spill_store_bytes']:4d}/{r['spill_load_bytes']:<3d} "
                  f"{r['instructions_per_element']:10.1f}  {r['memory_ops']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--chunks", type=int, default=8, help="flat partitions (one launch covers all of them)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sass", action="store_true",
                    help="no GPU needed: static SASS of the CUDA kernel (sm_90), saved to --out "
                         "(default benchmarks/results/bench_optimizer_sass.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default benchmarks/results/bench_optimizer.json")
    args = ap.parse_args(argv)
    if args.sass:
        args.out = args.out or "benchmarks/results/bench_optimizer_sass.json"
        return static_sass(args)
    args.out = args.out or "benchmarks/results/bench_optimizer.json"
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks.optimizer.speed needs a CUDA GPU")
    n_params, G = int(args.params), args.group_size
    copy_gbps = copy_bandwidth(4 << 30, args.iters)
    hp = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rows = []
    # fused AdamW: read p, g, m, v (fp32), write p, m, v
    rows.append(bench_one("torch.optim.AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, fused=True, **hp),
                          n_params, args.chunks, args, 28.0, copy_gbps))
    # CoatAdamW: read p, g (fp32), m, v (FP8) and per group 2 x (fp32 scale + bf16 k); write p, m, v, scales, k
    coat_bytes = 4 + 4 + 1 + 1 + 4 + 1 + 1 + 2 * 2 * 6 / G
    for expand in (True, False):
        rows.append(bench_one(f"CoatAdamW(cuda, expand={expand})",
                              lambda ps: CoatAdamW(ps, group_size=G, expand=expand, backend="cuda", **hp),
                              n_params, args.chunks, args, coat_bytes, copy_gbps))
        print(rows[-1], flush=True)

    # --main-params-dtype bf16-remainder as DeepSpeed runs it: bf16 partitions with bf16 gradients, the fp32 master
    # as bf16 + int16 remainder; reads p, remainder, g (2 B each), m, v; writes p, remainder, m, v
    def with_remainders(ps):
        for q in ps:
            grad = q.grad.bfloat16()
            q.data = q.data.bfloat16()
            q.grad = grad
        return CoatAdamW(ps, group_size=G, backend="cuda", param_remainders=True, **hp)

    rows.append(bench_one("CoatAdamW(cuda, bf16 + remainders)", with_remainders, n_params, args.chunks, args,
                          2 + 2 + 2 + 1 + 1 + 2 + 2 + 1 + 1 + 2 * 2 * 6 / G, copy_gbps))
    print(rows[-1], flush=True)
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
    print(f"{'optimizer':40s} {'ms':>8s} {'B/param':>8s} {'GB/s':>8s} {'of copy':>8s} {'state B/p':>9s} "
          f"{'vs fused':>8s} {'peak GB':>8s}")
    for r in rows:
        print(f"{r['optimizer']:40s} {r['step_ms']:8.2f} {r['bytes_per_param_moved']:8.2f} {r['achieved_gbps']:8.0f} "
              f"{r['fraction_of_copy_bw']:8.2f} {r['state_bytes_per_param']:9.3f} {r['speedup_vs_fused_adamw']:8.2f} "
              f"{r['max_memory_allocated_gb']:8.2f}")


if __name__ == "__main__":
    main()
