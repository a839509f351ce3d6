"""Throughput of the FP8 quantization kernels on the GPU against a device-to-device copy measured in the same run.

For each kernel: median time (triton.testing.do_bench), bytes moved (each input read once, each output written
once, scales and exponents included) and GB/s as a fraction of the copy's GB/s (bytes read + written). Also:
a (block, warps) sweep of the group kernels, the cost of fusing group scaling's stage 1 into an elementwise op
(+ stage 2; per 1xG group and per tile), and a bit-exactness census of every kernel against its torch reference
on the same GPU. The session-2 versions (`*_session2`: expand_quantize lean=False, expand_dequantize and
dequantize_per_group vec=0) run beside the current ones, so one run measures old and new.

    python benchmarks/bench_quant.py [--sizes 64 256] [--out benchmarks/results/bench_quant.json]
    python benchmarks/bench_quant.py --sass   # no GPU needed: static SASS per element (sm_90), old vs new
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

from megacoat.fp8 import expand_quantize, quantize_per_group, quantize_per_tensor
from megacoat.fp8.expansion import K_MAX, K_MIN, log2_range
from megacoat.fp8.formats import get_format
from megacoat.ops import dequantize as deq_ops
from megacoat.ops import expand_dequantize as exdeq_ops
from megacoat.ops import expand_quantize as exq_ops
from megacoat.ops import group_amax as gamax_ops
from megacoat.ops import quantize_per_group as qpg_ops
from megacoat.ops import quantize_per_tensor as qpt_ops

G = 128
SWEEP = [(1024, 4), (2048, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8)]
SILU_SWEEP = [(2048, 4), (4096, 4), (8192, 8), (16384, 8)]
SWEPT = ("quantize_per_group", "dequantize_per_group", "dequantize_per_group_session2", "expand_quantize",
         "expand_dequantize", "expand_quantize_session2", "expand_dequantize_session2", "expand_quantize_approx_math",
         "expand_dequantize_approx_math")


def bench(fn) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def kernels(n: int, in_dtype: torch.dtype, fp8=torch.float8_e4m3fn, **cfg):
    """name -> (callable, bytes moved) for N elements of in_dtype (dequantize writes in_dtype)."""
    x = torch.randn(n, device="cuda", dtype=in_dtype) * torch.rand(n, device="cuda", dtype=in_dtype)
    e = x.element_size()
    q, s = qpg_ops.quantize_per_group(x, fp8, G)
    qe, se, ke = exq_ops.expand_quantize(x, fp8, G, log2_range(get_format(fp8)), K_MIN, K_MAX)
    qt, st = qpt_ops.quantize_per_tensor(x, fp8)
    amax = x.abs().amax().float()
    ng = n // G
    return {
        "quantize_per_group": (lambda: qpg_ops.quantize_per_group(x, fp8, G, **cfg), n * e + n + 4 * ng),
        "dequantize_per_group": (lambda: deq_ops.dequantize(q, s, G, in_dtype, **cfg), n + 4 * ng + n * e),
        "expand_quantize": (lambda: exq_ops.expand_quantize(x, fp8, G, log2_range(get_format(fp8)), K_MIN, K_MAX,
                                                            **cfg), n * e + n + 6 * ng),
        "expand_dequantize": (lambda: exdeq_ops.expand_dequantize(qe, se, ke, G, in_dtype, **cfg),
                              n + 6 * ng + n * e),
        # The session-2 kernels (same results): old vs new in one run.
        "dequantize_per_group_session2": (lambda: deq_ops.dequantize(q, s, G, in_dtype, vec=0, **cfg),
                                          n + 4 * ng + n * e),
        "expand_quantize_session2": (lambda: exq_ops.expand_quantize(
            x, fp8, G, log2_range(get_format(fp8)), K_MIN, K_MAX, lean=False, **cfg), n * e + n + 6 * ng),
        "expand_dequantize_session2": (lambda: exdeq_ops.expand_dequantize(qe, se, ke, G, in_dtype, vec=0, **cfg),
                                       n + 6 * ng + n * e),
        # Variants that show where expansion's time goes (not the library's defaults).
        "expand_quantize_approx_math": (lambda: exq_ops.expand_quantize(
            x, fp8, G, log2_range(get_format(fp8)), K_MIN, K_MAX, approx_math=True, **cfg), n * e + n + 6 * ng),
        "expand_dequantize_no_lut": (lambda: exdeq_ops.expand_dequantize(qe, se, ke, G, in_dtype, lut=False, **cfg),
                                     n + 6 * ng + n * e),
        "expand_dequantize_approx_math": (lambda: exdeq_ops.expand_dequantize(qe, se, ke, G, in_dtype,
                                                                             approx_math=True, **cfg),
                                          n + 6 * ng + n * e),
        # Per tensor with a known amax (group scaling supplied it): one pass.
        "quantize_per_tensor_given_amax": (lambda: qpt_ops.quantize_per_tensor(x, fp8, amax, **cfg), n * e + n),
        "dequantize_per_tensor": (lambda: deq_ops.dequantize(qt, st, None, in_dtype, **cfg), n + n * e),
        # Per tensor finding its own amax: stage 1 pass + quantize pass, so x is read twice (counted).
        "quantize_per_tensor_own_amax": (lambda: qpt_ops.quantize_per_tensor(x, fp8, **cfg), 2 * n * e + n),
    }


def bit_exact_census(n: int) -> dict:
    """Every kernel vs its torch reference on the GPU: mismatching elements (bitwise, NaN==NaN)."""
    def diff(a, b):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
        return int(((a != b) & ~(a.isnan() & b.isnan())).sum())

    out, approx = {}, {}
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(n, device="cuda", generator=g) * torch.rand(n, device="cuda", generator=g).pow(6)
    inputs = {"signed": base, "nonneg": base.square(), "rows_tail": base[: (n // 1000) * 1000].view(-1, 1000)}
    for fmt in ("e4m3", "e5m2"):
        for name, x in inputs.items():
            for dt in (torch.float32, torch.bfloat16):
                xi = x.to(dt)
                key = f"{fmt}/{name}/{str(dt).removeprefix('torch.')}"
                r = quantize_per_group(xi, fmt, G, backend="torch")
                t = quantize_per_group(xi, fmt, G, backend="triton")
                out[f"quantize_per_group/{key}"] = diff(t.data, r.data) + diff(t.scale, r.scale)
                out[f"dequantize_per_group/{key}"] = diff(r.dequantize(backend="triton"),
                                                          r.dequantize(backend="torch"))
                out[f"dequantize_per_group_session2/{key}"] = diff(
                    deq_ops.dequantize(r.data, r.scale, G, xi.dtype, vec=0), r.dequantize(backend="torch"))
                r = expand_quantize(xi, fmt, G, backend="torch")
                t = expand_quantize(xi, fmt, G, backend="triton")
                out[f"expand_quantize/{key}"] = diff(t.data, r.data) + diff(t.scale, r.scale) + diff(t.k, r.k)
                out[f"expand_dequantize/{key}"] = diff(r.dequantize(torch.float32, backend="triton"),
                                                       r.dequantize(torch.float32, backend="torch"))
                f8 = get_format(fmt)
                q2, s2, k2 = exq_ops.expand_quantize(xi, f8.dtype, G, log2_range(f8), K_MIN, K_MAX, lean=False)
                out[f"expand_quantize_session2/{key}"] = diff(q2, r.data) + diff(s2, r.scale) + diff(k2, r.k)
                for dt_out in (torch.float32, torch.bfloat16):
                    ref_out = r.dequantize(dt_out, backend="torch")
                    for name_v, vec in (("expand_dequantize", None), ("expand_dequantize_session2", 0)):
                        got = exdeq_ops.expand_dequantize(r.data, r.scale, r.k, G, dt_out, vec=vec)
                        out[f"{name_v}_{str(dt_out).removeprefix('torch.')}_out/{key}"] = diff(got, ref_out)
                if name != "rows_tail":  # approx_math: how far from the reference (a tolerance, not bit-exact)
                    f8 = get_format(fmt)
                    qa, sa, ka = exq_ops.expand_quantize(xi.reshape(-1), f8.dtype, G, log2_range(f8), K_MIN, K_MAX,
                                                         approx_math=True)
                    rq = r.data.reshape(-1).float()
                    step = torch.maximum(rq.abs() * f8.eps, torch.full_like(rq, f8.min_subnormal))
                    steps = ((qa.float() - rq).abs() / step).max().item()
                    xa = exdeq_ops.expand_dequantize(r.data.reshape(-1), r.scale.reshape(-1), r.k.reshape(-1), G,
                                                     torch.float32, approx_math=True)
                    xr = r.dequantize(torch.float32, backend="torch").reshape(-1)
                    nz = xr != 0
                    approx[key] = {"quantize_max_fp8_steps": steps,
                                   "quantize_mismatch_frac": (qa.view(torch.uint8) != r.data.reshape(-1).view(
                                       torch.uint8)).float().mean().item(),
                                   "dequantize_max_rel_err": ((xa - xr).abs()[nz] / xr.abs()[nz]).max().item(),
                                   "dequantize_flushed_frac": ((xa == 0) & nz).float().mean().item()}
                r = quantize_per_tensor(xi, fmt, backend="torch")
                t = quantize_per_tensor(xi, fmt, backend="triton")
                out[f"quantize_per_tensor/{key}"] = diff(t.data, r.data) + diff(t.scale, r.scale)
    return out, approx


def static_sass() -> dict:
    """Static SASS instructions per element of the kernels compiled for sm_90 (no GPU needed; see
    benchmarks/kernel_sass.py: a proxy for comparing two versions of one kernel, not a speed)."""
    from benchmarks.kernel_sass import compile_sm90, sass_stats

    ints = {a: "i32:16" for a in ("cols", "n_groups", "blocks_per_row")}  # as specialized at 64M-256M elements

    def count(kernel, ptrs, consts, block, warps):
        sig = {**{a: f"*{t}:16" for a, t in ptrs.items()}, **ints}
        if kernel is exq_ops._expand_quantize_kernel:
            sig.update(log2_range="fp32", k_min="fp32", k_max="fp32")
        st = sass_stats(compile_sm90(kernel, sig, {**consts, "G": G, "BLOCK_G": block // G}, warps), block)
        return {"per_element": round(st["instructions_per_element"], 2), "registers": st["registers"],
                "spill_bytes": st["stack_local_bytes"], "shared_bytes": st["shared_bytes"]}

    res = {}
    fp8 = "fp8e4nv"
    for block, warps in SWEEP:
        tile = f"block{block}_warps{warps}"
        for t in ("fp32", "bf16"):
            ptrs = dict(x_ptr=t, q_ptr=fp8, scale_ptr="fp32", k_ptr="bf16")
            for name, lean, approx in (("expand_quantize", True, False), ("expand_quantize_session2", False, False),
                                       ("expand_quantize_approx_math", True, True)):
                res[f"{name}/{t}/{tile}"] = count(exq_ops._expand_quantize_kernel, ptrs,
                                                  dict(FP8_MAX=448.0, APPROX=approx, LEAN=lean), block, warps)
            ptrs = dict(q_ptr=fp8, scale_ptr="fp32", k_ptr="bf16", lut_ptr="fp32", out_ptr=t)
            vec = 16 // (4 if t == "fp32" else 2)
            for name, vec in (("expand_dequantize", vec), ("expand_dequantize_session2", 0)):
                res[f"{name}/{t}_out/{tile}"] = count(
                    exdeq_ops._expand_dequantize_kernel, ptrs,
                    dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448, LUT=True, APPROX=False, VEC=vec,
                         LANES=4 if vec else 1), block, warps)
            res[f"quantize_per_group/{t}/{tile}"] = count(qpg_ops._quantize_per_group_kernel,
                                                          dict(x_ptr=t, q_ptr=fp8, scale_ptr="fp32"),
                                                          dict(FP8_MAX=448.0, AMAX_FLOOR=2.0 ** -119), block, warps)
            for name, v in (("dequantize_per_group", 16 // (4 if t == "fp32" else 2)),
                            ("dequantize_per_group_session2", 0)):
                res[f"{name}/{t}_out/{tile}"] = count(deq_ops._dequantize_per_group_kernel,
                                                      dict(q_ptr=fp8, scale_ptr="fp32", out_ptr=t),
                                                      dict(VEC=v, LANES=4 if v else 1), block, warps)
    for block, warps in SILU_SWEEP:
        ptrs = dict(x_ptr="bf16", y_ptr="bf16", amax_ptr="fp32")
        for name, amax, per_tile in (("silu_bf16_alone", False, False), ("silu_bf16_group_amax", True, False),
                                     ("silu_bf16_tile_amax", True, True)):
            res[f"{name}/block{block}_warps{warps}"] = count(
                gamax_ops._elementwise_group_amax_kernel, ptrs,
                dict(OP=gamax_ops.OPS["silu"], WITH_AMAX=amax, PER_TILE=per_tile, WRITE_Y=True), block, warps)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="millions of elements (2^20)")
    ap.add_argument("--out", default="benchmarks/results/bench_quant.json")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--sass", action="store_true", help="static SASS per element only (no GPU), to "
                    "benchmarks/results/bench_quant_sass.json unless --out is given")
    args = ap.parse_args()
    if args.sass:
        out = args.out if args.out != ap.get_default("out") else "benchmarks/results/bench_quant_sass.json"
        res = {"triton": triton.__version__, "target": "sm_90", "command": " ".join(sys.argv),
               "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "note": "static instruction count / elements per program; loops count once, slow paths excluded",
               "kernels": static_sass()}
        for k, v in res["kernels"].items():
            print(f"  {k:62s} {v['per_element']:6.1f}/elem  regs {v['registers']:3d}  smem {v['shared_bytes']}")
        save(res, out)
        print(f"wrote {out}")
        return
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "command": " ".join(sys.argv),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "group_size": G, "fp8": "e4m3",
           "bytes": "read + written, each input once, scales/exponents included", "sizes": {}}

    t0 = time.time()
    res["bit_exact_mismatches"], res["approx_math_vs_reference"] = bit_exact_census(1 << 22)
    print("bit-exact census (mismatching elements; 0 = bit-exact):")
    for k, v in res["bit_exact_mismatches"].items():
        if v:
            print(f"  {k}: {v}")
    print(f"  total {sum(res['bit_exact_mismatches'].values())} over {len(res['bit_exact_mismatches'])} checks "
          f"({time.time() - t0:.0f}s)")
    worst = {k: max(v[k] for v in res["approx_math_vs_reference"].values())
             for k in next(iter(res["approx_math_vs_reference"].values()))}
    print(f"approx_math vs reference, worst case: {worst}")
    save(res, args.out)

    for m in args.sizes:
        n = m << 20
        src = torch.empty(n, device="cuda", dtype=torch.float32).normal_()
        dst = torch.empty_like(src)
        copy_gbps = gbps(2 * src.nbytes, bench(lambda: dst.copy_(src)))
        del src, dst
        entry = {"copy_GBps": copy_gbps, "kernels": {}}
        for in_dtype in (torch.float32, torch.bfloat16):
            for name, (fn, nbytes) in kernels(n, in_dtype).items():
                ms = bench(fn)
                entry["kernels"][f"{name}/{str(in_dtype).removeprefix('torch.')}"] = {
                    "ms": ms, "bytes": nbytes, "GBps": gbps(nbytes, ms), "frac_of_copy": gbps(nbytes, ms) / copy_gbps}
            torch.cuda.empty_cache()

        # Group scaling: stage 1 fused into an elementwise op (silu, bf16 -> bf16) + stage 2, vs the op alone.
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        plain = bench(lambda: gamax_ops.elementwise_group_amax(x, "silu", G, torch.bfloat16, with_amax=False))
        fused = bench(lambda: gamax_ops.elementwise_group_amax(x, "silu", G, torch.bfloat16))
        both = bench(lambda: gamax_ops.reduce_group_amax(
            gamax_ops.elementwise_group_amax(x, "silu", G, torch.bfloat16)[1]))
        fused_t = bench(lambda: gamax_ops.elementwise_group_amax(x, "silu", G, torch.bfloat16, per_tile=True))
        both_t = bench(lambda: gamax_ops.reduce_group_amax(
            gamax_ops.elementwise_group_amax(x, "silu", G, torch.bfloat16, per_tile=True)[1]))
        entry["group_scaling_silu_bf16"] = {
            "op_alone_ms": plain, "op_plus_stage1_ms": fused, "op_plus_stage1_stage2_ms": both,
            "overhead_stage1": fused / plain - 1, "overhead_two_stage": both / plain - 1,
            "per_tile_op_plus_stage1_ms": fused_t, "per_tile_op_plus_stage1_stage2_ms": both_t,
            "per_tile_overhead_stage1": fused_t / plain - 1, "per_tile_overhead_two_stage": both_t / plain - 1,
            "op_alone_frac_of_copy": gbps(4 * n, plain) / copy_gbps}
        del x

        if not args.skip_sweep and m == max(args.sizes):
            sweep = {}
            for in_dtype in (torch.float32, torch.bfloat16):
                for block, warps in SWEEP:
                    ks = kernels(n, in_dtype, block=block, num_warps=warps)
                    for name in SWEPT:
                        fn, nbytes = ks[name]
                        sweep[f"{name}/{str(in_dtype).removeprefix('torch.')}/block{block}_warps{warps}"] = \
                            gbps(nbytes, bench(fn)) / copy_gbps
                    del ks
                    torch.cuda.empty_cache()
            x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            for block, warps in SILU_SWEEP:
                cfg = dict(block=block, num_warps=warps)
                plain = bench(lambda: gamax_ops.elementwise_group_amax(x, "silu", G, torch.bfloat16, with_amax=False,
                                                                      **cfg))
                sweep[f"silu_bf16_alone/block{block}_warps{warps}"] = gbps(4 * n, plain) / copy_gbps
                for per_tile in (False, True):
                    both = bench(lambda: gamax_ops.reduce_group_amax(
                        gamax_ops.elementwise_group_amax(x, "silu", G, torch.bfloat16, per_tile=per_tile, **cfg)[1]))
                    kind = "per_tile" if per_tile else "per_group"
                    sweep[f"silu_bf16_two_stage_overhead_{kind}/block{block}_warps{warps}"] = both / plain - 1
            del x
            entry["sweep_frac_of_copy"] = sweep
        res["sizes"][f"{m}M"] = entry
        save(res, args.out)
        torch.cuda.empty_cache()

        print(f"\n{m}M elements (2^20), copy {copy_gbps:.0f} GB/s")
        print(f"  {'kernel':44s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}")
        for k, v in entry["kernels"].items():
            print(f"  {k:44s} {v['ms']:8.3f} {v['GBps']:8.0f} {v['frac_of_copy']:8.1%}")
        gs = entry["group_scaling_silu_bf16"]
        print(f"  group scaling on silu bf16: stage 1 +{gs['overhead_stage1']:.1%}, "
              f"stage 1+2 +{gs['overhead_two_stage']:.1%}; per tile: stage 1 +{gs['per_tile_overhead_stage1']:.1%}, "
              f"stage 1+2 +{gs['per_tile_overhead_two_stage']:.1%} "
              f"(op alone {gs['op_alone_frac_of_copy']:.0%} of copy)")
        if "sweep_frac_of_copy" in entry:
            best = {}
            for k, v in entry["sweep_frac_of_copy"].items():
                kern = k.rsplit("/", 1)[0]
                if "overhead" in kern:
                    print(f"  {k:55s} {v:+.1%}")
                    continue
                if v > best.get(kern, ("", 0))[1]:
                    best[kern] = (k.rsplit("/", 1)[1], v)
            for kern, (cfg, v) in best.items():
                print(f"  best {kern:34s} {cfg:20s} {v:.1%}")

    save(res, args.out)
    print(f"\nwrote {args.out}")


def save(res: dict, path: str) -> None:
    """Written after every section, so a run cut short still leaves what it measured."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
