"""The run summary's FP8 row (megacoat.training.fp8_report): its figures on a tiny COAT run, and each figure
against what it claims to measure."""
import re

import torch

from megacoat.coat.adamw import CoatAdamW
from megacoat.training.fp8_report import optimizer_state_bytes, saved_bytes
from tests.training.test_pretrain_gpt import run

COAT_TINY = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "4", "--global-batch-size", "8",
             "--log-interval", "1", "--eval-iters", "1", "--mock-data", "--train-iters", "2", "--coat-fp8"]


def test_a_coat_run_ends_with_what_fp8_saved(tmp_path):
    proc, train, _ = run(tmp_path, COAT_TINY)
    row = [line for line in proc.stdout.splitlines() if line.startswith("  FP8: optimizer states")]
    assert len(row) == 1, proc.stdout[-2000:]
    nums = re.search(r"optimizer states ([\d.]+) MiB against AdamW's ([\d.]+) MiB \(([\d.]+)x\); activations saved "
                     r"for backward ([\d.]+) MiB against ([\d.]+) MiB in float32 \(([\d.]+)x; one micro-batch "
                     r"through layer 1, times 2 layers\); final loss ([\d.]+)$", row[0])
    assert nums, row[0]
    coat, adamw, opt_ratio, act, plain, act_ratio, loss = map(float, nums.groups())
    # E4M3 m and v (1 byte each) plus a float32 scale and a bf16 exponent per 128 values, against 2 x 4 bytes
    assert abs(opt_ratio - (2 + 2 * 6 / 128) / 8) < 0.01 and abs(coat / adamw - opt_ratio) < 0.01
    assert 0 < act < plain and act_ratio < 0.5
    assert loss == round(train[-1]["loss"], 4)


def test_a_plain_run_has_no_fp8_row(tmp_path):
    proc, _, _ = run(tmp_path, [a for a in COAT_TINY if a != "--coat-fp8"])
    summary = proc.stdout.split("megacoat run done:")[1]
    assert "final loss" in summary and "  FP8:" not in summary


def test_optimizer_state_bytes_counts_the_moments_only():
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(64, 2))]
    opt = CoatAdamW(params, group_size=128)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    coat, adamw = optimizer_state_bytes(opt)
    groups = 3 + 1  # ceil(300 / 128) + ceil(128 / 128)
    assert adamw == 8 * 428 and coat == 2 * (428 + groups * (4 + 2))


def test_saved_bytes_counts_each_activation_storage_once_and_no_parameter():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    n = saved_bytes(lambda: (torch.tanh(x @ w) * x).sum(), [w])
    # x (saved by the matmul and by the product: once) and tanh's output (by tanh and the product); w left out
    assert n == 2 * 4 * 16 * 4
