"""The [q|k|v] gradient's delayed cast per call: the library's path (RoPE's one-token programs write the codes
row-major, then the byte transpose writes the wgrad layout) against one tiled pass per part that writes both
layouts (rope_grad_cast._rope_grad_tiles_kernel), per tile. Every tile must write the library path's bytes (codes,
transposed codes, amax, scale), or the run fails. dq, dk, dv come from a real SDPA backward of the model's layout
(their strides are printed and recorded). Each call is timed inside a CUDA graph, repeated and interleaved with a
device copy of the same bytes as the yardstick.

    python benchmarks/bench_rope_grad_tiles.py [--repeats 3] [--sweep 64:4:4 128:4:8]
        [--out benchmarks/results/bench_rope_grad_tiles.json]
    python benchmarks/bench_rope_grad_tiles.py --cpu-smoke   # no GPU: tiny shapes under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megacoat.model.gpt import rope_tables  # noqa: E402
from megacoat.ops import rope_grad_cast as R  # noqa: E402
from benchmarks.sweep_common import (best_rows, parse_tile, same_bytes, sweep_device, time_call_ms,  # noqa: E402
                                     write_json)

E5M2 = torch.float8_e5m2
# (name, batch, seq, heads, head_dim): the 1.3 B model at micro-batch 8 and 32, one 7B layer
SHAPES = [("1.3B mb8", 8, 2048, 16, 128), ("1.3B mb32", 32, 2048, 16, 128), ("7B mb1", 1, 4096, 32, 128)]
SMOKE = [("smoke", 2, 64, 2, 16)]


def _grads(b, s, nh, d, device):
    """dq, dk, dv as attention's backward leaves them: q, k, v [b, s, h, d] seen as [b, h, s, d] by SDPA."""
    q, k, v = (torch.randn(b, s, nh, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    out.backward(torch.randn_like(out) * 1e-3)
    return q.grad, k.grad, v.grad


def _tile(text: str) -> tuple[int, int, int]:
    """'BT:HPP:WARPS': BT a power of two >= 16, HPP (heads a program) >= 1, WARPS a power of two up to 16."""
    bt, _, rest = text.partition(":")
    bt = parse_tile(f"{bt}:{rest.partition(':')[2] or 0}", "--sweep", ("BT", "WARPS"), 16)[0] if rest else 0
    hpp, _, warps = rest.partition(":")
    if not (bt and hpp.isdigit() and int(hpp) >= 1):
        raise ValueError(f"--sweep takes BT:HPP:WARPS (BT a power of two >= 16, HPP >= 1, WARPS a power of two up "
                         f"to 16): got {text!r}")
    return bt, int(hpp), int(warps)


def measure(b, s, nh, d, repeats, device, cos, sin) -> dict:
    torch.manual_seed(0)
    dq, dk, dv = _grads(b, s, nh, d, device)
    strides = [list(t.stride()) for t in (dq, dk, dv)]
    hist = torch.zeros(16, device=device)
    R.rope_qkv_grad_fp8_delayed_triton(dq, dk, dv, cos, sin, E5M2, hist, bootstrap=True)
    hist[0] *= 0.5  # some values saturate: the clamp is compared too

    def library():
        scale = torch.empty((1,), dtype=torch.float32, device=device)
        g8, amax = R._joined_triton(dq, dk, dv, cos, sin, E5M2, hist, scale)
        return g8, R.transpose_fp8_triton(g8), amax, scale

    def tiles():
        scale = torch.empty((1,), dtype=torch.float32, device=device)
        return (*R._tiles_triton(dq, dk, dv, cos, sin, E5M2, hist, scale), scale)

    same = all(same_bytes(x, y) for x, y in zip(library(), tiles()))
    m, n = b * s, 3 * nh * d
    src = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    dst = torch.empty((m, n * 2), dtype=torch.uint8, device=device)
    runs = {"library": library, "tiles": tiles, "copy": lambda: dst.view(torch.bfloat16)[:, :n].copy_(src)}
    times = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved, so drift touches all alike
        for k, fn in runs.items():
            times[k].append(time_call_ms(fn, device))
    ms = {k: statistics.median(v) for k, v in times.items()}
    moved = {"library": 5 * m * n, "tiles": 4 * m * n, "copy": 4 * m * n}
    return {"tokens": m, "cols": n, "grad_strides": strides, "same_bytes": same, "ms": ms, "ms_repeats": times,
            "bytes": moved, "gb_per_s": {k: moved[k] / (ms[k] * 1e-3) / 1e9 for k in ms},
            "speedup": ms["library"] / ms["tiles"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", nargs="*", default=[], metavar="BT:HPP:WARPS")
    p.add_argument("--out", default="benchmarks/results/bench_rope_grad_tiles.json")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    first = (R._TILES_BT, R._TILES_HPP, R._TILES_WARPS)
    try:
        tiles = [first] + [_tile(t) for t in args.sweep]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = sweep_device(args.cpu_smoke)
    if device is None:
        return 2
    shapes, repeats = (SMOKE, 1) if args.cpu_smoke else (SHAPES, args.repeats)
    rows = []

    def write(complete: bool) -> None:
        write_json(args.out, {
            "what": "the [q|k|v] gradient's delayed cast: row programs + byte transpose against one tiled pass",
            "command": "python " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "timing": "cuda graph", "results": rows,
            "complete": complete})

    for name, b, s, nh, d in shapes:
        cos, sin = (t.to(device) for t in rope_tables(d, s, 10000.0))
        for tile in tiles:
            R._TILES_BT, R._TILES_HPP, R._TILES_WARPS = tile
            r = {"shape": name, **measure(b, s, nh, d, repeats, device, cos, sin),
                 "tile": {"BT": tile[0], "HPP": tile[1], "warps": tile[2], "library": tile == first}}
            rows.append(r)
            write(False)
            g = r["gb_per_s"]
            print(f"{name:9s} BT {tile[0]:3d} HPP {tile[1]:2d} warps {tile[2]:2d}  library {r['ms']['library'] * 1e3:7.1f}"
                  f" us ({g['library']:5.0f} GB/s)  tiles {r['ms']['tiles'] * 1e3:7.1f} us ({g['tiles']:5.0f} GB/s)  "
                  f"copy {g['copy']:5.0f} GB/s  x{r['speedup']:.3f}  same bytes: {r['same_bytes']}  "
                  f"strides {r['grad_strides'][0]}", flush=True)
        R._TILES_BT, R._TILES_HPP, R._TILES_WARPS = first
    write(True)
    for shape, best, _, _ in best_rows(rows, lambda r: r["shape"], lambda r: r["ms"]["tiles"],
                                       lambda r: r["tile"]["library"]):
        t = best["tile"]
        print(f"best {shape:9s} BT {t['BT']} HPP {t['HPP']} warps {t['warps']}: {best['ms']['tiles'] * 1e3:.1f} us, "
              f"x{best['speedup']:.3f} the library path's")
    print("wrote", args.out)
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
