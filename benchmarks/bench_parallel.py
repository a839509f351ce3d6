"""Tensor, pipeline and data parallelism on one host, BF16 vs COAT (--coat-fp8), through megacoat's trainer.

    # 2 GPUs, ~1.3 B model (24 layers, hidden 2048, FFN 5632, seq 2048), mock tokens:
    python benchmarks/bench_parallel.py --gpus 2
    # CPU smoke test of this script (tiny model, gloo, fp32):
    python benchmarks/bench_parallel.py --gpus 2 --tiny
    # and each layout/mode's largest micro-batch (same number of micro-batches per step as the base run):
    python benchmarks/bench_parallel.py --gpus 2 --search 8,12,16

Each layout x mode is a separate run of the trainer under DeepSpeed's launcher (one process per GPU), exactly
as pretrain_gpt.py trains, plus one all-gather at the end of every rank's torch.cuda.max_memory_allocated
(pretrain_gpt.py logs rank 0's only, and pipeline stages differ). Layouts on N GPUs:
    tp  --tensor-model-parallel-size N --sequence-parallel   (ZeRO-1 over DP=1)
    pp  --pipeline-model-parallel-size N                     (ZeRO-1 over DP=1; DeepSpeed's 1F1B schedule)
    dp  data parallel over N, ZeRO-2
Same micro-batch and global batch in every run. tokens/s is the mean of the logged intervals after the first
(which holds warm-up and kernel compilation); TFLOP/s and MFU per GPU use the trainer's FLOP count (matmuls
only) against the GPU's BF16 dense peak, also for the FP8 runs. Ratios are within one invocation.
Writes benchmarks/results/bench_parallel[_tiny].json (and a copy into $OUT when set).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The sibling script (this folder is on sys.path when run as `python benchmarks/bench_parallel.py`).
from bench_e2e import MODEL_1P3B, environment  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

MODEL_TINY = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "64", "--vocab-size", "256"]
MODES = {"bf16": [], "coat": ["--coat-fp8"]}


def layouts(gpus: int) -> dict[str, list[str]]:
    return {
        "tp": ["--tensor-model-parallel-size", str(gpus), "--sequence-parallel", "--zero-stage", "1"],
        "pp": ["--pipeline-model-parallel-size", str(gpus), "--zero-stage", "1"],
        "dp": ["--zero-stage", "2"],
    }


def worker(argv: list[str], result_path: str) -> None:
    """One rank (under DeepSpeed's launcher): train as pretrain_gpt.py does, then rank 0 writes every rank's
    peak memory."""
    import torch
    import torch.distributed as dist

    from megacoat.arguments import parse_config
    from megacoat.training.trainer import Trainer, max_memory_bytes

    trainer = Trainer(parse_config(argv))
    trainer.train()
    peak = torch.tensor([max_memory_bytes(trainer.device)], dtype=torch.float64, device=trainer.device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        p = trainer.parallel
        with open(result_path, "w") as f:
            json.dump({"max_memory_bytes_per_rank": [int(t.item()) for t in peaks],
                       "tp": p.tp_size, "pp": p.pp_size, "dp": p.dp_size,
                       "grad_accum": trainer.grad_accum}, f)


def run(gpus: int, argv: list[str], timeout: int, port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log, result = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port", str(port),
               os.path.abspath(__file__), *argv, "--log-json", log]
        print("$", " ".join(argv), flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                                  env=dict(os.environ, BENCH_PARALLEL_RESULT=result))
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timeout after {timeout}s", "argv": argv}
        wall = time.perf_counter() - t0
        text = proc.stdout[-6000:] + proc.stderr[-6000:]
        if proc.returncode != 0 or not os.path.exists(result):
            oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
            return {"ok": False, "error": "oom" if oom else text[-2500:], "argv": argv}
        train = [r for r in map(json.loads, open(log)) if "loss" in r]
        extra = json.load(open(result))
    steady = train[1:] or train
    tokens_per_s = statistics.mean(r["tokens_per_s"] for r in steady)
    peaks = extra["max_memory_bytes_per_rank"]
    return {
        "ok": True, "argv": argv, "wall_s": wall, **{k: extra[k] for k in ("tp", "pp", "dp", "grad_accum")},
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / gpus,
        "tflops_per_gpu": statistics.mean(r["tflops_per_gpu"] for r in steady),
        "mfu": None if steady[0]["mfu"] is None else statistics.mean(r["mfu"] for r in steady),
        "max_memory_gib_per_gpu": [b / 2**30 for b in peaks], "max_memory_gib": max(peaks) / 2**30,
        "losses": [(r["iteration"], r["loss"]) for r in train],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=["dp", "tp", "pp"], choices=["dp", "tp", "pp"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--log-interval", type=int, default=4)
    p.add_argument("--timeout", type=int, default=150, help="seconds per run")
    p.add_argument("--search", default="", help="comma-separated micro-batch sizes to try, ascending, until OOM")
    p.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU ranks: checks this script")
    args = p.parse_args()
    model = MODEL_TINY if args.tiny else MODEL_1P3B
    common = model + ["--fp32" if args.tiny else "--bf16", "--mock-data", "--eval-iters", "0",
                      "--train-iters", str(args.iters), "--log-interval", str(args.log_interval)]
    if args.global_batch_size % args.micro_batch_size:
        raise SystemExit("--global-batch-size must be a multiple of --micro-batch-size")
    micro_batches = args.global_batch_size // args.micro_batch_size  # per step, over all DP ranks

    def batch(size: int) -> list[str]:
        return ["--micro-batch-size", str(size), "--global-batch-size", str(size * micro_batches)]

    name = "bench_parallel_tiny.json" if args.tiny else "bench_parallel.json"
    out = {"environment": environment(), "gpus": args.gpus, "model": " ".join(model),
           "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
           "iters": args.iters, "precision": "fp32 (CPU smoke run)" if args.tiny else "bf16 (+FP8 for coat)",
           "runs": {}, "largest_micro_batch": {} if args.search else "not searched"}
    port = 29700
    for layout in args.layouts:
        for mode in args.modes:
            port += 1
            res = run(args.gpus, common + batch(args.micro_batch_size) + layouts(args.gpus)[layout] + MODES[mode],
                      args.timeout, port)
            out["runs"][f"{layout}/{mode}"] = res
            print(layout, mode, {k: res.get(k) for k in ("tokens_per_s_per_gpu", "mfu", "max_memory_gib", "wall_s")},
                  res.get("error", "")[-800:], flush=True)
            base = out["runs"].get(f"{layout}/bf16", {})
            if mode != "bf16" and res["ok"] and base.get("ok"):
                res["speedup_vs_bf16"] = res["tokens_per_s"] / base["tokens_per_s"]
                res["memory_ratio_vs_bf16"] = res["max_memory_gib"] / base["max_memory_gib"]
            os.makedirs(RESULTS, exist_ok=True)
            with open(os.path.join(RESULTS, name), "w") as f:  # after every run: a cut-off call keeps the rest
                json.dump(out, f, indent=1)
            if os.environ.get("OUT"):
                shutil.copy(os.path.join(RESULTS, name), os.environ["OUT"])
    for layout in args.layouts if args.search else []:
        for mode in args.modes:
            best = None
            for size in (int(x) for x in args.search.split(",")):
                port += 1
                res = run(args.gpus, common + batch(size) + layouts(args.gpus)[layout] + MODES[mode], args.timeout, port)
                print(layout, mode, size, {k: res.get(k) for k in ("tokens_per_s_per_gpu", "max_memory_gib")},
                      res.get("error", "")[-300:], flush=True)
                if not res["ok"]:
                    break  # OOM (or another failure, kept in the JSON of the last size that ran)
                best = dict(res, micro_batch_size=size)
            out["largest_micro_batch"][f"{layout}/{mode}"] = best or {"ok": False, "error": res.get("error")}
            with open(os.path.join(RESULTS, name), "w") as f:
                json.dump(out, f, indent=1)
            if os.environ.get("OUT"):
                shutil.copy(os.path.join(RESULTS, name), os.environ["OUT"])


if __name__ == "__main__":
    if os.environ.get("BENCH_PARALLEL_RESULT"):  # a rank started by run() through the launcher
        sys.path.insert(0, ROOT)
        worker(sys.argv[1:], os.environ["BENCH_PARALLEL_RESULT"])
    else:
        main()
