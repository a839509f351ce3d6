"""Tensor, pipeline and data parallelism on one host, BF16 vs COAT (--coat-fp8), through megacoat's trainer.

    # 2 GPUs, ~1.3 B model (24 layers, hidden 2048, FFN 5632, seq 2048), mock tokens:
    python benchmarks/bench_parallel.py --gpus 2
    # CPU smoke test of this script (tiny model, gloo, fp32):
    python benchmarks/bench_parallel.py --gpus 2 --tiny
    # and each layout/mode's largest micro-batch (same number of micro-batches per step as the base run):
    python benchmarks/bench_parallel.py --gpus 2 --search 8,12,16
    # 4 GPUs, ~7 B model (32 layers, hidden 4096, FFN 11008, seq 2048), 3-D layouts:
    python benchmarks/bench_parallel.py --gpus 4 --model 7b --layouts tp2pp2 tp2dp2 --micro-batch-size 1 \
        --global-batch-size 16 --search 2,4,8
    # loss curves on real text (the embedded default corpus), same seed, one PNG:
    python benchmarks/bench_parallel.py --gpus 4 --model 7b --layouts tp2pp2 --real-text --iters 200 \
        --micro-batch-size 1 --global-batch-size 8 --log-interval 5 --plot

Each layout x mode is a separate run of the trainer under DeepSpeed's launcher (one process per GPU), exactly
as pretrain_gpt.py trains, plus one all-gather at the end of every rank's torch.cuda.max_memory_allocated
(pretrain_gpt.py logs rank 0's only, and pipeline stages differ). A layout names the parallel sizes, e.g.
`tp2pp2` (TP=2 x PP=2) or `tp2dp2`; a bare `tp`, `pp` or `dp` puts all N GPUs on that one axis:
    tp  --tensor-model-parallel-size N --sequence-parallel   (ZeRO-1 over DP=1)
    pp  --pipeline-model-parallel-size N                     (ZeRO-1 over DP=1; DeepSpeed's 1F1B schedule)
    dp  data parallel over N, ZeRO-2
ZeRO-1 with a pipeline (DeepSpeed refuses ZeRO-2 there), ZeRO-2 otherwise when DP > 1, sequence parallelism
whenever TP > 1.
Same micro-batch and global batch in every run. tokens/s is the mean of the logged intervals after the first
(which holds warm-up and kernel compilation); TFLOP/s and MFU per GPU use the trainer's FLOP count (matmuls
only) against the GPU's BF16 dense peak, also for the FP8 runs. Ratios are within one invocation.
Writes benchmarks/results/bench_parallel[_<N>gpu][_tiny].json (and a copy into $OUT when set); with --plot, a PNG
of every run's training loss beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# The sibling script (this folder is on sys.path when run as `python benchmarks/bench_parallel.py`).
from bench_e2e import MODEL_1P3B, environment, failure, throughput  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

MODEL_TINY = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "64", "--vocab-size", "256"]
MODEL_7B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008", "--num-attention-heads", "32",
            "--seq-length", "2048", "--vocab-size", "32000"]
MODELS = {"tiny": MODEL_TINY, "1.3b": MODEL_1P3B, "7b": MODEL_7B}
# coat with the BF16 head in every layout, pinned: the FP8 head (--fp8-output-layer auto on one stage) runs without
# TP and PP only, so under auto the layouts would not run the same work
MODES = {"bf16": [], "coat": ["--coat-fp8", "--fp8-output-layer", "off"]}
_LAYOUT = re.compile(r"(?:(tp|pp|dp)(\d*))")


def layout_sizes(name: str, gpus: int) -> dict[str, int]:
    """{'tp': .., 'pp': .., 'dp': ..} for a layout name such as 'tp2pp2' or 'dp' (all GPUs on that axis)."""
    parts = _LAYOUT.findall(name)
    if not parts or "".join(a + n for a, n in parts) != name or len({a for a, _ in parts}) != len(parts):
        raise SystemExit(f"bad layout {name!r}: expected e.g. tp, pp, dp, tp2pp2, tp2dp2")
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    sizes.update({axis: int(n) if n else gpus for axis, n in parts})
    if math.prod(sizes.values()) != gpus:
        raise SystemExit(f"layout {name!r} is TP={sizes['tp']} x PP={sizes['pp']} x DP={sizes['dp']} = "
                         f"{math.prod(sizes.values())} GPUs, but --gpus is {gpus}")
    return sizes


def layout_flags(name: str, gpus: int) -> list[str]:
    sizes = layout_sizes(name, gpus)
    flags = ["--tensor-model-parallel-size", str(sizes["tp"]), "--pipeline-model-parallel-size", str(sizes["pp"])]
    if sizes["tp"] > 1:
        flags.append("--sequence-parallel")
    zero = 2 if sizes["dp"] > 1 and sizes["pp"] == 1 else 1
    return flags + ["--zero-stage", str(zero)]


def plot_losses(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in out["runs"].items():
        if res.get("ok") and res["losses"]:
            ax.plot(*zip(*res["losses"]), label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ranks = "GPUs" if "device" in out["environment"] else "CPU ranks"
    ax.set_title(f"{out['gpus']} {ranks}, {out['model_name']} model, {out['data']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
        if proc.returncode != 0 or not os.path.exists(result):
            return failure(proc.stdout[-6000:] + proc.stderr[-6000:], argv, keep=2500)
        train = [r for r in map(json.loads, open(log)) if "loss" in r]
        extra = json.load(open(result))
    speed = throughput(train)
    peaks = extra["max_memory_bytes_per_rank"]
    return {
        "ok": True, "argv": argv, "wall_s": wall, **{k: extra[k] for k in ("tp", "pp", "dp", "grad_accum")},
        **speed, "tokens_per_s_per_gpu": speed["tokens_per_s"] / gpus,
        "max_memory_gib_per_gpu": [b / 2**30 for b in peaks], "max_memory_gib": max(peaks) / 2**30,
        "losses": [(r["iteration"], r["loss"]) for r in train],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--model", choices=list(MODELS), default="1.3b")
    p.add_argument("--layouts", nargs="+", default=["dp", "tp", "pp"],
                   help="tp, pp, dp (all GPUs on one axis) or sizes such as tp2pp2, tp2dp2")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--log-interval", type=int, default=4)
    p.add_argument("--timeout", type=int, default=150, help="seconds per run")
    p.add_argument("--search", default="", help="comma-separated micro-batch sizes to try, ascending, until OOM")
    p.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU ranks: checks this script")
    p.add_argument("--real-text", action="store_true",
                   help="train on the embedded default corpus (its tokenizer and vocabulary) instead of mock tokens")
    p.add_argument("--plot", action="store_true", help="also write a PNG of every run's training loss")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/bench_parallel[_<N>gpu][_tiny].json)")
    args = p.parse_args()
    if args.tiny:
        args.model = "tiny"
    for name in args.layouts:
        layout_sizes(name, args.gpus)  # a bad layout stops here, before any run
    model = MODELS[args.model]
    data = ["--mock-data"]
    if args.real_text:
        sys.path.insert(0, ROOT)
        from megacoat.data.default_corpus import prepare_default_corpus

        corpus = prepare_default_corpus()  # built once here, not by every rank at once
        vocab = model.index("--vocab-size")
        model = model[:vocab] + model[vocab + 2:] + ["--vocab-size", "4096"]
        data = ["--data-path", corpus.data_prefix, "--tokenizer-model", corpus.tokenizer_model, "--split", "99,1,0"]
    common = model + ["--fp32" if args.model == "tiny" else "--bf16", *data, "--eval-iters", "0",
                      "--train-iters", str(args.iters), "--log-interval", str(args.log_interval)]
    if args.global_batch_size % args.micro_batch_size:
        raise SystemExit("--global-batch-size must be a multiple of --micro-batch-size")
    micro_batches = args.global_batch_size // args.micro_batch_size  # per step, over all DP ranks

    def batch(size: int) -> list[str]:
        return ["--micro-batch-size", str(size), "--global-batch-size", str(size * micro_batches)]

    suffix = ("" if args.gpus == 2 else f"_{args.gpus}gpu") + ("_tiny" if args.model == "tiny" else "")
    path = os.path.abspath(args.out or os.path.join(RESULTS, f"bench_parallel{suffix}.json"))
    out = {"environment": environment(), "gpus": args.gpus, "model_name": args.model, "model": " ".join(model),
           "data": "default corpus (real text)" if args.real_text else "mock tokens",
           "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
           "iters": args.iters, "precision": "fp32 (CPU smoke run)" if args.tiny else "bf16 (+FP8 for coat)",
           "runs": {}, "largest_micro_batch": {} if args.search else "not searched"}
    port = 29700
    for layout in args.layouts:
        for mode in args.modes:
            port += 1
            res = run(args.gpus, common + batch(args.micro_batch_size) + layout_flags(layout, args.gpus) + MODES[mode],
                      args.timeout, port)
            out["runs"][f"{layout}/{mode}"] = res
            print(layout, mode, {k: res.get(k) for k in ("tokens_per_s_per_gpu", "mfu", "max_memory_gib", "wall_s")},
                  res.get("error", "")[-800:], flush=True)
            base = out["runs"].get(f"{layout}/bf16", {})
            if mode != "bf16" and res["ok"] and base.get("ok"):
                res["speedup_vs_bf16"] = res["tokens_per_s"] / base["tokens_per_s"]
                res["memory_ratio_vs_bf16"] = res["max_memory_gib"] / base["max_memory_gib"]
            save(out, path)  # after every run: a cut-off call keeps the rest
    for layout in args.layouts if args.search else []:
        for mode in args.modes:
            best = None
            for size in (int(x) for x in args.search.split(",")):
                port += 1
                res = run(args.gpus, common + batch(size) + layout_flags(layout, args.gpus) + MODES[mode],
                          args.timeout, port)
                print(layout, mode, size, {k: res.get(k) for k in ("tokens_per_s_per_gpu", "max_memory_gib")},
                      res.get("error", "")[-300:], flush=True)
                if not res["ok"]:
                    break  # OOM (or another failure, kept in the JSON of the last size that ran)
                best = dict(res, micro_batch_size=size)
            out["largest_micro_batch"][f"{layout}/{mode}"] = best or {"ok": False, "error": res.get("error")}
            save(out, path)
    if args.plot:
        plot_losses(out, path.replace(".json", ".png"))
        if os.environ.get("OUT"):
            shutil.copy(path.replace(".json", ".png"), os.environ["OUT"])
    print("wrote", path)


def save(out: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    if os.environ.get("OUT"):
        shutil.copy(path, os.environ["OUT"])


if __name__ == "__main__":
    if os.environ.get("BENCH_PARALLEL_RESULT"):  # a rank started by run() through the launcher
        sys.path.insert(0, ROOT)
        worker(sys.argv[1:], os.environ["BENCH_PARALLEL_RESULT"])
    else:
        main()
