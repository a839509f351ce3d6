"""The FP8 byte transpose per call (megacoat.ops.cast_transpose.transpose_fp8_triton), per tile: the [q|k|v]
gradient's wgrad layout under delayed scaling, which RoPE's backward writes row-major, one token per program.

The library's tile is its own (megacoat.ops.cast_transpose.tiles()["transpose"]), not the cast's: 1-byte elements
want longer segments each way. `--sweep BM:BN:WARPS ...` times other tiles (the library's first); every
tile must write q.t().contiguous()'s bytes, or the run fails. Each call is timed inside a CUDA graph, repeated and
interleaved with a device-to-device copy of the same bytes, whose GB/s is the yardstick.

    python -m benchmarks.kernels.transpose_fp8 [--repeats 3] [--sweep 128:128:8 64:128:4]
        [--out benchmarks/results/bench_transpose_fp8.json]
    python -m benchmarks.kernels.transpose_fp8 --cpu-smoke   # no GPU: tiny shapes under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import statistics
import sys

# first: under --cpu-smoke it sets TRITON_INTERPRET before any kernel is defined
from benchmarks.common import SweepLog, best_rows, parse_tile, same_bytes, start, time_call_ms

import torch

from megacoat.ops import cast_transpose as ct

# (name, rows, columns): the [q|k|v] gradient [tokens, 3 x hidden] of the 1.3 B model at micro-batch 12 and 32
# (seq 2048), and of one 7B layer (seq 4096)
SHAPES = [("1.3B mb12", 12 * 2048, 3 * 2048), ("1.3B mb32", 32 * 2048, 3 * 2048), ("7B mb1", 4096, 3 * 4096)]
SMOKE = [("smoke", 96, 160)]


def measure(m: int, n: int, repeats: int, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randint(0, 256, (m, n), dtype=torch.uint8, device=device, generator=g).view(torch.float8_e5m2)
    qt = ct.transpose_fp8_triton(q)
    same = same_bytes(q.t().contiguous(), qt)
    del qt
    src, dst = q.view(torch.uint8), torch.empty((m, n), dtype=torch.uint8, device=device)
    times = {"transpose": [], "copy": []}
    for _ in range(repeats):  # interleaved, so drift touches both alike
        times["transpose"].append(time_call_ms(lambda: ct.transpose_fp8_triton(q), device))
        times["copy"].append(time_call_ms(lambda: dst.copy_(src), device))
    ms = {k: statistics.median(v) for k, v in times.items()}
    moved = 2 * m * n  # one byte read and one written per element
    gbps, copy_gbps = (moved / (ms[k] * 1e-3) / 1e9 for k in ("transpose", "copy"))
    return {"rows": m, "cols": n, "same_bytes": same, "ms": ms["transpose"], "ms_repeats": times["transpose"],
            "copy_ms": ms["copy"], "bytes": moved, "gb_per_s": gbps, "copy_gb_per_s": copy_gbps,
            "fraction_of_copy": gbps / copy_gbps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", nargs="*", default=[], metavar="BM:BN:WARPS")
    p.add_argument("--out", default="benchmarks/results/bench_transpose_fp8.json")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    library = ct.tiles()["transpose"]
    started = start(args.cpu_smoke, lambda: [library] + [
        parse_tile(t, "--sweep", ("BM", "BN", "WARPS"), 16) for t in args.sweep])
    if started is None:
        return 2
    device, tiles = started
    shapes, repeats = (SMOKE, 1) if args.cpu_smoke else (SHAPES, args.repeats)
    log = SweepLog(args.out, device, "the FP8 byte transpose (transpose_fp8_triton) per tile")
    for name, m, n in shapes:
        for tile in tiles:
            ct.set_tile("transpose", tile)
            r = {"shape": name, **measure(m, n, repeats, device),
                 "tile": {"BM": tile[0], "BN": tile[1], "warps": tile[2], "library": tile == library}}
            log.add(r)
            print(f"{name:9s} BM {tile[0]:3d} BN {tile[1]:3d} warps {tile[2]:2d}  {r['ms'] * 1e3:7.1f} us  "
                  f"{r['gb_per_s']:6.0f} GB/s ({r['fraction_of_copy']:.2f} of a copy)  same bytes: {r['same_bytes']}",
                  flush=True)
        ct.set_tile("transpose", library)
    lines = []
    for shape, best, speedup, _ in best_rows(log.rows, lambda r: r["shape"], lambda r: r["ms"],
                                             lambda r: r["tile"]["library"]):
        t = best["tile"]
        lines.append(f"best {shape:9s} BM {t['BM']:3d} BN {t['BN']:3d} warps {t['warps']:2d}: "
                     f"{best['ms'] * 1e3:.1f} us, x{speedup:.3f} the library tile's")
    return log.finish(lines)


if __name__ == "__main__":
    sys.exit(main())
