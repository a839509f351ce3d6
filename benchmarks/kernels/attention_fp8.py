"""What FP8 attention would give the step: one layer's causal attention at the 1.3 B shape, forward and backward,
torch's SDPA in BF16 (cuDNN's kernels, as the model runs it) against cuDNN's FP8 SDPA graphs through its Python
frontend (`nvidia-cudnn-frontend`; Q, K, V, O, dO in E4M3, dQ/dK/dV in E4M3, per-tensor scales of 1). Speed only:
the inputs are random and the FP8 graphs' outputs are not used, so this says nothing of fidelity. Each call is
timed with CUDA events (triton.testing.do_bench, median), repeated and interleaved.

    python -m benchmarks.kernels.attention_fp8 [--batch 32] [--repeats 3] [--out benchmarks/results/bench_attention_fp8.json]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F
from benchmarks.common import write_json  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _bhsd(b, s, h, d, dtype):
    """[b, h, s, d] views of [b, s, h, d] memory, as the model hands q, k, v to attention."""
    return (torch.randn(b, s, h, d, device="cuda") * 0.5).to(dtype).transpose(1, 2)


def _fp8_graphs(b, s, h, d):
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    f8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    q, k, v, o, do, dq, dk, dv = (_bhsd(b, s, h, d, E4M3) for _ in range(8))
    stats = torch.empty(b, h, s, 1, device="cuda", dtype=torch.float32)
    one = torch.ones(1, 1, 1, 1, device="cuda")
    amax = [torch.empty(1, 1, 1, 1, device="cuda") for _ in range(6)]

    def graph():
        return cudnn.pygraph(io_data_type=f8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensors(g, names, like):
        return {n: g.tensor(name=n, dim=list(like.shape), stride=list(like.stride()), data_type=f8) for n in names}

    def scalars(g, names):
        return {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for n in names}

    def build(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)

    fg = graph()
    t = tensors(fg, ("q", "k", "v"), q)
    sc = scalars(fg, ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"))
    common = dict(q=t["q"], k=t["k"], v=t["v"], **sc, attn_scale=1 / math.sqrt(d), use_causal_mask=True, name="fwd")
    try:  # the frontend's releases name the training switch differently
        o_t, stats_t, amax_s_t, amax_o_t = fg.sdpa_fp8(**common, generate_stats=True)
    except TypeError:
        o_t, stats_t, amax_s_t, amax_o_t = fg.sdpa_fp8(**common, is_inference=False)
    o_t.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(f8)
    stats_t.set_output(True).set_data_type(f32).set_dim(list(stats.shape)).set_stride(list(stats.stride()))
    for a in (amax_s_t, amax_o_t):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    fws = build(fg)
    fpack = {t["q"]: q, t["k"]: k, t["v"]: v, o_t: o, stats_t: stats, amax_s_t: amax[0], amax_o_t: amax[1],
             **{x: one for x in sc.values()}}

    bg = graph()
    t = tensors(bg, ("q", "k", "v", "o", "dO"), q)
    st = bg.tensor(name="stats", dim=list(stats.shape), stride=list(stats.stride()), data_type=f32)
    sc = scalars(bg, ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                      "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"))
    outs = bg.sdpa_fp8_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=st, **sc,
                                attn_scale=1 / math.sqrt(d), use_causal_mask=True, name="bwd")
    dq_t, dk_t, dv_t, *amaxes = outs
    for x, like in ((dq_t, dq), (dk_t, dk), (dv_t, dv)):
        x.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride())).set_data_type(f8)
    for a in amaxes:
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    bws = build(bg)
    bpack = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: o, t["dO"]: do, st: stats, dq_t: dq, dk_t: dk, dv_t: dv,
             **dict(zip(amaxes, amax[2:])), **{x: one for x in sc.values()}}
    return (lambda: fg.execute(fpack, fws, handle=handle)), (lambda: bg.execute(bpack, bws, handle=handle))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="sequences a micro-batch (seq 2048, 16 heads of 128)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/bench_attention_fp8.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    b, s, h, d = args.batch, 2048, 16, 128
    q, k, v = (_bhsd(b, s, h, d, torch.bfloat16).requires_grad_() for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    runs = {"bf16 forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "bf16 forward+backward": lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)}
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "shape": [b, s, h, d],
              "causal": True, "timing": "do_bench median (ms), repeats interleaved"}
    try:
        import cudnn

        result["cudnn_frontend"] = cudnn.__version__
        fwd, bwd = _fp8_graphs(b, s, h, d)
        fwd(), bwd()
        torch.cuda.synchronize()  # both ran once: what is timed below executes
        runs["fp8 forward"], runs["fp8 backward"] = fwd, bwd
    except Exception as e:  # the probe's point is to learn whether the graphs build here: keep the BF16 figures
        result["fp8_error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
        print("fp8 graphs:", result["fp8_error"], flush=True)
    times = {n: [] for n in runs}
    for _ in range(args.repeats):
        for n, fn in runs.items():
            times[n].append(do_bench(fn, warmup=10, rep=200, return_mode="median"))
            print(f"{n:22s} {times[n][-1]:.3f} ms", flush=True)
    flops_fwd = 2 * 2 * b * h * s * s * d / 2  # two GEMMs, causal half
    result["ms"] = {n: statistics.median(t) for n, t in times.items()}
    result["ms_repeats"] = times
    if "fp8 forward" in runs:
        bf16_bwd = result["ms"]["bf16 forward+backward"] - result["ms"]["bf16 forward"]
        result["bf16_backward_ms"] = bf16_bwd
        result["speedup"] = {"forward": result["ms"]["bf16 forward"] / result["ms"]["fp8 forward"],
                             "backward": bf16_bwd / result["ms"]["fp8 backward"]}
    passes = {"forward": 1, "backward": 2.5, "forward+backward": 3.5}  # in forwards' FLOPs
    result["tflops"] = {n: flops_fwd * passes[n.split(" ", 1)[1]] / (ms * 1e9) for n, ms in result["ms"].items()}
    print(result.get("speedup"), flush=True)
    write_json(args.out, result)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
