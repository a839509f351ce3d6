"""How close the step's FP8 GEMMs run to what cuBLAS gives on this GPU: each of one 1.3 B layer's 12 FP8 GEMMs at
the step's token count (bench_gemm_workspace.layer_gemms: forward, dgrad and wgrad of [q|k|v], wo, w1|w3, w2) timed
alone, beside square 8192^3 GEMMs in FP8 (E4M3 x E4M3 and E5M2 x E4M3) and BF16, in TFLOP/s; and the output
layer's three GEMMs (vocabulary 32000) in BF16, as the model runs them, against FP8 (GEMMs only: an FP8 head would
also cast the logits' gradient, 2 x 65,536 x 32,000 bytes written a micro-batch). Each GEMM is timed
inside a CUDA graph (triton.testing.do_bench_cudagraph, median), repeated and interleaved; nvidia-smi samples the SM
clock and the power draw while it runs (a clock below the card's maximum is the power limit at work).

    python -m benchmarks.kernels.gemm_peak [--tokens 65536] [--repeats 3] [--out benchmarks/results/bench_gemm_peak.json]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys

import torch
from benchmarks.kernels.gemm_workspace import layer_gemms  # noqa: E402
from benchmarks.common import write_json  # noqa: E402

NAMES = [f"{lin} {kind}" for lin in ("qkv", "wo", "w13", "w2") for kind in ("forward", "dgrad", "wgrad")]


def _gemm(a, b, dtype):
    if a.dtype.itemsize == 1:
        one = torch.ones((), device=a.device)
        return lambda: torch._scaled_mm(a, b, one, one, out_dtype=dtype)
    return lambda: a @ b


def _square(n: int):
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda").t()
    return {f"square {n} e4m3 x e4m3": (a.to(e4), b.to(e4)), f"square {n} e5m2 x e4m3": (a.to(e5), b.to(e4)),
            f"square {n} bf16": (a.bfloat16(), b.bfloat16())}


def _head(tokens: int, hidden: int = 2048, vocab: int = 32000):
    """The output layer's three GEMMs (forward, dgrad, wgrad) in BF16, as the model runs them, and in FP8."""
    e4, e5, bf = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    x, w, g = (torch.randn(r, c, device="cuda") * 0.5 for r, c in ((tokens, hidden), (vocab, hidden), (tokens, vocab)))
    out = {}
    for tag, (xt, wt, gt) in (("bf16", (bf, bf, bf)), ("fp8", (e4, e4, e5))):
        xx, ww, gg = x.to(xt), w.to(wt), g.to(gt)
        out[f"head forward {tag}"] = (xx, ww.t())
        out[f"head dgrad {tag}"] = (gg, ww.t().contiguous().t())
        out[f"head wgrad {tag}"] = (gg.t().contiguous(), xx.t().contiguous().t())
        del xx, ww, gg
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=65536, help="the GEMMs' token dimension (micro-batch x seq)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/bench_gemm_peak.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench_cudagraph

    cases = {name: (a, b) for name, (a, b, _) in zip(NAMES, layer_gemms(args.tokens))}
    cases.update(_square(8192))
    cases.update(_head(args.tokens))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit",
                            "--format=csv,noheader,nounits", "-lms", "200"], stdout=subprocess.PIPE, text=True)
    times = {k: [] for k in cases}
    try:
        for i in range(args.repeats):  # interleaved, so drift touches all alike
            for name, (a, b) in cases.items():
                times[name].append(do_bench_cudagraph(_gemm(a, b, torch.bfloat16), rep=200, return_mode="median"))
                print(f"repeat {i + 1}: {name} {times[name][-1] * 1e3:.1f} us", flush=True)  # progress
    finally:
        smi.terminate()
        samples = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.count(",") == 3]
    rows = []
    for name, (a, b) in cases.items():
        ms = statistics.median(times[name])
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        rows.append({"gemm": name, "m": a.shape[0], "k": a.shape[1], "n": b.shape[1], "a": str(a.dtype),
                     "b": str(b.dtype), "ms": ms, "ms_repeats": times[name], "tflops": flops / ms / 1e9})
        print(f"{name:24s} [{a.shape[0]:6d} x {a.shape[1]:6d}] x [{b.shape[0]:6d} x {b.shape[1]:6d}]  "
              f"{ms * 1e3:8.1f} us  {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
    clock = [float(s[0]) for s in samples if s[0].strip().replace(".", "").isdigit()]
    power = [float(s[2]) for s in samples if s[2].strip().replace(".", "").isdigit()]
    busy = [c for c, w in zip(clock, power) if w > 300]  # samples taken while the GEMMs ran
    telemetry = {"samples": len(samples), "sm_clock_max_mhz": float(samples[0][1]) if samples else None,
                 "power_limit_w": float(samples[0][3]) if samples else None,
                 "sm_clock_median_mhz_above_300w": statistics.median(busy) if busy else None,
                 "power_median_w": statistics.median(power) if power else None}
    print("telemetry:", telemetry)
    write_json(args.out, {"what": "the step's FP8 GEMMs alone against square FP8 and BF16 GEMMs, TFLOP/s",
                          "command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                          "host": platform.node(), "torch": torch.__version__, "tokens": args.tokens,
                          "timing": "cuda graph, median of do_bench_cudagraph, repeats interleaved", "results": rows,
                          "telemetry": telemetry})
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
