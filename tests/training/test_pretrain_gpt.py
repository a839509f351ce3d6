"""End-to-end runs of pretrain_gpt.py as users launch it: plain python (one rank) and the deepspeed launcher
(two CPU ranks, gloo)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1"]
JSON_KEYS = {"iteration", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "max_memory_bytes"}


def _env(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MEGACOAT_CACHE=os.environ.get("MEGACOAT_CACHE", str(tmp_path / "cache")), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return env


def run(tmp_path, argv, launcher=None, name="log.json"):
    log = tmp_path / name
    cmd = (launcher or [sys.executable]) + [os.path.join(ROOT, "pretrain_gpt.py")] + argv + ["--log-json", str(log)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return proc, [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def test_log_json_has_the_documented_keys_and_loss_falls(tmp_path):
    proc, train, val = run(tmp_path, TINY + ["--mock-data", "--train-iters", "10", "--zero-stage", "0"])
    assert [r["iteration"] for r in train] == list(range(1, 11))
    for r in train:
        assert JSON_KEYS <= set(r), set(r)
        assert r["mfu"] is None  # CPU: no peak to compare with
        assert r["tokens_per_s"] > 0 and r["max_memory_bytes"] > 0 and r["grad_norm"] > 0
    assert [r["iteration"] for r in val] == [5, 10]
    assert "iter     10/10" in proc.stdout and "validation loss" in proc.stdout


def test_coat_by_default_trains_its_head_in_fp8_as_the_bf16_head_does(tmp_path):
    """--coat-fp8 (ZeRO-1) trains the tied head in FP8 by default (--fp8-output-layer auto): the banner says so, and
    each logged loss stays within issue 6's 2e-2 of the same run with the head in BF16 (--fp8-output-layer off)."""
    argv = TINY + ["--mock-data", "--train-iters", "10", "--zero-stage", "1", "--coat-fp8", "--eval-iters", "0"]
    base_proc, base, _ = run(tmp_path, argv + ["--fp8-output-layer", "off"], name="bf16_head.json")
    proc, head, _ = run(tmp_path, argv, name="fp8_head.json")
    assert "the output layer in FP8 too (--fp8-output-layer)" in proc.stdout
    assert "the output layer in high precision (--fp8-output-layer off)" in base_proc.stdout
    assert [r["iteration"] for r in head] == [r["iteration"] for r in base] == list(range(1, 11))
    for a, b in zip(head, base):
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * b["loss"], (a["iteration"], a["loss"], b["loss"])
    assert [r["loss"] for r in head] != [r["loss"] for r in base]  # the head did run in FP8: its rounding shows


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_two_ranks_match_one_rank(tmp_path, zero_stage):
    """Same global batch: 1 rank x 2 micro-batches vs 2 ranks x 1 micro-batch (ZeRO partitions the optimizer
    over the 2 ranks). fp32 on CPU, so the only difference is the order of the gradient sums: the loss curves
    agree far inside bf16's 2^-8 relative step; we require 1e-4 relative."""
    argv = TINY + ["--mock-data", "--train-iters", "8", "--zero-stage", str(zero_stage), "--eval-iters", "0"]
    _, one, _ = run(tmp_path, argv, name="one.json")
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                "--master_port", str(29500 + zero_stage)]
    proc, two, _ = run(tmp_path, argv, launcher=launcher, name="two.json")
    assert "world size 2" in proc.stdout
    assert "untested optimizer" not in proc.stdout + proc.stderr  # megacoat's optimizers are tested under ZeRO
    assert len(one) == len(two) == 8
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]


def test_missing_data_path_is_named_before_any_work(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--data-path", str(tmp_path / "nope")]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert str(tmp_path / "nope") in proc.stderr and "does not exist" in proc.stderr
    assert "model:" not in proc.stdout


LEAVES_GROUP = """
import sys
import torch.distributed as dist
import pretrain_gpt
pretrain_gpt.main(sys.argv[1:])
print("process group after main:", "initialized" if dist.is_initialized() else "destroyed")
"""


def test_main_leaves_the_process_group_before_exit(tmp_path):
    """A run that ended normally destroys its process group itself: left to interpreter exit, a rank of a
    2-rank gloo run aborted after its last iteration (status -6) once in CI."""
    argv = TINY + ["--mock-data", "--train-iters", "2", "--zero-stage", "0", "--eval-iters", "0",
                   "--log-json", str(tmp_path / "log.json")]
    proc = subprocess.run([sys.executable, "-c", LEAVES_GROUP] + argv, cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "process group after main: destroyed" in proc.stdout
