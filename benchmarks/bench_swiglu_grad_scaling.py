"""SwiGLU's FP8 backward with current scaling (an amax pass, then the cast pass) against delayed scaling (the cast
pass alone, with the amax of earlier calls; --fp8-grad-scaling delayed), per call, at the shapes the e2e model
and the 7B layer run.

Both write the same things: da1|da3 in E5M2, row-major and transposed, and s^T in E4M3. With a history whose
maximum is this call's own amax (a bootstrap call records it), the two produce the same bytes: checked here on the
device before timing. Median of triton.testing.do_bench per call, repeated; bytes counted as each read and write
(ds 2 B and the E4M3 pair 2 B per (token, ffn) element, read twice by current scaling; da twice 2 B, s^T 1 B).

The delayed call is the cast pass and one memset: the pass reads the history's maximum and its last program rolls
this call's amax in (benchmarks/results/bench_e2e_notes.md has the sweep that showed the torch ops this replaced
costing ~25 us a call). `--sweep BM:WARPS ...` repeats everything with other tile heights and warp counts of the
cast pass (the library's are the first row), each checked for the same bytes before it is timed.

    python benchmarks/bench_swiglu_grad_scaling.py [--repeats 3] [--sweep 64:4 32:4 128:8 128:16]
        [--out benchmarks/results/bench_swiglu_grad_scaling.json]
    python benchmarks/bench_swiglu_grad_scaling.py --cpu-smoke   # no GPU: a tiny shape under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megacoat.ops import swiglu  # noqa: E402

E5M2 = torch.float8_e5m2
GROUP = 128
# (name, tokens, ffn): the 1.3 B model of bench_e2e.py at micro-batch 4 and 8 (seq 2048), one 7B layer (seq 4096)
SHAPES = [("1.3B mb4", 4 * 2048, 5632), ("1.3B mb8", 8 * 2048, 5632), ("7B mb1", 4096, 11008)]
SMOKE = [("smoke", 64, 256)]


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


def measure(name: str, m: int, f: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    a13 = (torch.randn(m, 2 * f, device=device) * 2).to(torch.bfloat16)
    pair = swiglu.swiglu_fp8_fwd_triton(a13, GROUP)
    del a13
    ds = (torch.randn(m, f, device=device) * 1e-3).to(torch.bfloat16)
    history = torch.zeros(16, device=device)
    current = swiglu.swiglu_fp8_bwd_out_t_triton(ds, *pair, GROUP, E5M2)
    swiglu.swiglu_fp8_bwd_delayed_triton(ds, *pair, history, GROUP, E5M2, bootstrap=True)
    delayed = swiglu.swiglu_fp8_bwd_delayed_triton(ds, *pair, history, GROUP, E5M2)  # history max = own amax
    same = all(_same(a, b) for a, b in zip(current, delayed))

    def run_current():
        swiglu.swiglu_fp8_bwd_out_t_triton(ds, *pair, GROUP, E5M2)

    def run_delayed():
        swiglu.swiglu_fp8_bwd_delayed_triton(ds, *pair, history, GROUP, E5M2)

    del current, delayed

    def timed(fn):
        if device == "cuda":
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    runs = {"current": run_current, "delayed": run_delayed}
    times = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved, so drift touches all alike
        for k, fn in runs.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    n = m * f
    moved = {"current": 2 * (4 * n) + 4 * n + n, "delayed": 4 * n + 4 * n + n}  # reads + writes, bytes
    return {"shape": name, "tokens": m, "ffn": f, "same_bytes_at_equal_amax": same,
            "ms": med, "ms_repeats": times, "speedup": med["current"] / med["delayed"],
            "bytes": moved, "gb_per_s": {k: moved[k] / (med[k] * 1e-3) / 1e9 for k in med}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/bench_swiglu_grad_scaling.json")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--sweep", nargs="*", default=[], metavar="BM:WARPS",
                   help="also time the cast pass at these tile heights and warp counts (e.g. 128:8)")
    args = p.parse_args()
    try:
        configs = [(swiglu._BM_T, swiglu._WARPS_T)] + [tuple(int(x) for x in c.split(":")) for c in args.sweep]
    except ValueError:
        configs = [()]
    if not all(len(c) == 2 and c[0] >= 16 and c[0] & (c[0] - 1) == 0 and c[1] in (1, 2, 4, 8, 16, 32)
               for c in configs):
        print("error: --sweep takes BM:WARPS pairs, BM a power of two >= 16, WARPS a power of two up to 32: "
              f"{args.sweep}",
              file=sys.stderr)
        return 2
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    rows = []
    library = configs[0]
    for bm, warps in configs:
        swiglu._BM_T, swiglu._WARPS_T = bm, warps  # read at each launch
        for name, m, f in (SMOKE if args.cpu_smoke else SHAPES):
            r = measure(name, m, f, 1 if args.cpu_smoke else args.repeats, device)
            r["cast_pass"] = {"BM": bm, "num_warps": warps, "library": (bm, warps) == library}
            rows.append(r)
            print(f"{name:10s} BM {bm:3d} warps {warps:2d}  current {r['ms']['current'] * 1e3:8.1f} us  "
                  f"delayed {r['ms']['delayed'] * 1e3:8.1f} us  "
                  f"x{r['speedup']:.2f}  same bytes at equal amax: {r['same_bytes_at_equal_amax']}", flush=True)
    swiglu._BM_T, swiglu._WARPS_T = library
    result = {"what": "SwiGLU FP8 backward per call: current vs delayed gradient scaling",
              "command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if device == "cuda"
              else platform.processor() or "cpu", "torch": torch.__version__, "triton": triton.__version__,
              "group_size": GROUP, "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print("wrote", args.out)
    return 0 if all(r["same_bytes_at_equal_amax"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
