"""One Llama transformer layer, forward + backward, per activation mode (compare COAT's benchmark_olmolayer.py).

Modes: bf16 (eager, the model's code), bf16-compile (torch.compile of the same layer), fp8-linear, coat.
For each micro-batch: median time (CUDA events, triton.testing.do_bench), tokens/s, peak memory above the
inputs (torch.cuda.max_memory_allocated), bytes saved for backward (saved_tensors_hooks, unique storages,
parameters excluded), and ratios against eager and compiled BF16 measured in the same run. It also measures
the FP8 GEMM ceiling (_scaled_mm 8192^3) and the time of the layer's GEMMs alone in FP8, so the fp8-linear
figure can be read against what its GEMMs allow.

It also says where the time goes besides the GEMMs: launches per step (torch.profiler's kernel count) and
host time per step (the time to launch one step while the GPU is held busy, so launching never waits on it):
when host ms >= GPU ms the layer is launch-bound and a smaller micro-batch cannot run faster than its host
code. `--cuda-graph` adds
`MODE+graph` for bf16-compile, coat and coat-compile: the same step captured once and replayed as one CUDA graph,
timed without its host time (training's --enable-cuda-graph), with the ratio to `bf16-compile+graph` beside the
one to `bf16-compile`.

    python -m benchmarks.layer.block [--micro-batches 1 2 4] [--seq-length 2048]
        [--compile-fp8] [--cuda-graph] [--trace-dir DIR] [--out benchmarks/results/bench_layer.json]
    # the 7B-shape layer at sequence 4096, micro-batch 1
    python -m benchmarks.layer.block --micro-batches 1 --seq-length 4096 --compile-fp8 --cuda-graph

Without a GPU, `--count-launches` runs one small layer per mode on CPU with the FP8 flow routed through its
Triton kernels (interpreter) and counts, per forward and backward, the aten ops that launch a kernel on CUDA
and the Triton launches: the launch budget of each mode.

    python -m benchmarks.layer.block --count-launches
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

if "--count-launches" in sys.argv:  # before triton is imported: @triton.jit picks the interpreter then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

from benchmarks.common import fixed_recipe, saved_activation_bytes
from megacoat.coat import convert_to_coat
from megacoat.coat.linear import refresh_fp8_weights
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT, rope_tables

GRAPH = "+graph"  # a mode's step captured and replayed as one CUDA graph (--cuda-graph)
GRAPHED_BASELINE = "bf16-compile" + GRAPH
LLAMA2_7B = dict(hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, seq_length=2048)


def environment() -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "command": " ".join(sys.argv),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def host_ms(step, repeats: int = 5) -> float:
    """Median host time to launch one step while a sleep kernel keeps the GPU busy (launches never wait)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time at ~2 GHz: longer than any step's host code
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def kernels_per_step(step) -> int:
    """GPU kernels (and memsets/copies) one step launches, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def export_trace(step, path: str) -> None:
    """A chrome trace of one step (open in chrome://tracing or perfetto): where the host and GPU time go."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def graphed(step):
    """`step` captured as one CUDA graph (after warm-up on a side stream, as capture needs) and returned as its
    replay: the layer's GPU work without its host time, which is what --enable-cuda-graph gives in training."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: autograd's nodes were made on it
        step()
    return graph.replay


def measure(module, x, params, extra=(), trace: str | None = None, graph: bool = False) -> dict:
    """Time, host time, launches, peak memory and saved bytes of module(x, *extra).backward(dy); with graph, the
    times and launches are those of the step replayed as one CUDA graph (memory is the eager step's)."""
    dy = torch.randn_like(x)

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        module(x, *extra).backward(dy)

    if not graph:
        step()  # compile / autotune / build FP8 weight caches outside the measurements
    torch.cuda.synchronize()
    timed = graphed(step) if graph else step
    ms = bench_ms(timed)
    host = host_ms(timed)
    kernels = kernels_per_step(timed)
    if trace:
        export_trace(timed, trace)
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
    return {"ms": ms, "host_ms": host, "launch_bound": host >= 0.9 * ms, "kernels_per_step": kernels,
            "peak_mem_bytes": peak, "saved_bytes": saved, "saved_by_dtype": by_dtype, "_out": out}


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
        if GRAPHED_BASELINE in base:  # the strongest baseline: compiled bf16 without its host time either
            r["speedup_vs_bf16_compile_graph"] = base[GRAPHED_BASELINE]["ms"] / r["ms"]
        r["saved_vs_bf16_eager"] = r["saved_bytes"] / base["bf16"]["saved_bytes"]
        r["peak_mem_vs_bf16_eager"] = r["peak_mem_bytes"] / base["bf16"]["peak_mem_bytes"]


def fp8_gemm_peak_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def layer_gemm_shapes(cfg: ModelConfig, tokens: int, fused: bool = True) -> list[tuple[int, int, int]]:
    """(M, N, K) of every GEMM of one layer's forward and backward: fused as the coat mode runs them
    (wq|wk|wv, w1|w3), or one per nn.Linear as fp8-linear runs them."""
    h, f, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups * cfg.head_dim
    shapes = []
    linears = ((h + 2 * kv, h), (h, h), (2 * f, h), (h, f)) if fused else \
        ((h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f))  # wq wk wv wo w1 w3 w2
    for n, k in linears:
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


def bf16_gemms_ms(shapes) -> float:
    ops = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for m, n, k in shapes]

    def run():
        for a, b in ops:
            a @ b.t()
    return bench_ms(run)


def count_launches() -> dict:
    """CPU: per mode, the aten ops that launch a CUDA kernel and the Triton launches of one small layer's
    forward and backward (steady state: weight caches built), the FP8 flow on its Triton kernels."""
    from tests.coat.flow_paths import LaunchCounter, triton_paths

    cfg = ModelConfig(num_layers=1, vocab_size=128, hidden_size=128, ffn_hidden_size=256, num_attention_heads=2,
                      seq_length=32)
    base = GPT(cfg).bfloat16()
    cos, sin = base._rope(torch.device("cpu"))
    out = {}
    for mode in ("bf16", "fp8-linear", "coat"):
        model = convert_to_coat(copy.deepcopy(base), fixed_recipe(mode, group_size=64))
        layer = model.layers[0]
        x = torch.randn(1, cfg.seq_length, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        with triton_paths():
            layer(x, cos, sin).sum().backward()  # builds the weight caches
            for prm in layer.parameters():
                prm.grad = None  # as in measure(): no accumulation into existing .grad
            x.grad = None
            row = {}
            with LaunchCounter() as fwd:
                y = layer(x, cos, sin)
            with LaunchCounter() as bwd:
                y.backward(torch.ones_like(y))
            for phase, c in (("forward", fwd), ("backward", bwd)):
                row[phase] = {"aten_kernels": sum(c.aten.values()), "triton": sum(c.triton.values()),
                              "aten_ops": dict(c.aten.most_common()), "triton_kernels": dict(c.triton)}
            row["launches"] = fwd.launches + bwd.launches
        out[mode] = row
        print(f"{mode:>18}: {row['launches']:4d} launches per layer fwd+bwd "
              f"(forward {row['forward']['aten_kernels']} aten + {row['forward']['triton']} Triton, "
              f"backward {row['backward']['aten_kernels']} aten + {row['backward']['triton']} Triton)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-length", type=int, default=LLAMA2_7B["seq_length"],
                    help="tokens per sample")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-fp8", action="store_true",
                    help="also run torch.compile of the fp8-linear and coat layers (the training --compile path: "
                         "one graph per layer, fullgraph, the FP8 flow's Triton kernels inside it)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time bf16-compile, coat and (with --compile-fp8) coat-compile as one CUDA graph per "
                         "step: GPU time without host time, as training's --enable-cuda-graph runs them")
    ap.add_argument("--count-launches", action="store_true", help="CPU: launches per layer per mode, no timing")
    ap.add_argument("--trace-dir", default=None, help="write a chrome trace of one step per mode and micro-batch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.count_launches:
        counts = count_launches()
        out = args.out or "benchmarks/results/layer_launches.json"
        with open(out, "w") as f:
            json.dump({"benchmark": "bench_layer --count-launches", "command": " ".join(sys.argv),
                       "torch": torch.__version__, "triton": triton.__version__, "modes": counts}, f, indent=1)
        print(f"wrote {out}")
        return
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    shape = dict(LLAMA2_7B, seq_length=args.seq_length)
    cfg = ModelConfig(num_layers=1, vocab_size=128, **shape)
    layer = GPT(cfg).layers[0].cuda().bfloat16()  # built by the model, so initialised as in training
    cos, sin = (t.cuda() for t in rope_tables(cfg.head_dim, cfg.seq_length, cfg.rope_theta))
    modules = {"bf16": layer}
    if not args.no_compile:
        modules["bf16-compile"] = torch.compile(layer)
    for mode in ("fp8-linear", "coat"):
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleList([copy.deepcopy(layer)])
        convert_to_coat(holder, fixed_recipe(mode))
        modules[mode] = holder.layers[0]
    if args.compile_fp8:  # fullgraph: the FP8 flow is inside the graph; it reads the refreshed FP8 weight copies
        for mode in ("fp8-linear", "coat"):
            refresh_fp8_weights(modules[mode])
            modules[f"{mode}-compile"] = torch.compile(modules[mode], fullgraph=True)
    if args.cuda_graph:  # own copies: a capture must be the first backward of its parameters (and of its input)
        for mode in [m for m in ("bf16-compile", "coat", "coat-compile") if m in modules]:
            module = copy.deepcopy(modules[mode.removesuffix("-compile")])
            if mode.startswith("coat"):
                refresh_fp8_weights(module)
            modules[mode + GRAPH] = torch.compile(module, fullgraph=mode.startswith("coat")) \
                if mode.endswith("-compile") else module
    peak = fp8_gemm_peak_tflops()
    result = {"benchmark": "bench_layer", "shape": shape, "env": environment(),
              "fp8_scaled_mm_peak_tflops_8192": peak, "runs": []}
    print(f"FP8 _scaled_mm 8192^3: {peak:.0f} TFLOP/s")
    for mb in args.micro_batches:
        tokens = mb * cfg.seq_length
        rows = []
        x = torch.randn(mb, cfg.seq_length, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for mode, mod in modules.items():
            graph = mode.endswith(GRAPH)
            trace = args.trace_dir and os.path.join(args.trace_dir, f"layer_{mode}_mb{mb}.json")
            r = measure(mod, x.detach().clone().requires_grad_() if graph else x, list(mod.parameters()),
                        (cos, sin), trace, graph=graph)
            rows.append({"mode": mode, "micro_batch": mb, **r})
            torch.cuda.empty_cache()
        check_outputs(rows)
        add_ratios(rows, tokens)
        gemms = {}  # the layer's FP8 GEMMs alone, as coat (fused) and fp8-linear (one per linear) run them
        for kind, fused in (("fused", True), ("per_linear", False)):
            shapes = layer_gemm_shapes(cfg, tokens, fused)
            gemms[kind] = {"ms": fp8_gemms_ms(shapes), "flops": sum(2 * m * n * k for m, n, k in shapes)}
            gemms[kind]["tflops"] = gemms[kind]["flops"] / (gemms[kind]["ms"] * 1e-3) / 1e12
        bf16_gemm_ms = bf16_gemms_ms(layer_gemm_shapes(cfg, tokens, fused=False))
        flops = gemms["fused"]["flops"]  # the same either way
        for r in rows:
            r["gemm_tflops_achieved"] = flops / (r["ms"] * 1e-3) / 1e12
            r["gemm_tflops_vs_scaled_mm_peak"] = r["gemm_tflops_achieved"] / peak
            fp8 = r["mode"].startswith(("fp8", "coat"))
            own = gemms["fused" if r["mode"].startswith("coat") else "per_linear"]["ms"] if fp8 else bf16_gemm_ms
            r["own_gemms_ms"], r["non_gemm_ms"] = own, r["ms"] - own
        bf16_non_gemm = rows[0]["non_gemm_ms"]  # eager bf16: the same model code around the linears
        for r in rows:
            if r["mode"].startswith("fp8-linear"):
                # what the FP8 GEMM ceiling allows with the model's own non-linear code: its FP8 GEMMs plus
                # eager bf16's non-GEMM time; 1.0 = nothing but the GEMMs got faster, <1 = FP8 overhead
                r["fp8_overhead_ms"] = r["non_gemm_ms"] - bf16_non_gemm
                r["ceiling_ms"] = r["own_gemms_ms"] + bf16_non_gemm
                r["fraction_of_ceiling"] = r["ceiling_ms"] / r["ms"]
        result["runs"].append({"micro_batch": mb, "fp8_gemms_only_ms": gemms["fused"]["ms"],
                               "fp8_gemms_only_tflops": gemms["fused"]["tflops"],
                               "fp8_gemms_per_linear_ms": gemms["per_linear"]["ms"],
                               "fp8_gemms_per_linear_tflops": gemms["per_linear"]["tflops"],
                               "bf16_gemms_per_linear_ms": bf16_gemm_ms, "modes": rows})
        print(f"\nmicro-batch {mb} ({tokens} tokens); the layer's FP8 GEMMs alone: fused {gemms['fused']['ms']:.3f} ms "
              f"({gemms['fused']['tflops']:.0f} TFLOP/s), one per linear {gemms['per_linear']['ms']:.3f} ms "
              f"({gemms['per_linear']['tflops']:.0f} TFLOP/s); BF16 GEMMs alone {bf16_gemm_ms:.3f} ms")
        print(f"{'mode':>19} {'ms':>8} {'host ms':>8} {'kernels':>7} {'tok/s':>9} {'x eager':>8} {'x compile':>9} "
              f"{'x c+graph':>9} "
              f"{'saved MiB':>10} {'saved/bf16':>10} {'peak MiB':>9} {'GEMM TF/s':>9} {'non-GEMM':>8} {'ceiling':>7} {'err':>6}")
        for r in rows:
            print(f"{r['mode']:>19} {r['ms']:8.3f} {r['host_ms']:8.3f} {r['kernels_per_step']:7d} "
                  f"{r['tokens_per_s']:9.0f} {r['speedup_vs_bf16_eager']:8.2f} "
                  f"{r.get('speedup_vs_bf16_compile', float('nan')):9.2f} "
                  f"{r.get('speedup_vs_bf16_compile_graph', float('nan')):9.2f} {r['saved_bytes'] / 2**20:10.1f} "
                  f"{r['saved_vs_bf16_eager']:10.3f} {r['peak_mem_bytes'] / 2**20:9.0f} {r['gemm_tflops_achieved']:9.0f} "
                  f"{r['non_gemm_ms']:8.3f} {r.get('fraction_of_ceiling', float('nan')):7.2f} "
                  f"{r['out_rel_err_vs_bf16']:6.3f}")
    out = args.out or "benchmarks/results/layer.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
