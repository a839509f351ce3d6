"""Launching tiny pretrain_gpt.py runs for the checkpoint, preemption and stability tests (CPU, fp32)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--mock-data"]


def env(tmp_path, **extra) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             MEGACOAT_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    e.update(extra)  # a caller's MEGACOAT_CACHE (say) replaces the default
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in extra:
            e.pop(key, None)
    return e


def launcher(ranks: int, port: int) -> list[str]:
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(port)]


def command(argv, log, ranks=1, port=29600, script=(PRETRAIN,)) -> list[str]:
    """`script`: the program and its own leading arguments (pretrain_gpt.py, or a test wrapper around it)."""
    return launcher(ranks, port) + list(script) + TINY + list(argv) + ["--log-json", str(log)]


def run(tmp_path, argv, log, ranks=1, port=29600, check=True, script=(PRETRAIN,),
        **extra_env) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(argv, log, ranks, port, script), cwd=tmp_path, env=env(tmp_path, **extra_env),
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def records(log) -> list[dict]:
    return [json.loads(line) for line in open(log).read().splitlines()]


def losses(log) -> list[tuple[int, float]]:
    """(iteration, loss) of every logged step; NaN kept as NaN."""
    return [(r["iteration"], r["loss"]) for r in records(log) if "loss" in r]


def same_sequence(a, b) -> bool:
    """Bitwise equality of two loss sequences (NaN equal to NaN)."""
    return len(a) == len(b) and all(i == j and (x == y or (math.isnan(x) and math.isnan(y)))
                                    for (i, x), (j, y) in zip(a, b))
