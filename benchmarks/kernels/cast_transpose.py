"""The FP8 casts of megacoat.ops.cast_transpose per call and per tile, against a device copy of the same bytes.

`--kernel cast` (default): every linear operand's cast given its amax (as the trained step runs it), writing the
row-major copy and the transpose, or one of them, at the 1.3 B model's and a 7B layer's gradient shapes.
`--kernel transpose`: the FP8 byte transpose of the [q|k|v] gradient (its wgrad layout under delayed scaling).
`--sweep BM:BN:WARPS ...` times other tiles after the library's (megacoat.ops.cast_transpose.tiles()); every tile
must write the reference's bytes, or the run fails. Each call is timed inside a CUDA graph, repeated and
interleaved with the copy, whose GB/s is the yardstick.

    python -m benchmarks.kernels.cast_transpose [--kernel cast|transpose] [--repeats 3] [--sweep 128:64:4 ...]
    python -m benchmarks.kernels.cast_transpose --cpu-smoke   # no GPU: tiny shapes under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import statistics
import sys

# first: under --cpu-smoke it sets TRITON_INTERPRET before any kernel is defined
from benchmarks.common import SweepLog, best_rows, parse_tile, same_bytes, start, time_call_ms

import torch

from megacoat.ops import cast_transpose as ct

E5M2 = torch.float8_e5m2
# (name, rows, columns): a [tokens, hidden] gradient of the 1.3 B model at micro-batch 4, 8 and 12 (seq 2048), and
# of one 7B layer (seq 4096)
SHAPES = [("1.3B mb4", 4 * 2048, 2048), ("1.3B mb8", 8 * 2048, 2048), ("1.3B mb12", 12 * 2048, 2048),
          ("7B mb1", 4096, 4096)]
# the [q|k|v] gradient [tokens, 3 x hidden] of the 1.3 B model at micro-batch 12 and 32, and of one 7B layer
TRANSPOSE_SHAPES = [("1.3B mb12", 12 * 2048, 3 * 2048), ("1.3B mb32", 32 * 2048, 3 * 2048), ("7B mb1", 4096, 3 * 4096)]
SMOKE = [("smoke", 96, 160)]
LAYOUTS = {"both": (True, True), "rowwise": (True, False), "transpose": (False, True)}


def measure(name: str, m: int, n: int, layout: str, repeats: int, device: str, reference_bytes: dict) -> dict:
    """reference_bytes: {(shape, layout): the bytes every tile must write}, made once per shape and layout."""
    torch.manual_seed(0)
    x = (torch.randn(m, n, device=device) * 1e-2).to(torch.bfloat16)
    amax = ct.tensor_amax(x).float()
    rowwise, transpose = LAYOUTS[layout]
    cast = lambda: ct.cast_from_amax_triton(x, amax, E5M2, rowwise, transpose)  # noqa: E731
    q, qt, _ = cast()
    if (name, layout) not in reference_bytes:
        # on the GPU the torch reference; under the interpreter (whose FP8 casts round differently,
        # tests/ops/fp8_compare.py) the first tile's output
        reference_bytes[(name, layout)] = (ct.cast_from_amax_ref(x, amax, E5M2, rowwise, transpose)[:2]
                                           if device == "cuda" else (q, qt))
    want = reference_bytes[(name, layout)]
    same = same_bytes(want[0], q) and same_bytes(want[1], qt)
    del q, qt
    y = torch.empty_like(x)
    copy = lambda: y.copy_(x)  # noqa: E731
    times = {"cast": [], "copy": []}
    for _ in range(repeats):  # interleaved, so drift touches both alike
        times["cast"].append(time_call_ms(cast, device))
        times["copy"].append(time_call_ms(copy, device))
    ms = {k: statistics.median(v) for k, v in times.items()}
    moved = 2 * m * n + m * n * (rowwise + transpose)  # bf16 read, one FP8 byte per element and layout written
    gbps = moved / (ms["cast"] * 1e-3) / 1e9
    copy_gbps = 4 * m * n / (ms["copy"] * 1e-3) / 1e9
    return {"shape": name, "rows": m, "cols": n, "layout": layout, "same_bytes": same, "ms": ms["cast"],
            "ms_repeats": times["cast"], "copy_ms": ms["copy"], "bytes": moved, "gb_per_s": gbps,
            "copy_gb_per_s": copy_gbps, "fraction_of_copy": gbps / copy_gbps}


def measure_transpose(name: str, m: int, n: int, repeats: int, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randint(0, 256, (m, n), dtype=torch.uint8, device=device, generator=g).view(torch.float8_e5m2)
    same = same_bytes(q.t().contiguous(), ct.transpose_fp8_triton(q))
    src, dst = q.view(torch.uint8), torch.empty((m, n), dtype=torch.uint8, device=device)
    times = {"transpose": [], "copy": []}
    for _ in range(repeats):  # interleaved, so drift touches both alike
        times["transpose"].append(time_call_ms(lambda: ct.transpose_fp8_triton(q), device))
        times["copy"].append(time_call_ms(lambda: dst.copy_(src), device))
    ms = {k: statistics.median(v) for k, v in times.items()}
    moved = 2 * m * n  # one byte read and one written per element
    gbps, copy_gbps = (moved / (ms[k] * 1e-3) / 1e9 for k in ("transpose", "copy"))
    return {"shape": name, "rows": m, "cols": n, "layout": "transpose-bytes", "same_bytes": same,
            "ms": ms["transpose"], "ms_repeats": times["transpose"], "copy_ms": ms["copy"], "bytes": moved,
            "gb_per_s": gbps, "copy_gb_per_s": copy_gbps, "fraction_of_copy": gbps / copy_gbps}


def best_tiles(rows: list[dict]) -> list[str]:
    """Per shape and layout, the fastest tile that wrote the right bytes, against the library's."""
    lines = []
    for (shape, layout), best, speedup, _ in best_rows(rows, lambda r: (r["shape"], r["layout"]), lambda r: r["ms"],
                                                        lambda r: r["tile"]["library"]):
        t = best["tile"]
        lines.append(f"best {shape:9s} {layout:9s} BM {t['BM']:3d} BN {t['BN']:3d} warps {t['warps']:2d}: "
                     f"{best['ms'] * 1e3:.1f} us, x{speedup:.3f} the library tile's")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=("cast", "transpose"), default="cast")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", nargs="*", default=[], metavar="BM:BN:WARPS")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS), help="--kernel cast only")
    p.add_argument("--out", default="benchmarks/results/kernels_cast_transpose.json")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    started = start(args.cpu_smoke, lambda: [ct.tiles()[args.kernel]] + [
        parse_tile(t, "--sweep", ("BM", "BN", "WARPS"), 16) for t in args.sweep])
    if started is None:
        return 2
    device, tiles = started
    shapes = SMOKE if args.cpu_smoke else SHAPES if args.kernel == "cast" else TRANSPOSE_SHAPES
    repeats = 1 if args.cpu_smoke else args.repeats
    library = tiles[0]
    what = {"cast": "the FP8 cast launch of quantize_transpose given the amax, per tile and layout",
            "transpose": "the FP8 byte transpose (transpose_fp8_triton) per tile"}[args.kernel]
    log = SweepLog(args.out, device, what)
    for name, m, n in shapes:
        reference_bytes = {}  # this shape's reference outputs (the previous shape's freed)
        for tile in tiles:
            ct.set_tile(args.kernel, tile)
            for layout in args.layouts if args.kernel == "cast" else ["transpose-bytes"]:
                r = (measure(name, m, n, layout, repeats, device, reference_bytes) if args.kernel == "cast"
                     else measure_transpose(name, m, n, repeats, device))
                r["tile"] = {"BM": tile[0], "BN": tile[1], "warps": tile[2], "library": tile == library}
                log.add(r)
                print(f"{name:9s} {layout:15s} BM {tile[0]:3d} BN {tile[1]:3d} warps {tile[2]:2d}  "
                      f"{r['ms'] * 1e3:7.1f} us  {r['gb_per_s']:6.0f} GB/s ({r['fraction_of_copy']:.2f} of a copy)  "
                      f"same bytes: {r['same_bytes']}", flush=True)
        ct.set_tile(args.kernel, library)
    return log.finish(best_tiles(log.rows))


if __name__ == "__main__":
    sys.exit(main())
