"""The MLP residual block alone, x + w2(silu(w1 n) * w3 n) with n = RMSNorm(x), forward + backward, per mode.

Llama-2-7B's MLP (4096 -> 11008 -> 4096), sequence 2048, micro-batch 1/2/4/8. Modes: bf16 (eager, the
model's modules), bf16-compile (torch.compile of the same block), fp8-linear, coat. Same measurements as
bench_layer.py. Reference points from the issue (same block, same H100): NVlabs/COAT 0.61/1.47/1.56/1.59x of
eager BF16, saving 0.553x; torchao float8 tensorwise + torch.compile 1.13/1.44/1.59/1.62x, saving 0.41x.

    PYTHONPATH=. python benchmarks/bench_mlp_block.py [--micro-batches 1 2 4 8]
"""
from __future__ import annotations

import argparse
import copy
import json

import torch
from torch import nn

from benchmarks.bench_layer import LLAMA2_7B, add_ratios, bench_ms, check_outputs, environment, measure
from megacoat.ops.cast_transpose import amax_scale, cast_transpose
from megacoat.ops.rmsnorm import rmsnorm_fp8_bwd, rmsnorm_fp8_fwd, rmsnorm_fp8_out
from megacoat.ops.rope import rope_triton
from megacoat.ops.swiglu import swiglu_fp8_bwd, swiglu_fp8_fwd, swiglu_fp8_out
from megacoat.fp8.config import FP8Config
from megacoat.fp8.convert import convert_to_fp8
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT, rope_tables


class MLPBlock(nn.Module):
    """The second half of a TransformerBlock, with the block's own submodules."""

    def __init__(self, block):
        super().__init__()
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


class CoatMLPBlock(nn.Module):
    def __init__(self, coat_block):
        super().__init__()
        self.b = coat_block

    def forward(self, x):
        from megacoat.fp8.precision_flow import coat_mlp
        b, ff = self.b, self.b.feed_forward
        return x + coat_mlp(x, b.ffn_norm.weight, ff.w1.weight, ff.w3.weight, ff.w2.weight, b.w13_cache,
                            b.w2_cache, b.ffn_norm.eps, b.group_size, b.grad_dtype)


def kernel_entries(tokens: int, h: int, f: int, g: int = 128) -> list[dict]:
    """Each fused kernel alone at the block's shapes: time and bandwidth over the bytes it must move."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w, a13 = torch.randn(tokens, h, **bf), 1 + 0.1 * torch.randn(h, **bf), torch.randn(tokens, 2 * f, **bf)
    ds, dy = torch.randn(tokens, f, **bf), torch.randn(tokens, h, **bf)
    x8, xs, rstd, ys = rmsnorm_fp8_fwd(x, w, 1e-5, g)
    a1, s1, a3, s3, ss = swiglu_fp8_fwd(a13, g)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    sc = amax_scale(dy, e5)
    q = torch.randn(tokens, 3 * h, **bf)[:, :h].view(1, tokens, h // 128, 128)  # a slice of [q|k|v], as in the block
    cos, sin = (t.cuda() for t in rope_tables(128, tokens, 10000.0))
    m, gb = tokens, 1e9
    cases = [  # name, fn, bytes moved (inputs read once + outputs written once)
        ("rmsnorm_fp8_fwd", lambda: rmsnorm_fp8_fwd(x, w, 1e-5, g), m * h * (2 + 1)),
        ("rmsnorm_fp8_out", lambda: rmsnorm_fp8_out(x8, xs, rstd, w, ys, g, False), m * h * 2),
        ("rmsnorm_fp8_out_T", lambda: rmsnorm_fp8_out(x8, xs, rstd, w, ys, g, True), m * h * 2),
        ("rmsnorm_fp8_bwd", lambda: rmsnorm_fp8_bwd(dy, x8, xs, rstd, w, g), m * h * (2 + 1 + 2)),
        ("swiglu_fp8_fwd", lambda: swiglu_fp8_fwd(a13, g), m * f * (4 + 2)),
        ("swiglu_fp8_out", lambda: swiglu_fp8_out(a1, s1, a3, s3, ss, g, False), m * f * 3),
        ("swiglu_fp8_out_T", lambda: swiglu_fp8_out(a1, s1, a3, s3, ss, g, True), m * f * 3),
        ("swiglu_fp8_bwd (3 launches)", lambda: swiglu_fp8_bwd(ds, a1, s1, a3, s3, g, e5), m * f * (2 + 2 + 4)),
        ("amax+cast_transpose e5m2", lambda: cast_transpose(dy, amax_scale(dy, e5), e5), m * h * (2 + 2)),
        ("cast_transpose e5m2", lambda: cast_transpose(dy, sc, e5), m * h * (2 + 2)),
        ("rope (q, 32 heads x 128)", lambda: rope_triton(q, cos, sin), m * h * (2 + 2)),
    ]
    rows = []
    for name, fn, nbytes in cases:
        ms = bench_ms(fn)
        rows.append({"kernel": name, "tokens": tokens, "ms": ms, "min_bytes": nbytes, "GB_per_s": nbytes / (ms * 1e-3) / gb})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/bench_mlp_block.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, vocab_size=128, **LLAMA2_7B)
    block = GPT(cfg).layers[0].cuda().bfloat16()
    modules = {"bf16": MLPBlock(block)}
    if not args.no_compile:
        modules["bf16-compile"] = torch.compile(MLPBlock(block))
    for mode in ("fp8-linear", "coat"):
        holder = nn.Module()
        holder.layers = nn.ModuleList([copy.deepcopy(block)])
        convert_to_fp8(holder, FP8Config(mode=mode))
        modules[mode] = MLPBlock(holder.layers[0]) if mode == "fp8-linear" else CoatMLPBlock(holder.layers[0])
    result = {"benchmark": "bench_mlp_block", "shape": LLAMA2_7B, "env": environment(), "runs": []}
    for mb in args.micro_batches:
        tokens = mb * cfg.seq_length
        rows = []
        x = torch.randn(mb, cfg.seq_length, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for mode, mod in modules.items():
            r = measure(mod, x, list(mod.parameters()))
            rows.append({"mode": mode, "micro_batch": mb, **r})
            torch.cuda.empty_cache()
        check_outputs(rows)
        add_ratios(rows, tokens)
        result["runs"].append({"micro_batch": mb, "modes": rows})
        print(f"\nMLP block, micro-batch {mb} ({tokens} tokens)")
        print(f"{'mode':>13} {'ms':>8} {'x eager':>8} {'x compile':>9} {'saved MiB':>10} {'saved/bf16':>10} "
              f"{'saved/compile':>13} {'peak MiB':>9} {'err':>6}")
        for r in rows:
            print(f"{r['mode']:>13} {r['ms']:8.3f} {r['speedup_vs_bf16_eager']:8.2f} "
                  f"{r.get('speedup_vs_bf16_compile', float('nan')):9.2f} {r['saved_bytes'] / 2**20:10.1f} "
                  f"{r['saved_vs_bf16_eager']:10.3f} {r.get('saved_vs_bf16_compile', float('nan')):13.3f} "
                  f"{r['peak_mem_bytes'] / 2**20:9.0f} {r['out_rel_err_vs_bf16']:6.3f}")
    result["kernels"] = kernel_entries(2 * cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size)
    print("\nfused kernels at micro-batch 2 (GB/s over the minimum bytes; D2D copy ceiling ~3000)")
    for k in result["kernels"]:
        print(f"{k['kernel']:>28} {k['ms'] * 1e3:8.1f} us {k['GB_per_s']:8.0f} GB/s")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
