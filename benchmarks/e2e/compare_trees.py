"""The same recipe trained by two checkouts of megacoat, with compiled bf16 of this checkout as the common baseline:
the check that a change (a restructuring, a refactoring) kept the speed. Each run is its own process; repeats are
interleaved and each repeat reverses the order, so that a drift of the machine spreads over every mode.

    git worktree add /tmp/before <commit>
    python -m benchmarks.e2e.compare_trees --before /tmp/before --model 1.3b --micro-batch-size 8

A run's throughput is the tokens of its timed window (after --warmup iterations) over that window's time, from the
trainer's --log-json lines; a mode reports the median over its repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import RESULTS, ROOT, environment, write_json
from benchmarks.e2e.speed import cpu_check_flags, run_env
from benchmarks.suite import MODELS, RECIPES


def train(tree: str, flags: list[str], args, tag: str) -> dict:
    """One pretrain_gpt.py process of the checkout `tree`; its timed window's tokens/s and peak memory."""
    iters = args.warmup + args.iters
    env = run_env()
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    # each checkout builds its own kernels: a cache shared by two sources of one kernel name would mix them
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(args.cache, tag, "extensions")
    env["MEGACOAT_CACHE"] = os.path.join(args.cache, tag, "megacoat")
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, os.path.join(tree, "pretrain_gpt.py"), *MODELS[args.model], *flags, "--mock-data",
               "--eval-iters", "0", "--zero-stage", "1", "--micro-batch-size", str(args.micro_batch_size),
               "--global-batch-size", str(args.micro_batch_size), "--train-iters", str(iters),
               "--log-interval", str(args.log_interval), "--log-json", log]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, timeout=args.timeout)
        if proc.returncode != 0:
            return {"ok": False, "error": (proc.stdout + proc.stderr)[-2000:]}
        records = [json.loads(line) for line in open(log) if '"loss"' in line]
    timed = [r for r in records if r["iteration"] > args.warmup]
    seconds = sum(args.log_interval / r["tokens_per_s"] for r in timed)  # each record: the mean over its interval
    return {"ok": True, "tokens_per_s": len(timed) * args.log_interval / seconds,
            "max_memory_gib": max(r["max_memory_bytes"] for r in records) / 2**30, "final_loss": records[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the other checkout (a git worktree of the earlier commit)")
    p.add_argument("--recipe", choices=list(RECIPES), default="coat", help="the recipe both checkouts train")
    p.add_argument("--model", choices=list(MODELS), default="1.3b", help="tiny: an fp32 CPU check of this script")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=5, help="must divide --warmup and --iters")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "compare_trees"))
    p.add_argument("--out", default=os.path.join(RESULTS, "compare_trees.json"))
    args = p.parse_args(argv)
    if args.warmup % args.log_interval or args.iters % args.log_interval:
        p.error("--log-interval must divide --warmup and --iters")
    if not os.path.isfile(os.path.join(args.before, "pretrain_gpt.py")):
        p.error(f"--before {args.before}: no pretrain_gpt.py there")
    cpu = args.model == "tiny"
    bf16 = [] if cpu else ["--bf16"]
    flags = {name: cpu_check_flags(f) if cpu else f for name, (_, f) in RECIPES.items()}
    modes = {"bf16": (ROOT, bf16 + (flags["bf16"])), args.recipe: (ROOT, bf16 + flags[args.recipe]),
             f"{args.recipe}_before": (os.path.abspath(args.before), bf16 + flags[args.recipe])}
    result = {**environment(), "model": args.model, "micro_batch_size": args.micro_batch_size,
              "warmup": args.warmup, "iters": args.iters, "before": os.path.abspath(args.before),
              "modes": {m: f for m, (_, f) in modes.items()}, "runs": {m: [] for m in modes}}
    for rep in range(args.repeats):
        order = list(modes) if rep % 2 == 0 else list(reversed(modes))
        for mode in order:
            tree, mode_flags = modes[mode]
            run = train(tree, mode_flags, args, "before" if mode.endswith("_before") else "this")
            result["runs"][mode].append(run)
            print(mode, rep, {k: v for k, v in run.items() if k != "error"}, run.get("error", ""), flush=True)
            write_json(args.out, result)
    medians = {m: statistics.median(r["tokens_per_s"] for r in runs if r["ok"])
               for m, runs in result["runs"].items() if any(r["ok"] for r in runs)}
    result["summary"] = {m: {"median_tokens_per_s": t, "ratio_vs_bf16": t / medians["bf16"] if "bf16" in medians
                             else None} for m, t in medians.items()}
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    return 0 if len(medians) == len(modes) else 1


if __name__ == "__main__":
    sys.exit(main())
