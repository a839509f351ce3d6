"""Exact resume: N iterations in one run vs N/2, exit, resume from the checkpoint → the same JSON loss
sequence, bit for bit (CPU, fp32: the data loader resumes at consumed_samples, DeepSpeed restores weights,
optimizer and LR schedule, megacoat restores every rank's RNG states)."""
import json
import os

import pytest
import torch

from tests.training.checkpoint_runs import losses, run, same_sequence

ITERS = 8


def _interrupted_then_resumed(tmp_path, argv, ranks=1, port=29600):
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "resumed.json"
    first = run(tmp_path, argv + ["--save", str(ckpt), "--exit-interval", str(ITERS // 2)], log, ranks, port)
    assert f"exiting at iteration {ITERS // 2}" in first.stdout
    assert (ckpt / "latest").read_text() == f"iter_{ITERS // 2:07d}"
    second = run(tmp_path, argv + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
                                   "--keep-last", "2"], log, ranks, port)
    assert f"resumed from {ckpt / f'iter_{ITERS // 2:07d}'}" in second.stdout
    return ckpt, log


# AdamW resumes are covered by the ZeRO-2 test below (slow); here CoatAdamW (FP8 moments, per-group scales
# and expansion exponents in the optimizer state) on plain data parallelism, and with the full COAT flow and
# delayed scaling of SwiGLU's gradient and of the norms' and SwiGLU's outputs (the amax histories are model state:
# without them the resumed forward and backward would differ).
@pytest.mark.parametrize("flags", [["--fp8-optimizer"],
                                   ["--coat-fp8", "--fp8-grad-scaling", "delayed", "--fp8-activation-scaling",
                                    "delayed", "--fp8-amax-history-len", "5"]],
                         ids=["fp8-optimizer", "coat-delayed"])
def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, flags):
    argv = ["--train-iters", str(ITERS), "--zero-stage", "0", "--fp32", *flags]
    run(tmp_path, argv, tmp_path / "full.json")
    ckpt, log = _interrupted_then_resumed(tmp_path, argv)
    full, resumed = losses(tmp_path / "full.json"), losses(log)
    assert [i for i, _ in full] == list(range(1, ITERS + 1))
    assert same_sequence(full, resumed), (full, resumed)
    # --keep-last 2 with --save-interval 2: iterations 6 and 8 remain, 4 was pruned, no temporary left.
    assert sorted(os.listdir(ckpt)) == ["iter_0000006", "iter_0000008", "latest"]
    meta = json.loads((ckpt / "iter_0000008" / "megacoat.json").read_text())
    assert meta["iteration"] == ITERS and meta["consumed_samples"] == ITERS * 8
    assert meta["layout"]["fp8_optimizer"] is True
    rng = torch.load(ckpt / "iter_0000008" / "rng_rank00000.pt", weights_only=False)
    assert set(rng) >= {"python", "numpy", "torch"}
    # DeepSpeed wrote into .tmp-iter_0000008 and megacoat renamed it: no file may name the temporary tag.
    for name in os.listdir(ckpt / "iter_0000008"):
        assert b".tmp-iter" not in (ckpt / "iter_0000008" / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout", [(2, []), (4, ["--tensor-model-parallel-size", "2"])], ids=["dp2", "tp2-dp2"])
def test_default_delayed_scaling_resumes_data_parallel_ranks_bitwise(tmp_path, ranks, layout):
    """--coat-fp8's default (delayed scaling at both sites) on 2 data-parallel replicas (of one rank, or of a TP=2
    pair): each replica records the amaxes of its own micro-batches, and the step's all-reduce over the
    data-parallel group keeps the replicas' histories the same. Without it the checkpoint (written by data-parallel
    rank 0) would resume the other replica with histories it never had, and the resumed losses would differ."""
    argv = ["--train-iters", str(ITERS), "--zero-stage", "1", "--fp32", "--coat-fp8", "--fp8-amax-history-len", "5",
            *layout]
    first = run(tmp_path, argv, tmp_path / "full.json", ranks=ranks, port=29613)
    assert "with delayed scaling" in first.stdout
    _, log = _interrupted_then_resumed(tmp_path, argv, ranks=ranks, port=29614)
    full, resumed = losses(tmp_path / "full.json"), losses(log)
    assert same_sequence(full, resumed), (full, resumed)


@pytest.mark.slow
def test_zero2_two_ranks_resume_bitwise_and_another_dp_size_converts(tmp_path):
    argv = ["--train-iters", str(ITERS), "--zero-stage", "2", "--fp32"]
    run(tmp_path, argv, tmp_path / "full.json", ranks=2, port=29611)
    ckpt, log = _interrupted_then_resumed(tmp_path, argv, ranks=2, port=29612)
    assert same_sequence(losses(tmp_path / "full.json"), losses(log))
    assert sorted(n for n in os.listdir(ckpt / "iter_0000008") if n.startswith("rng_rank")) == \
        ["rng_rank00000.pt", "rng_rank00001.pt"]
    # ZeRO-2 partitions the optimizer over 2 data-parallel ranks: one rank takes it through the layout-free form
    # (tests/training/test_checkpoint_reshard.py checks the losses that follow).
    proc = run(tmp_path, argv + ["--load", str(ckpt), "--train-iters", str(ITERS + 1)], tmp_path / "one.json")
    assert "checkpoint layout changed: data_parallel_size 2 -> 1" in proc.stdout


def test_sigkill_at_any_moment_leaves_a_loadable_latest(tmp_path):
    """Saving every iteration, the run is SIGKILLed as soon as DeepSpeed's model file of the 5th save appears
    in its temporary directory (mid-save, before the rename): `latest` names a complete checkpoint, the dead temporary is ignored and later removed,
    and the resumed run finishes with a log that counts every iteration once."""
    import signal
    import subprocess
    import time

    from tests.training.checkpoint_runs import command, env

    ckpt = tmp_path / "ckpt"
    argv = ["--train-iters", "30", "--zero-stage", "0", "--fp32", "--save", str(ckpt), "--save-interval", "1"]
    log = tmp_path / "log.json"
    proc = subprocess.Popen(command(argv, log), cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    partial = ckpt / ".tmp-iter_0000005" / "mp_rank_00_model_states.pt"
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    tag = (ckpt / "latest").read_text()
    assert tag in ("iter_0000004", "iter_0000005") and (ckpt / tag / "megacoat.json").is_file()
    second = run(tmp_path, argv + ["--load", str(ckpt)], log)
    assert f"resumed from {ckpt / tag}" in second.stdout
    assert [i for i, _ in losses(log)] == list(range(1, 31))
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]


def test_load_takes_the_save_directory_or_one_iteration(tmp_path):
    """`--load DIR` resumes from the checkpoint DIR/latest names, `--load DIR/iter_0000004` from iteration 4
    (DeepSpeed's tag); both continue with the uninterrupted run's losses, bit for bit. The first run of a job
    whose --load is its own --save directory starts from scratch and says so in one line."""
    argv = ["--train-iters", str(ITERS), "--zero-stage", "0", "--fp32"]
    run(tmp_path, argv, tmp_path / "full.json")
    full = losses(tmp_path / "full.json")
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, argv + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
                                  "--exit-interval", "6"], tmp_path / "first.json")
    assert f"--load {ckpt}: no checkpoint yet in this --save directory, starting from scratch" in first.stdout
    assert same_sequence(losses(tmp_path / "first.json"), full[:6])
    assert (ckpt / "latest").read_text() == "iter_0000006"
    for load, start in ((ckpt, 6), (ckpt / "iter_0000004", 4)):
        log = tmp_path / f"from_{start}.json"
        proc = run(tmp_path, argv + ["--load", str(load)], log)
        assert f"resumed from {ckpt / f'iter_{start:07d}'} at iteration {start}" in proc.stdout
        assert same_sequence(losses(log), full[start:]), (start, losses(log), full)
