"""--main-params-dtype bf16-remainder and --main-grads-dtype through pretrain_gpt.py as users run it (CPU: bf16 on
gloo, the tiny model of checkpoint_runs.py with CoatAdamW).

What "the same as the fp32 master" means here: CoatAdamW updates the exact fp32 master either way (bit for bit,
tests/optim/test_coat_adamw.py and tests/ops/test_coat_adamw_remainder.py); what differs end to end is the bf16
copy of it the model computes with. DeepSpeed's fp32-master path rounds ties to even, the remainder format ties
away from zero (no 16-bit remainder can encode ties-to-even exactly, megacoat/ops/param_remainder.py): one bf16
weight in ~2^17 per step lands one bf16 ulp apart, so the two runs' losses drift apart by ~1e-5 relative over a few
steps (measured <= 3.4e-5 over 20 steps) instead of agreeing bit for bit.
"""
import shutil
import subprocess
import sys

import pytest

from tests.training.checkpoint_runs import ROOT, env, losses, run, same_sequence

ITERS = 8
COAT_BF16 = ["--fp8-optimizer", "--bf16", "--train-iters", str(ITERS)]
REMAINDER = COAT_BF16 + ["--main-params-dtype", "bf16-remainder"]
FP32_MASTER = COAT_BF16 + ["--main-params-dtype", "fp32"]


@pytest.fixture(scope="module")
def zero2_runs(tmp_path_factory):
    """2 ranks, ZeRO-2: bf16-remainder (checkpoint at 4 and 8) and the fp32 master (checkpoint at 8)."""
    tmp = tmp_path_factory.mktemp("main_params")
    run(tmp, REMAINDER + ["--zero-stage", "2", "--save", str(tmp / "rem"), "--save-interval", "4"], tmp / "rem.json",
        ranks=2, port=29641)
    run(tmp, FP32_MASTER + ["--zero-stage", "2", "--save", str(tmp / "fp32")], tmp / "fp32.json", ranks=2,
        port=29642)
    return tmp


@pytest.mark.slow
def test_bf16_remainder_zero2_tracks_the_fp32_master(zero2_runs):
    rem, fp32 = losses(zero2_runs / "rem.json"), losses(zero2_runs / "fp32.json")
    assert [i for i, _ in rem] == [i for i, _ in fp32] == list(range(1, ITERS + 1))
    assert rem[0] == fp32[0]  # no step yet: the same bf16 weights
    for (it, a), (_, b) in zip(rem, fp32):
        assert a == pytest.approx(b, rel=2e-4), (it, a, b)  # ties only (module docstring): ~1e-5


@pytest.mark.slow
def test_bf16_remainder_zero2_resume_is_bitwise(zero2_runs):
    """The remainders are CoatAdamW state in each rank's ZeRO partition; the bf16 master is the model's slice."""
    tmp = zero2_runs
    at4 = tmp / "rem_at_4"
    shutil.copytree(tmp / "rem" / "iter_0000004", at4 / "iter_0000004")
    (at4 / "latest").write_text("iter_0000004")
    run(tmp, REMAINDER + ["--zero-stage", "2", "--load", str(at4)], tmp / "resumed.json", ranks=2, port=29643)
    full = losses(tmp / "rem.json")
    assert same_sequence([r for r in full if r[0] > 4], losses(tmp / "resumed.json"))


@pytest.mark.slow
def test_loading_another_main_params_dtype_is_a_clear_error(zero2_runs):
    proc = run(zero2_runs, REMAINDER + ["--zero-stage", "2", "--load", str(zero2_runs / "fp32")],
               zero2_runs / "bad.json", ranks=2, port=29644, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: --load" in out and "main_params_dtype: saved fp32, now bf16-remainder" in out, out[-3000:]
    assert "Traceback" not in out


@pytest.mark.slow
def test_without_the_flag_a_resumed_run_keeps_the_checkpoints_master(zero2_runs):
    """The remainders are the default (bf16, CoatAdamW, ZeRO-1/2); a checkpoint saved with the fp32 master resumes
    without --main-params-dtype, keeping its fp32 master, and a new run of the same flags gets the remainders."""
    argv = COAT_BF16[:-1] + [str(ITERS + 1), "--zero-stage", "2"]
    proc = run(zero2_runs, argv + ["--load", str(zero2_runs / "fp32")], zero2_runs / "kept.json", ranks=2,
               port=29645)
    assert "resumed from" in proc.stdout and "fp32 master weights in the optimizer" in proc.stdout, proc.stdout[-2000:]
    fresh = run(zero2_runs, argv, zero2_runs / "fresh.json", ranks=2, port=29646)
    assert "CoatAdamW's 16-bit remainders" in fresh.stdout


@pytest.mark.slow
def test_fp32_main_grads_zero1_resume_is_bitwise(tmp_path):
    """--main-grads-dtype fp32 under ZeRO-1 runs DeepSpeed's BF16_Optimizer (fp32 gradient buffer, fp32 master):
    interrupted at iteration 4 and resumed, it reproduces the uninterrupted run bit for bit."""
    argv = COAT_BF16 + ["--zero-stage", "1", "--main-grads-dtype", "fp32"]
    run(tmp_path, argv, tmp_path / "full.json")
    ckpt, log = tmp_path / "ckpt", tmp_path / "resumed.json"
    run(tmp_path, argv + ["--save", str(ckpt), "--exit-interval", "4"], log)
    second = run(tmp_path, argv + ["--save", str(ckpt), "--load", str(ckpt)], log)
    assert "resumed from" in second.stdout
    assert same_sequence(losses(tmp_path / "full.json"), losses(log))


SHARE_SCRIPT = r"""
import os, sys, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
from megacoat.coat.adamw import CoatAdamW
from megacoat.training.deepspeed_patches import share_master_partitions
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.GELU(), torch.nn.Linear(200, 8))
cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
       "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
       "zero_optimization": {"stage": int(sys.argv[1])}, "zero_allow_untested_optimizer": True}
opt = CoatAdamW(model.parameters(), lr=1e-2, param_remainders=True)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
zo = engine.optimizer
if sys.argv[3] == "share":
    assert share_master_partitions(zo) == sum(p.numel() * 2 for p in model.parameters())
    assert zo.single_partition_of_fp32_groups[0].data_ptr() == zo.parallel_partitioned_bit16_groups[0][0].data_ptr()
    assert share_master_partitions(zo) == 0  # idempotent
x = torch.randn(2, 64).bfloat16()
for _ in range(6):
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
print("RESULT", [p.detach().float().sum().item() for p in model.parameters()], loss.item())
torch.distributed.destroy_process_group()  # gloo's threads stopped before exit, as the trainer does
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_shared_master_partition_gives_the_same_result(tmp_path, stage):
    """share_master_partitions frees DeepSpeed's bf16 clone and changes nothing else: same weights bit for bit."""
    out = {}
    for i, mode in enumerate(("share", "clone")):
        proc = subprocess.run([sys.executable, "-c", SHARE_SCRIPT, str(stage), str(29651 + 2 * stage + i), mode],
                              cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[mode] = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert out["share"] == out["clone"] and out["share"]


def test_flag_errors_are_one_line(tmp_path):
    for argv, msg in ((["--main-params-dtype", "bf16-remainder"], "add --fp8-optimizer"),
                      (["--fp8-optimizer", "--main-params-dtype", "bf16-remainder", "--zero-stage", "0"],
                       "needs --zero-stage 1 or 2"),
                      (["--fp32", "--main-grads-dtype", "bf16"], "drop --fp32"),
                      (["--fp8-optimizer", "--main-params-dtype", "bf16-remainder", "--main-grads-dtype", "fp32"],
                       "needs --main-grads-dtype bf16")):
        proc = subprocess.run([sys.executable, f"{ROOT}/pretrain_gpt.py", *argv], cwd=tmp_path, env=env(tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and msg in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# The accumulation rule is tested on a model of the default model's structure (Llama blocks, tied embedding, the
# default corpus and its 4096-token vocabulary) but 2 layers of width 64 and 32-token sequences: bf16 matmuls on two
# CPU cores run the default model at ~50 tokens/s, 200 steps of it would take hours.
ACCUMULATION_RUN = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads",
                    "4", "--seq-length", "32", "--vocab-size", "4096", "--micro-batch-size", "4",
                    "--global-batch-size", "16", "--lr", "3e-3", "--lr-warmup-iters", "10", "--log-interval", "1",
                    "--eval-iters", "0", "--fp8-optimizer", "--bf16", "--zero-stage", "1", "--train-iters", "200",
                    "--main-params-dtype", "fp32"]  # the one master both gradient dtypes run with


@pytest.mark.slow
def test_bf16_gradient_accumulation_tracks_fp32_accumulation(tmp_path):
    """200 steps, gradient accumulation 4, CoatAdamW: bf16 main gradients (each micro-batch's bf16 gradient added
    to a bf16 sum: 3 roundings of at most 2^-9 relative each, then a bf16 reduction) against fp32 accumulation and
    reduction. The per-step gradient error (<~1e-2 relative) is far below the mini-batch noise the optimizer already
    averages (Adam normalises by sqrt(v)), so the loss curves agree to run-to-run noise: the mean loss of the last
    20 steps within 1% (measured on two CPU cores: 0.16%, the largest single-step gap 0.64%; the loss falls from
    8.33 to 5.6)."""
    import json
    import os

    from tests.training.checkpoint_runs import PRETRAIN

    curves = {}
    for dtype in ("fp32", "bf16"):
        log = tmp_path / f"{dtype}.json"
        proc = subprocess.run([sys.executable, PRETRAIN, *ACCUMULATION_RUN, "--main-grads-dtype", dtype,
                               "--log-json", str(log)], cwd=tmp_path, capture_output=True, text=True, timeout=3000,
                              env=env(tmp_path, MEGACOAT_CACHE=os.environ.get("MEGACOAT_CACHE",
                                                                              str(tmp_path / "cache"))))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        curves[dtype] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    fp32, bf16 = (sum(c[-20:]) / 20 for c in (curves["fp32"], curves["bf16"]))
    assert len(curves["fp32"]) == len(curves["bf16"]) == 200
    assert fp32 < 0.8 * curves["fp32"][0]  # it trains
    assert abs(bf16 - fp32) <= 0.01 * fp32, (fp32, bf16)
