"""One Llama transformer layer, forward + backward, per activation mode (compare COAT's benchmark_olmolayer.py).

Modes: bf16 (eager, the model's code), bf16-compile (torch.compile of the same layer), fp8-linear, coat.
For each micro-batch: median time (CUDA events, triton.testing.do_bench), tokens/s, peak memory above the
inputs (torch.cuda.max_memory_allocated), bytes saved for backward (saved_tensors_hooks, unique storages,
parameters excluded), and ratios against eager and compiled BF16 measured in the same run. It also measures
the FP8 GEMM ceiling (_scaled_mm 8192^3) and the time of the layer's GEMMs alone in FP8, so the fp8-linear
figure can be read against what its GEMMs allow.

    PYTHONPATH=. python benchmarks/bench_layer.py [--micro-batches 1 2 4] [--out benchmarks/results/bench_layer.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time

import torch
import triton

from megacoat.fp8.config import FP8Config
from megacoat.fp8.convert import convert_to_fp8
from megacoat.fp8.saved_memory import saved_activation_bytes
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT, rope_tables

LLAMA2_7B = dict(hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, seq_length=2048)


def environment() -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "command": " ".join(sys.argv),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def measure(module, x, params, extra=()) -> dict:
    """Time, peak memory and saved bytes of module(x, *extra).backward(dy)."""
    dy = torch.randn_like(x)

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        module(x, *extra).backward(dy)

    step()  # compile / autotune / build FP8 weight caches outside the measurements
    torch.cuda.synchronize()
    ms = bench_ms(step)
    for p in params:
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    saved, by_dtype = saved_activation_bytes(lambda: module(x, *extra), params)
    with torch.no_grad():  # kept for the caller's check that every mode computes the same function
        out = (module(x, *extra) - x).float()  # the branches' output: the residual x would hide their error
    return {"ms": ms, "peak_mem_bytes": peak, "saved_bytes": saved, "saved_by_dtype": by_dtype, "_out": out}


def check_outputs(rows: list[dict]) -> None:
    """Relative error of each mode's output against eager BF16 on the same input (a fast wrong kernel would
    show here, not as a speed-up)."""
    ref = rows[0]["_out"]
    for r in rows:
        r["out_rel_err_vs_bf16"] = ((r["_out"] - ref).norm() / ref.norm()).item()
    for r in rows:
        del r["_out"]


def add_ratios(rows: list[dict], tokens: int) -> None:
    base = {r["mode"]: r for r in rows}
    for r in rows:
        r["tokens_per_s"] = tokens / (r["ms"] / 1e3)
        r["speedup_vs_bf16_eager"] = base["bf16"]["ms"] / r["ms"]
        if "bf16-compile" in base:
            r["speedup_vs_bf16_compile"] = base["bf16-compile"]["ms"] / r["ms"]
            r["saved_vs_bf16_compile"] = r["saved_bytes"] / base["bf16-compile"]["saved_bytes"]
        r["saved_vs_bf16_eager"] = r["saved_bytes"] / base["bf16"]["saved_bytes"]
        r["peak_mem_vs_bf16_eager"] = r["peak_mem_bytes"] / base["bf16"]["peak_mem_bytes"]


def fp8_gemm_peak_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def layer_gemm_shapes(cfg: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """(M, N, K) of every GEMM of one layer's forward and backward (fused as the coat mode runs them)."""
    h, f, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups * cfg.head_dim
    shapes = []
    for n, k in ((h + 2 * kv, h), (h, h), (2 * f, h), (h, f)):  # qkv, wo, w1|w3, w2
        shapes += [(tokens, n, k), (tokens, k, n), (n, k, tokens)]  # forward, dgrad, wgrad
    return shapes


def fp8_gemms_ms(shapes) -> float:
    one = torch.ones(1, device="cuda")
    ops = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        ops.append((a, b))

    def run():
        for a, b in ops:
            torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return bench_ms(run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/bench_layer.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, vocab_size=128, **LLAMA2_7B)
    layer = GPT(cfg).layers[0].cuda().bfloat16()  # built by the model, so initialised as in training
    cos, sin = (t.cuda() for t in rope_tables(cfg.head_dim, cfg.seq_length, cfg.rope_theta))
    modules = {"bf16": layer}
    if not args.no_compile:
        modules["bf16-compile"] = torch.compile(layer)
    for mode in ("fp8-linear", "coat"):
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleList([copy.deepcopy(layer)])
        convert_to_fp8(holder, FP8Config(mode=mode))
        modules[mode] = holder.layers[0]
    peak = fp8_gemm_peak_tflops()
    result = {"benchmark": "bench_layer", "shape": LLAMA2_7B, "env": environment(),
              "fp8_scaled_mm_peak_tflops_8192": peak, "runs": []}
    print(f"FP8 _scaled_mm 8192^3: {peak:.0f} TFLOP/s")
    for mb in args.micro_batches:
        tokens = mb * cfg.seq_length
        rows = []
        x = torch.randn(mb, cfg.seq_length, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for mode, mod in modules.items():
            r = measure(mod, x, list(mod.parameters()), (cos, sin))
            rows.append({"mode": mode, "micro_batch": mb, **r})
            torch.cuda.empty_cache()
        check_outputs(rows)
        add_ratios(rows, tokens)
        shapes = layer_gemm_shapes(cfg, tokens)
        gemm_flops = sum(2 * m * n * k for m, n, k in shapes)
        gemm_ms = fp8_gemms_ms(shapes)
        for r in rows:
            r["gemm_tflops_achieved"] = gemm_flops / (r["ms"] * 1e-3) / 1e12
        result["runs"].append({"micro_batch": mb, "fp8_gemms_only_ms": gemm_ms,
                               "fp8_gemms_only_tflops": gemm_flops / (gemm_ms * 1e-3) / 1e12, "modes": rows})
        print(f"\nmicro-batch {mb} ({tokens} tokens); the layer's FP8 GEMMs alone: {gemm_ms:.3f} ms "
              f"({gemm_flops / (gemm_ms * 1e-3) / 1e12:.0f} TFLOP/s)")
        print(f"{'mode':>13} {'ms':>8} {'tok/s':>9} {'x eager':>8} {'x compile':>9} {'saved MiB':>10} "
              f"{'saved/bf16':>10} {'peak MiB':>9} {'GEMM TF/s':>9} {'err':>6}")
        for r in rows:
            print(f"{r['mode']:>13} {r['ms']:8.3f} {r['tokens_per_s']:9.0f} {r['speedup_vs_bf16_eager']:8.2f} "
                  f"{r.get('speedup_vs_bf16_compile', float('nan')):9.2f} {r['saved_bytes'] / 2**20:10.1f} "
                  f"{r['saved_vs_bf16_eager']:10.3f} {r['peak_mem_bytes'] / 2**20:9.0f} {r['gemm_tflops_achieved']:9.0f} {r['out_rel_err_vs_bf16']:6.3f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
