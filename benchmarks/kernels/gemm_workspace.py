"""The FP8 GEMMs of one 1.3 B layer and micro-batch, replayed as one CUDA graph, under cuBLAS(Lt) workspace settings.

In the trained step nearly every `torch._scaled_mm` comes with a memset (cuBLASLt's, inside the call: the
profile of bench_e2e's first step traces them there), 614 a step at micro-batch 4, and inside a CUDA graph each
kernel boundary costs the GPU a microsecond or two. Whether a workspace setting removes them, and what that costs
the GEMMs, is what this measures: each setting runs in its own process (the variables are read once, when torch
first makes a cuBLAS handle), captures the layer's 12 GEMMs (forward: [q|k|v], wo, w1|w3, w2; backward: each one's
dgrad and wgrad, the gradient in E5M2) in one graph, times replays with CUDA events, and counts the graph's
memsets and kernels under the profiler.

    python -m benchmarks.kernels.gemm_workspace [--tokens 8192] [--out benchmarks/results/bench_gemm_workspace.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from benchmarks.common import RESULTS

# name -> environment of the child process (torch reads CUBLASLT_WORKSPACE_SIZE in KiB; CUBLAS_WORKSPACE_CONFIG
# is ":KiB:count" for cuBLAS, whose workspace cuBLASLt shares when torch unifies them)
SETTINGS = {
    "default": {},
    "no_workspace": {"CUBLASLT_WORKSPACE_SIZE": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"},
    "workspace_32MiB": {"CUBLASLT_WORKSPACE_SIZE": "32768", "CUBLAS_WORKSPACE_CONFIG": ":32768:2"},
}


def layer_gemms(tokens: int, hidden: int = 2048, ffn: int = 5632):
    """(a [M, K] row-major, b as _scaled_mm's column-major [K, N], out dtype) of one layer's 12 FP8 GEMMs."""
    import torch

    e4, e5, bf = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    dev = "cuda"

    def mat(r, c, dtype):
        return (torch.randn(r, c, device=dev) * 0.5).to(dtype)

    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 2 * ffn), (ffn, hidden)]  # (in, out) per linear
    out = []
    for k, n in shapes:
        x, w = mat(tokens, k, e4), mat(n, k, e4)
        g, gt, xt, wt = mat(tokens, n, e5), mat(n, tokens, e5), mat(k, tokens, e4), mat(k, n, e4)
        out.append((x, w.t(), bf))     # forward  y = x W^T
        out.append((g, wt.t(), bf))    # dgrad   dx = g W
        out.append((gt, xt.t(), bf))   # wgrad   dW = g^T x
    return out


def child(tokens: int, iters: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    gemms = layer_gemms(tokens)
    one = torch.ones((), device="cuda")

    def run():
        for a, b, dtype in gemms:
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=dtype)
    from benchmarks.layer.block import graphed  # warm-up on a side stream, then one capture

    replay = graphed(run)
    for _ in range(10):
        replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    memsets = sum(1 for e in events if "memset" in e.name.lower())
    kernels = sorted({e.name[:90] for e in events if "memset" not in e.name.lower()})
    return {"ms_per_layer": statistics.median(times), "ms_repeats": times, "memsets": memsets,
            "device_events": len(events), "kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (1.3 B model at micro-batch 4)")
    p.add_argument("--iters", type=int, default=50, help="graph replays per timed repeat (5 repeats)")
    p.add_argument("--out", default=os.path.join(RESULTS,
                                                  "bench_gemm_workspace.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.tokens, args.iters)))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: benchmarks.kernels.gemm_workspace needs a CUDA GPU (it times cuBLASLt's FP8 GEMMs in a "
                 "CUDA graph)")
    results = {}
    for name, env in SETTINGS.items():
        cmd = [sys.executable, "-m", "benchmarks.kernels.gemm_workspace", "--child", "--tokens", str(args.tokens),
               "--iters", str(args.iters)]
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            results[name] = {"env": env, "error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
        else:
            results[name] = {"env": env, **json.loads(proc.stdout.strip().splitlines()[-1])}
        r = results[name]
        print(f"{name:16s} " + (f"{r['ms_per_layer']:.3f} ms a layer's 12 GEMMs, {r['memsets']} memsets, "
                                 f"{r['device_events']} device events" if "error" not in r else f"error: {r['error']}"),
              flush=True)
    out = {"what": __doc__.splitlines()[0], "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "tokens": args.tokens, "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
