"""The MLP residual block alone, x + w2(silu(w1 n) * w3 n) with n = RMSNorm(x), forward + backward, per mode.

Llama-2-7B's MLP (4096 -> 11008 -> 4096), sequence 2048, micro-batch 1/2/4/8. Modes: bf16 (eager, the
model's modules), bf16-compile (torch.compile of the same block), fp8-linear, coat. Same measurements as
bench_layer.py. Reference points from the issue (same block, same H100): NVlabs/COAT 0.61/1.47/1.56/1.59x of
eager BF16, saving 0.553x; torchao float8 tensorwise + torch.compile 1.13/1.44/1.59/1.62x, saving 0.41x.

    python -m benchmarks.layer.mlp [--micro-batches 1 2 4 8] [--baseline-rev REV] [--kernels-only]

--baseline-rev REV loads megacoat/ops/{rmsnorm,swiglu,rope}.py as they were at git revision REV beside the
current ones and measures both in the same run: a `coat@REV` block mode (a private copy of precision_flow
pointed at the old kernels) and, per fused kernel, a row of version REV with the current row's speed-up over it.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import tempfile
from types import SimpleNamespace

import torch
from torch import nn

from benchmarks.layer.block import (LLAMA2_7B, add_ratios, bench_ms, check_outputs, environment, kernels_per_step,
                                    measure)
from megacoat.ops import rmsnorm as rmsnorm_ops, rope as rope_ops, swiglu as swiglu_ops
from megacoat.ops.cast_transpose import amax_scale, cast_transpose
from megacoat.ops.rope_grad_cast import rope_qkv_grad_fp8
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
    def __init__(self, coat_block, flow=None):
        super().__init__()
        self.b = coat_block
        self.flow = flow  # a precision_flow module; None: megacoat's own

    def forward(self, x):
        from megacoat.fp8 import precision_flow
        b, ff = self.b, self.b.feed_forward
        return x + (self.flow or precision_flow).coat_mlp(
            x, b.ffn_norm.weight, ff.w1.weight, ff.w3.weight, ff.w2.weight, b.w13_cache, b.w2_cache,
            b.ffn_norm.eps, b.group_size, b.grad_dtype)


def flow_with_ops(ops: SimpleNamespace):
    """A private copy of megacoat.fp8.precision_flow whose fused-kernel names point at `ops` (see ops_at): the
    COAT block with an older version of the kernels, measured in the same run as the current one."""
    import megacoat.fp8.precision_flow as pf
    spec = importlib.util.spec_from_file_location("precision_flow_baseline", pf.__file__)
    flow = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flow)
    for name in ("rmsnorm_fp8_out", "rmsnorm_fp8_bwd"):
        setattr(flow, name, getattr(ops.rmsnorm, name))
    for name in ("swiglu_fp8_out", "swiglu_fp8_bwd"):
        if hasattr(flow, name):
            setattr(flow, name, getattr(ops.swiglu, name))
    flow.rmsnorm_fp8_fwd, flow.swiglu_fp8_fwd = fwd_writing_output(ops)
    if hasattr(flow, "swiglu_fp8_bwd_out_t"):
        flow.swiglu_fp8_bwd_out_t = bwd_out_t(ops.swiglu)
    return flow


def fwd_writing_output(ops: SimpleNamespace):
    """(rmsnorm_fp8_fwd, swiglu_fp8_fwd) of a kernel version as the flow calls them now, returning the FP8 output
    too; for a version whose forward returned only the saved values and the scale, that call then its
    out(row-major)."""
    R, S = ops.rmsnorm, ops.swiglu

    def norm(x, w, eps, g, *rest):
        res = R.rmsnorm_fp8_fwd(x, w, eps, g, *rest)
        return res if len(res) == 5 else (*res, R.rmsnorm_fp8_out(*res[:3], w, res[3], g, False, *rest))

    def swiglu(a13, g, *rest):
        res = S.swiglu_fp8_fwd(a13, g, *rest)
        return res if len(res) == 6 else (*res, S.swiglu_fp8_out(*res, g, False, *rest))
    return norm, swiglu


def bwd_out_t(swiglu):
    """swiglu_fp8_bwd_out_t of a kernel module, or for a version without it the two calls it replaces."""
    if hasattr(swiglu, "swiglu_fp8_bwd_out_t"):
        return swiglu.swiglu_fp8_bwd_out_t

    def two_calls(ds, a1_8, s1, a3_8, s3, s_scale, group_size, grad_dtype=torch.float8_e5m2,
                  out_dtype=torch.float8_e4m3fn):
        st = swiglu.swiglu_fp8_out(a1_8, s1, a3_8, s3, s_scale, group_size, True, out_dtype)
        return (*swiglu.swiglu_fp8_bwd(ds, a1_8, s1, a3_8, s3, group_size, grad_dtype), st)
    return two_calls


def ops_at(rev: str) -> SimpleNamespace:
    """The fused-kernel modules (rmsnorm, swiglu, rope) as they were at git revision `rev`, loaded beside the
    current ones, so that one run times old and new kernels on the same GPU. Read from .baseline/REV/ when
    there (where the repository travels without .git: `git archive REV megacoat/ops | tar -x -C .baseline/REV`),
    else from git."""
    tmp = tempfile.mkdtemp(prefix="megacoat_ops_")
    mods = {}
    for name in ("rmsnorm", "swiglu", "rope"):
        path = os.path.join(".baseline", rev, "megacoat", "ops", f"{name}.py")  # a checkout without .git (device)
        if not os.path.exists(path):
            src = subprocess.run(["git", "show", f"{rev}:megacoat/ops/{name}.py"], capture_output=True, text=True,
                                 check=True).stdout
            path = os.path.join(tmp, f"{name}.py")  # @triton.jit reads its source from a file
            with open(path, "w") as f:
                f.write(src)
        spec = importlib.util.spec_from_file_location(f"megacoat_ops_{rev}_{name}", path)
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    return SimpleNamespace(**mods)


CURRENT_OPS = SimpleNamespace(rmsnorm=rmsnorm_ops, swiglu=swiglu_ops, rope=rope_ops)


def kernel_entries(tokens: int, h: int, f: int, g: int = 128, ops: SimpleNamespace = CURRENT_OPS,
                   version: str = "current", device: str = "cuda") -> list[dict]:
    """Each fused kernel alone at the block's shapes: time, launches (kernels and memsets, from the profiler)
    and bandwidth over the bytes it must move (`min_bytes`: inputs read once + outputs written once; a kernel
    that needs two passes, like swiglu_fp8_bwd's amax then cast, reads more than that)."""
    bf = dict(device=device, dtype=torch.bfloat16)
    R, S = ops.rmsnorm, ops.swiglu
    x, w, a13 = torch.randn(tokens, h, **bf), 1 + 0.1 * torch.randn(h, **bf), torch.randn(tokens, 2 * f, **bf)
    ds, dy = torch.randn(tokens, f, **bf), torch.randn(tokens, h, **bf)
    x8, xs, rstd, ys, *y8 = R.rmsnorm_fp8_fwd(x, w, 1e-5, g)
    a1, s1, a3, s3, ss, *s8 = S.swiglu_fp8_fwd(a13, g)
    fwd_out = 1 if y8 else 0  # this version's forward also writes the FP8 output (the second launch)
    e5 = torch.float8_e5m2
    sc = amax_scale(dy, e5)
    q = torch.randn(tokens, 3 * h, **bf)[:, :h].view(1, tokens, h // 128, 128)  # a slice of [q|k|v], as in the block
    cos, sin = (t.to(device) for t in rope_tables(128, tokens, 10000.0))
    m, gb = tokens, 1e9
    cases = [  # name (kept stable across runs: results are compared by it), fn, bytes it must move
        ("rmsnorm_fp8_fwd", lambda: R.rmsnorm_fp8_fwd(x, w, 1e-5, g), m * h * (2 + 1 + fwd_out)),
        ("rmsnorm_fp8_out", lambda: R.rmsnorm_fp8_out(x8, xs, rstd, w, ys, g, False), m * h * 2),
        ("rmsnorm_fp8_out_T", lambda: R.rmsnorm_fp8_out(x8, xs, rstd, w, ys, g, True), m * h * 2),
        ("rmsnorm_fp8_bwd", lambda: R.rmsnorm_fp8_bwd(dy, x8, xs, rstd, w, g), m * h * (2 + 1 + 2)),
        ("swiglu_fp8_fwd", lambda: S.swiglu_fp8_fwd(a13, g), m * f * (4 + 2 + fwd_out)),
        ("swiglu_fp8_out", lambda: S.swiglu_fp8_out(a1, s1, a3, s3, ss, g, False), m * f * 3),
        ("swiglu_fp8_out_T", lambda: S.swiglu_fp8_out(a1, s1, a3, s3, ss, g, True), m * f * 3),
        # the name is the first version's (three launches); "launches" says what this version does
        ("swiglu_fp8_bwd (3 launches)", lambda: S.swiglu_fp8_bwd(ds, a1, s1, a3, s3, g, e5), m * f * (2 + 2 + 4)),
        # what the COAT MLP's backward calls: the above plus s^T (swiglu_fp8_out_T) in one read of the pair
        ("swiglu_fp8_bwd_out_t", lambda: bwd_out_t(S)(ds, a1, s1, a3, s3, ss, g, e5), m * f * (2 + 2 + 4 + 1)),
        ("amax+cast_transpose e5m2", lambda: cast_transpose(dy, amax_scale(dy, e5), e5), m * h * (2 + 2)),
        ("cast_transpose e5m2", lambda: cast_transpose(dy, sc, e5), m * h * (2 + 2)),
        ("rope (q, 32 heads x 128)", lambda: ops.rope.rope_triton(q, cos, sin), m * h * (2 + 2)),
    ]
    if version == "current":  # fused into one op after the versions compared with --against
        dq = torch.randn(1, h // 128, tokens, 128, **bf).transpose(1, 2)  # as attention's backward leaves it
        # bytes: read dq|dk|dv, write and read the joined bf16 gradient, write g8 and g8^T
        cases.append(("rope_qkv_grad_fp8 (q|k|v, 3 x 32 heads x 128)",
                      lambda: rope_qkv_grad_fp8(dq, dq, dq, cos, sin, e5), 3 * m * h * (2 + 2 + 2 + 1 + 1)))
    rows = []
    for name, fn, nbytes in cases:
        ms = bench_ms(fn)
        rows.append({"kernel": name, "version": version, "tokens": tokens, "ms": ms, "launches": kernels_per_step(fn),
                     "min_bytes": nbytes, "GB_per_s": nbytes / (ms * 1e-3) / gb})
    return rows


def print_kernels(rows: list[dict]) -> None:
    base = {r["kernel"]: r["ms"] for r in rows if r["version"] != "current"}
    print(f"\nfused kernels at {rows[0]['tokens']} tokens (GB/s over the minimum bytes; copy ceiling ~3000 H100, "
          f"~4100 H200)")
    for k in rows:
        old = f" {base[k['kernel']] / k['ms']:5.2f}x vs {k.get('baseline', '')}" if k.get("baseline") else ""
        print(f"{k['kernel']:>28} {k['version']:>10} {k['ms'] * 1e3:8.1f} us {k['GB_per_s']:8.0f} GB/s "
              f"{k['launches']:3d} launches{old}")


def kernel_section(tokens: int, h: int, f: int, baseline: str | None) -> list[dict]:
    rows = kernel_entries(tokens, h, f)
    if baseline:
        old = kernel_entries(tokens, h, f, ops=ops_at(baseline), version=baseline)
        old_ms = {r["kernel"]: r["ms"] for r in old}
        for r in rows:
            r["baseline"], r["speedup_vs_baseline"] = baseline, old_ms[r["kernel"]] / r["ms"]
        rows += old
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--kernels-only", action="store_true", help="only the fused kernels alone (no block runs)")
    ap.add_argument("--baseline-rev", default=None, help="git revision whose rmsnorm/swiglu/rope kernels are "
                    "measured in the same run: a coat@REV block mode and a baseline row per kernel")
    ap.add_argument("--out", default=None, help="default benchmarks/results/bench_mlp_block[_kernels].json")
    args = ap.parse_args()
    out = args.out or f"benchmarks/results/bench_mlp_block{'_kernels' if args.kernels_only else ''}.json"
    micro_batches = [] if args.kernels_only else args.micro_batches
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, vocab_size=128, **LLAMA2_7B)
    block = GPT(cfg).layers[0].cuda().bfloat16()
    old_ops = ops_at(args.baseline_rev) if args.baseline_rev else None
    modules = {"bf16": MLPBlock(block)}
    if not args.no_compile:
        modules["bf16-compile"] = torch.compile(MLPBlock(block))
    for mode in ("fp8-linear", "coat"):
        holder = nn.Module()
        holder.layers = nn.ModuleList([copy.deepcopy(block)])
        convert_to_fp8(holder, FP8Config(mode=mode))
        modules[mode] = MLPBlock(holder.layers[0]) if mode == "fp8-linear" else CoatMLPBlock(holder.layers[0])
    if old_ops:
        modules[f"coat@{args.baseline_rev}"] = CoatMLPBlock(modules["coat"].b, flow_with_ops(old_ops))
    result = {"benchmark": "bench_mlp_block", "shape": LLAMA2_7B, "env": environment(), "runs": []}
    for mb in micro_batches:
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
    result["kernels"] = kernel_section(2 * cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size, args.baseline_rev)
    print_kernels(result["kernels"])
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
