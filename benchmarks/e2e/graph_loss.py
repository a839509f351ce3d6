"""Does compiling or CUDA-graphing the FP8 step change what it learns? The default model (`python pretrain_gpt.py`,
the embedded corpus) trained in `coat` for 200 steps eager, with --compile and with --compile --enable-cuda-graph,
same seed and data; a second seed of the eager run shows how far two equally valid runs drift apart.

Agreement: the loss of each variant at every logged iteration against the eager run's, relative. Eager and compiled
are not bit-identical (Inductor keeps bf16 intermediates in fp32 registers, so some FP8 codes round differently:
tests/fp8/test_blocks.py), so the runs drift like two seeds do, only less. Reported per variant: the largest and
the final relative difference, next to the seed-to-seed one; the bar is bf16's relative precision (2^-8) for the
final loss, averaged over the last 10% of the run.

    python -m benchmarks.e2e.graph_loss --out benchmarks/results/graph_loss_agreement.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT  # noqa: E402
VARIANTS = {"eager": [], "compile": ["--compile"], "cuda-graph": ["--compile", "--enable-cuda-graph"],
            "eager-seed2": ["--seed", "2"]}
BF16_PRECISION = 2 ** -8


def train(flags: list[str], iters: int, tmp: str, name: str) -> list[tuple[int, float]]:
    log = os.path.join(tmp, f"{name}.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--coat-fp8", "--train-iters", str(iters),
           "--log-interval", "1", "--eval-iters", "0", "--log-json", log, *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{name} failed ({' '.join(cmd[1:])}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return [(r["iteration"], r["loss"]) for r in map(json.loads, open(log)) if "loss" in r]


def tail_mean(curve: list[tuple[int, float]]) -> float:
    tail = [loss for _, loss in curve[-max(1, len(curve) // 10):]]
    return sum(tail) / len(tail)


def compare(curve: list[tuple[int, float]], ref: list[tuple[int, float]]) -> dict:
    rel = [abs(a - b) / b for (_, a), (_, b) in zip(curve, ref)]
    final = abs(tail_mean(curve) - tail_mean(ref)) / tail_mean(ref)
    return {"max_rel": max(rel), "final_rel": final, "final_within_bf16_precision": final <= BF16_PRECISION}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "graph_loss_agreement.json"))
    args = ap.parse_args()
    if "eager" not in args.variants:
        ap.error("--variants must include eager (the reference)")
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        curves = {v: train(VARIANTS[v], args.iters, tmp, v) for v in args.variants}
    out = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "iters": args.iters, "bar": "final loss (mean of the last 10%) within 2^-8 relative of eager's",
           "final_loss": {v: tail_mean(c) for v, c in curves.items()},
           "vs_eager": {v: compare(c, curves["eager"]) for v, c in curves.items() if v != "eager"},
           "curves": curves}
    for v, r in out["vs_eager"].items():
        print(f"{v:12s} final {out['final_loss'][v]:.4f}  vs eager: final {r['final_rel']:.2%}  max {r['max_rel']:.2%}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
