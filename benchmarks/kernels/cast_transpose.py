"""The FP8 cast of every linear's operands per call, at the shapes the e2e model and the 7B layer run: the cast
launch alone, given the tensor's amax (as the trained step runs it: under torch.compile the amax is a reduction
fused elsewhere or a pass of its own), writing the row-major copy and the transpose, or one of them.

`--sweep BM:BN:WARPS ...` times other tiles (the library's, megacoat.ops.cast_transpose.tiles()["cast"], is each
shape's first row); on the GPU every tile must write the torch reference's bytes, or the run fails. Each call is
timed inside a CUDA graph (triton.testing.do_bench_cudagraph), repeated and interleaved with a device-to-device copy
of the same bytes read, whose GB/s is the yardstick.

    python -m benchmarks.kernels.cast_transpose [--repeats 3] [--sweep 128:64:4 128:128:8 64:128:4]
        [--out benchmarks/results/bench_cast_transpose.json]
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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", nargs="*", default=[], metavar="BM:BN:WARPS")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", default="benchmarks/results/bench_cast_transpose.json")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    started = start(args.cpu_smoke, lambda: [ct.tiles()["cast"]] + [
        parse_tile(t, "--sweep", ("BM", "BN", "WARPS"), 16) for t in args.sweep])
    if started is None:
        return 2
    device, tiles = started
    shapes, repeats = (SMOKE, 1) if args.cpu_smoke else (SHAPES, args.repeats)
    library = tiles[0]
    log = SweepLog(args.out, device, "the FP8 cast launch of quantize_transpose given the amax, per tile and layout")
    for name, m, n in shapes:
        reference_bytes = {}  # this shape's reference outputs (the previous shape's freed)
        for tile in tiles:
            ct.set_tile("cast", tile)
            for layout in args.layouts:
                r = measure(name, m, n, layout, repeats, device, reference_bytes)
                r["tile"] = {"BM": tile[0], "BN": tile[1], "warps": tile[2], "library": tile == library}
                log.add(r)
                print(f"{name:9s} {layout:9s} BM {tile[0]:3d} BN {tile[1]:3d} warps {tile[2]:2d}  "
                      f"{r['ms'] * 1e3:7.1f} us  {r['gb_per_s']:6.0f} GB/s ({r['fraction_of_copy']:.2f} of a copy)  "
                      f"same bytes: {r['same_bytes']}", flush=True)
        ct.set_tile("cast", library)
    return log.finish(best_tiles(log.rows))


if __name__ == "__main__":
    sys.exit(main())
