"""Throughput of the FP8 quantizers the training path runs, against a device-to-device copy in the same run.

The kernels: `quantize_transpose` (every FP8 linear's operands: per-tensor amax, then one cast that writes the
row-major and/or transposed copy), and the fused activation quantizers of the COAT flow: `rmsnorm_fp8_fwd` /
`rmsnorm_fp8_out` and `swiglu_fp8_fwd` / `swiglu_fp8_out` (1xG group-scaled E4M3 input saved for backward, a
per-tensor-scaled E4M3 output). CoatAdamW's quantizer runs inside its step: benchmarks/optimizer/speed.py.
For each: median time (triton.testing.do_bench), bytes moved (each read and write counted, x read twice where
the amax pass reads it), GB/s as a fraction of the copy's GB/s (bytes read + written), and how many FP8 codes
differ from the torch reference on the same device (0 = bit-exact).

    python -m benchmarks.kernels.quant [--tokens 8192] [--hidden 4096] [--ffn 11008] [--out ...bench_quant.json]
    python -m benchmarks.kernels.quant --cpu-smoke   # no GPU: tiny shapes, kernels under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from megacoat.ops import cast_transpose as ct, rmsnorm, swiglu  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def bench(fn, device: str) -> float:
    """Median milliseconds (do_bench on the GPU; three wall-clock calls under the CPU interpreter)."""
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


def cases(m: int, h: int, f: int, g: int, device: str):
    """name -> (kernel call, bytes moved, codes that differ from the reference)."""
    bf = torch.bfloat16
    x = torch.randn(m, h, device=device, dtype=bf)
    w = (1 + 0.1 * torch.randn(h, device=device)).to(bf)
    a13 = torch.randn(m, 2 * f, device=device, dtype=bf)
    n, nf = m * h, m * f
    out = {}
    for name, row, col in (("quantize_transpose(both)", True, True), ("quantize_transpose(rowwise)", True, False),
                           ("quantize_transpose(transpose)", False, True)):
        q, qt, _ = ct.quantize_transpose_triton(x, E4M3, row, col)
        rq, rqt, _ = ct.quantize_transpose_ref(x, E4M3, row, col)
        diff = (mismatches(q, rq) if row else 0) + (mismatches(qt, rqt) if col else 0)
        out[name] = (lambda row=row, col=col: ct.quantize_transpose_triton(x, E4M3, row, col),
                     2 * n + 2 * n + n * (int(row) + int(col)), diff)
    grad = torch.randn(m, h, device=device, dtype=bf)
    q, qt, _ = ct.quantize_transpose_triton(grad, E5M2)
    rq, rqt, _ = ct.quantize_transpose_ref(grad, E5M2)
    out["quantize_transpose(both, E5M2 grad)"] = (lambda: ct.quantize_transpose_triton(grad, E5M2), 6 * n,
                                                  mismatches(q, rq) + mismatches(qt, rqt))

    fwd = rmsnorm.rmsnorm_fp8_fwd_triton(x, w, 1e-5, g)
    ref = rmsnorm.rmsnorm_fp8_fwd_ref(x, w, 1e-5, g)
    out["rmsnorm_fp8_fwd"] = (lambda: rmsnorm.rmsnorm_fp8_fwd_triton(x, w, 1e-5, g),
                              2 * n + 2 * h + n + 4 * n // g + 4 * m + n, mismatches(fwd[0], ref[0]))
    y = rmsnorm.rmsnorm_fp8_out_triton(*fwd[:3], w, fwd[3], g, False)
    y_ref = rmsnorm.rmsnorm_fp8_out_ref(*fwd[:3], w, fwd[3], g, False)
    out["rmsnorm_fp8_out"] = (lambda: rmsnorm.rmsnorm_fp8_out_triton(*fwd[:3], w, fwd[3], g, False),
                              n + 4 * n // g + 4 * m + 2 * h + n, mismatches(y, y_ref))

    sfwd = swiglu.swiglu_fp8_fwd_triton(a13, g)
    sref = swiglu.swiglu_fp8_fwd_ref(a13, g)
    out["swiglu_fp8_fwd"] = (lambda: swiglu.swiglu_fp8_fwd_triton(a13, g), 4 * nf + 2 * nf + 8 * nf // g + nf,
                             mismatches(sfwd[0], sref[0]) + mismatches(sfwd[2], sref[2]))
    s = swiglu.swiglu_fp8_out_triton(*sfwd[:5], g, False)
    s_ref = swiglu.swiglu_fp8_out_ref(*sfwd[:5], g, False)
    out["swiglu_fp8_out"] = (lambda: swiglu.swiglu_fp8_out_triton(*sfwd[:5], g, False), 2 * nf + 8 * nf // g + nf,
                             mismatches(s, s_ref))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="rows (micro-batch x sequence)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (interpreter): checks the "
                    "script and the JSON, measures nothing meaningful")
    ap.add_argument("--out", default=None, help="default benchmarks/results/bench_quant.json (--cpu-smoke: "
                    "benchmarks/results/bench_quant_cpu_smoke.json)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, (m, h, f) = "cpu", (64, 256, 128)
        args.out = args.out or "benchmarks/results/bench_quant_cpu_smoke.json"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("error: benchmarks.kernels.quant needs a CUDA GPU (or --cpu-smoke)")
        device, (m, h, f) = "cuda", (args.tokens, args.hidden, args.ffn)
        args.out = args.out or "benchmarks/results/bench_quant.json"
    torch.manual_seed(0)
    src = torch.randn(m * 2 * f, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.nbytes / bench(lambda: dst.copy_(src), device) / 1e6
    del src, dst
    rows = {}
    for name, (fn, nbytes, diff) in cases(m, h, f, args.group_size, device).items():
        ms = bench(fn, device)
        gbps = nbytes / ms / 1e6
        rows[name] = dict(ms=round(ms, 4), bytes=nbytes, GBps=round(gbps, 1), frac_of_copy=round(gbps / copy_gbps, 3),
                          codes_differing_from_reference=diff)
    res = dict(
        benchmark="bench_quant", command=" ".join([sys.executable] + sys.argv),
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
        date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        git_commit=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
        shape=dict(tokens=m, hidden=h, ffn=f, group_size=args.group_size), input_dtype="bfloat16",
        copy_GBps=round(copy_gbps, 1), kernels=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"{res['device']}: tokens {m}, hidden {h}, ffn {f}, G {args.group_size}; copy {copy_gbps:.0f} GB/s")
    print(f"  {'kernel':38s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s} {'codes != ref':>12s}")
    for k, v in rows.items():
        print(f"  {k:38s} {v['ms']:9.4f} {v['GBps']:8.0f} {v['frac_of_copy']:8.1%} "
              f"{v['codes_differing_from_reference']:12d}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
