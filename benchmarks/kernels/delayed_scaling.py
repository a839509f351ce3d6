"""Delayed scaling per call, at the shapes the e2e model and the 7B layer run: each cast site that
--fp8-grad-scaling / --fp8-activation-scaling delayed changes, current scaling against delayed scaling.

  swiglu_bwd   SwiGLU's backward: an amax pass, then the cast pass (current), against the cast pass alone with the
               amax of earlier calls (delayed). Both write da1|da3 in E5M2, row-major and transposed, and s^T.
  swiglu_fwd   SwiGLU's forward: the pair and the amax, then s from a second read of the pair (current), against
               one launch writing the pair and s (delayed).
  rmsnorm_fwd  RMSNorm's forward: x8 and the amax, then y from a second read of x8 (current), against one launch
               writing x8 and y (delayed).
  rope_qkv_bwd The [q|k|v] output gradient: RoPE's backward writing the BF16 joined gradient with its amax, then
               the cast into both layouts (current), against RoPE's backward writing the FP8 codes, then a byte
               transpose (delayed).
A delayed call also runs one memset and a one-program launch that rolls its amax into the history
(megacoat.ops.tensor_scale.roll_history). With a history whose maximum is the call's own amax (a bootstrap call
records it), both write the same bytes: checked here on the device before timing. Each call is timed as the
trainer runs it, inside a CUDA graph (triton.testing.do_bench_cudagraph: many calls captured in one graph, the
median of its replays per call), so the small kernels' Python launch cost is not measured (`--eager`: timed
launched from Python, triton.testing.do_bench); repeated and interleaved. Back-to-back calls in a graph may find part of
the previous call's input in L2 (50 MB on the H100), as the trainer's next kernel often does; bytes counted as each
read and write.

`--sweep BM:WARPS ...` repeats the backward rows with other tile heights and warp counts of its cast pass,
`--sweep-fwd BM:WARPS ...` the SwiGLU forward rows with other tiles of its kernel, and `--sweep-norm PER_WARP ...`
the RMSNorm forward rows with other row elements per warp (its warps per row); the library's setting is each op's
first row. "same_bytes" in each row: delayed scaling wrote current scaling's bytes (the history holding the call's
own amax), and a swept tile wrote the library tile's bytes; RMSNorm's warps per row reorder the row's sum, so there
the library comparison is only recorded ("same_bytes_as_library").

    python -m benchmarks.kernels.delayed_scaling [--repeats 3] [--sweep 64:4 32:4 128:8 128:16]
        [--sweep-fwd 64:4 64:8 128:8] [--sweep-norm 512 2048] [--eager]
        [--out benchmarks/results/bench_delayed_scaling.json]
    python -m benchmarks.kernels.delayed_scaling --cpu-smoke   # no GPU: tiny shapes under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import statistics
import sys

# first: under --cpu-smoke it sets TRITON_INTERPRET before any kernel is defined
from benchmarks.common import SweepLog, best_rows, parse_tile, same_bytes, start, time_call_ms

import torch

from megacoat.model.gpt import rope_tables
from megacoat.ops import cast_transpose, rmsnorm, rope_grad_cast, swiglu

E5M2 = torch.float8_e5m2
GROUP = 128
# (name, tokens, hidden, ffn): the 1.3 B model of bench_e2e.py at micro-batch 4 and 8 (seq 2048), one 7B layer
# (seq 4096)
SHAPES = [("1.3B mb4", 4 * 2048, 2048, 5632), ("1.3B mb8", 8 * 2048, 2048, 5632), ("7B mb1", 4096, 4096, 11008)]
SMOKE = [("smoke", 64, 256, 256)]


def _swiglu_bwd(m, h, f, device):
    """→ (current, delayed(history, bootstrap), bytes moved {current, delayed})."""
    a13 = (torch.randn(m, 2 * f, device=device) * 2).to(torch.bfloat16)
    pair = swiglu.swiglu_fp8_fwd_triton(a13, GROUP)[:5]
    del a13
    ds = (torch.randn(m, f, device=device) * 1e-3).to(torch.bfloat16)
    n = m * f  # ds 2 B and the pair 2 B read (twice by current scaling), da twice 2 B and s^T 1 B written
    return (lambda: swiglu.swiglu_fp8_bwd_out_t_triton(ds, *pair, GROUP, E5M2),
            lambda hist, boot=False: swiglu.swiglu_fp8_bwd_delayed_triton(ds, *pair, hist, GROUP, E5M2, bootstrap=boot),
            {"current": 2 * (4 * n) + 4 * n + n, "delayed": 4 * n + 4 * n + n})


def _swiglu_fwd(m, h, f, device):
    a13 = (torch.randn(m, 2 * f, device=device) * 2).to(torch.bfloat16)
    n = m * f  # a13 4 B read, the pair 2 B written (and read again by current scaling), s 1 B written
    return (lambda: swiglu.swiglu_fp8_fwd_triton(a13, GROUP),
            lambda hist, boot=False: swiglu.swiglu_fp8_fwd_delayed_triton(a13, hist, GROUP, bootstrap=boot),
            {"current": 4 * n + 2 * n + 2 * n + n, "delayed": 4 * n + 2 * n + n})


def _rmsnorm_fwd(m, h, f, device):
    x = (torch.randn(m, h, device=device) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(h, device=device)).to(torch.bfloat16)
    n = m * h  # x 2 B read, x8 1 B written (and read again by current scaling), y 1 B written
    return (lambda: rmsnorm.rmsnorm_fp8_fwd_triton(x, w, 1e-5, GROUP),
            lambda hist, boot=False: rmsnorm.rmsnorm_fp8_fwd_delayed_triton(x, w, hist, 1e-5, GROUP, bootstrap=boot),
            {"current": 2 * n + n + n + n, "delayed": 2 * n + n + n})


def _rope_qkv_bwd(m, h, f, device):
    """The [q|k|v] output gradient from attention's dq, dk, dv ([batch, seq, heads, 128] views of [batch, heads, seq,
    128], as SDPA's backward leaves them; q, k and v of H columns each)."""
    d, seq = 128, min(m, 4096 if h > 2048 else 2048)
    cos, sin = (t.to(device) for t in rope_tables(d, seq, 10000.0))
    dq, dk, dv = ((torch.randn(m // seq, h // d, seq, d, device=device) * 1e-3).to(torch.bfloat16).transpose(1, 2)
                  for _ in range(3))
    n = 3 * m * h  # current: RoPE's pass reads 2 B and writes the BF16 joined gradient (2 B), the cast reads it (2 B)
    # and writes both layouts (1 + 1 B); delayed: RoPE's pass reads 2 B and writes the codes (1 B), the byte
    # transpose reads 1 B and writes 1 B
    return (lambda: rope_grad_cast.rope_qkv_grad_fp8_triton(dq, dk, dv, cos, sin, E5M2),
            lambda hist, boot=False: rope_grad_cast.rope_qkv_grad_fp8_delayed_triton(dq, dk, dv, cos, sin, E5M2, hist,
                                                                                      bootstrap=boot),
            {"current": 8 * n, "delayed": 5 * n})


OPS = {"swiglu_bwd": _swiglu_bwd, "swiglu_fwd": _swiglu_fwd, "rmsnorm_fwd": _rmsnorm_fwd,
       "rope_qkv_bwd": _rope_qkv_bwd}
# Ops whose swept setting changes a reduction's summation order (RMSNorm's warps per row: the row's sum of squares),
# so its bytes may differ from the library setting's by one rounding of rstd: recorded (same_bytes_as_library), not
# a failure. A tile of the elementwise kernels changes no arithmetic: there any byte that differs fails the run.
REORDERS = {"rmsnorm_fwd"}


def measure(op: str, name: str, m: int, h: int, f: int, repeats: int, device: str, eager: bool = False,
            library_bytes: dict | None = None) -> dict:
    """library_bytes: {(op, name): outputs} of the library's setting, filled by its row and compared with by the
    swept ones (the same seed makes the same inputs), so a tile that changes any byte fails the run."""
    torch.manual_seed(0)
    current, delayed, moved = OPS[op](m, h, f, device)
    history = torch.zeros(16, device=device)
    delayed(history, True)  # bootstrap: records this input's amax
    outs = current()
    same = all(same_bytes(a, b) for a, b in zip(outs, delayed(history)))  # history max = own amax
    as_library = None
    if library_bytes is not None:
        first = library_bytes.setdefault((op, name), outs)
        as_library = all(same_bytes(a, b) for a, b in zip(first, outs))
        if op not in REORDERS:
            same = same and as_library
    del outs
    runs = {"current": current, "delayed": lambda: delayed(history)}
    times = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved, so drift touches all alike
        for k, fn in runs.items():
            times[k].append(time_call_ms(fn, device, eager))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"op": op, "shape": name, "tokens": m, "hidden": h, "ffn": f, "same_bytes": same,
            "same_bytes_as_library": as_library,
            "ms": med, "ms_repeats": times, "speedup": med["current"] / med["delayed"],
            "bytes": moved, "gb_per_s": {k: moved[k] / (med[k] * 1e-3) / 1e9 for k in med}}


SETTING_NAMES = {"swiglu_bwd": ("BM", "warps"), "swiglu_fwd": ("BM", "warps"), "rmsnorm_fwd": ("per_warp",),
                 "rope_qkv_bwd": ("BM", "BN", "warps")}


def _tile(text: str, flag: str) -> tuple[int, int]:
    return parse_tile(text, flag, ("BM", "WARPS"), 32)


def _per_warp(text: str) -> tuple[int]:
    n = int(text) if text.isdigit() else 0
    if n < 32 or n & (n - 1):
        raise ValueError(f"--sweep-norm takes row elements per warp, a power of two >= 32: got {text!r}")
    return (n,)


def _apply(op: str, setting: tuple) -> None:
    if op == "swiglu_bwd":
        swiglu.set_tile("backward", setting)
    elif op == "swiglu_fwd":
        swiglu.set_tile("forward", setting)
    elif op == "rope_qkv_bwd":  # the cast's tile (the delayed path's byte transpose has its own: bench_transpose_fp8)
        cast_transpose.set_tile("cast", setting)
    else:
        rmsnorm.set_tile("forward", setting)


def best_settings(rows: list[dict]) -> list[str]:
    """Per op and shape, the setting whose delayed call (the trainer's default path) was fastest with the right
    bytes, against the library's."""
    lines = []
    for (op, shape), best, speedup, n in best_rows(rows, lambda r: (r["op"], r["shape"]), lambda r: r["ms"]["delayed"],
                                                   lambda r: r["kernel_setting"]["library"]):
        if n < 2:  # not swept
            continue
        setting = " ".join(f"{k} {v}" for k, v in best["kernel_setting"].items() if k != "library")
        lines.append(f"best {op:11s} {shape:9s} {setting}: {best['ms']['delayed'] * 1e3:.1f} us, "
                     f"x{speedup:.3f} the library setting's")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/bench_delayed_scaling.json")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--eager", action="store_true", help="time each call launched from Python, not in a CUDA graph")
    p.add_argument("--sweep", nargs="*", default=[], metavar="BM:WARPS",
                   help="also time SwiGLU's backward cast pass at these tile heights and warp counts (e.g. 128:8)")
    p.add_argument("--sweep-fwd", nargs="*", default=[], metavar="BM:WARPS",
                   help="also time SwiGLU's forward kernel at these tile heights and warp counts (e.g. 64:8)")
    p.add_argument("--sweep-norm", nargs="*", default=[], metavar="PER_WARP",
                   help="also time RMSNorm's forward kernel with these row elements per warp (e.g. 512 2048)")
    p.add_argument("--ops", nargs="+", default=list(OPS), metavar="OP", help=f"which of {', '.join(OPS)} (all)")
    args = p.parse_args()

    def settings():
        unknown = sorted(set(args.ops) - set(OPS))
        if unknown:
            raise ValueError(f"--ops: unknown {', '.join(unknown)} (choose from {', '.join(OPS)})")
        return {"swiglu_bwd": [swiglu.tiles()["backward"]] + [_tile(c, "--sweep") for c in args.sweep],
                "swiglu_fwd": [swiglu.tiles()["forward"]] + [_tile(c, "--sweep-fwd") for c in args.sweep_fwd],
                "rmsnorm_fwd": [rmsnorm.tiles()["forward"]] + [_per_warp(c) for c in args.sweep_norm],
                "rope_qkv_bwd": [cast_transpose.tiles()["cast"]]}

    started = start(args.cpu_smoke, settings)
    if started is None:
        return 2
    device, configs = started
    log = SweepLog(args.out, device,
                   "delayed scaling per call: SwiGLU's backward, SwiGLU's and RMSNorm's forward, the [q|k|v] "
                   "gradient's RoPE backward and cast, current vs delayed",
                   timing="eager" if args.eager else "cuda graph", group_size=GROUP)
    shapes = SMOKE if args.cpu_smoke else SHAPES
    repeats = 1 if args.cpu_smoke else args.repeats
    for op in args.ops:
        library_bytes = {}  # this op's outputs at the library setting, per shape (the previous op's freed)
        for setting in configs[op]:
            _apply(op, setting)  # module settings, read at each launch
            for name, m, h, f in shapes:
                r = measure(op, name, m, h, f, repeats, device, args.eager, library_bytes)
                r["kernel_setting"] = {**dict(zip(SETTING_NAMES[op], setting)), "library": setting == configs[op][0]}
                log.add(r)
                tile = " ".join(f"{k} {v:4d}" for k, v in zip(SETTING_NAMES[op], setting))
                print(f"{op:11s} {name:9s} {tile:18s}  current {r['ms']['current'] * 1e3:8.1f} us  "
                      f"delayed {r['ms']['delayed'] * 1e3:8.1f} us  "
                      f"x{r['speedup']:.2f}  same bytes: {r['same_bytes']}", flush=True)
        _apply(op, configs[op][0])
    return log.finish(best_settings(log.rows))


if __name__ == "__main__":
    sys.exit(main())
