"""Flag errors (issue 60, point 15) and --save checked before any work (point 13): one `error:` line that names
the flag, exit status 1, no usage block; no prefix matching of flags."""
import os
import subprocess
import sys

import pytest

from megacoat.arguments import parse_config
from tests.training.checkpoint_runs import PRETRAIN, ROOT, TINY, env


def _stderr_lines(text: str) -> list[str]:
    """Lines megacoat printed (DeepSpeed's accelerator notice at import is not megacoat's)."""
    return [line for line in text.splitlines() if line.strip() and "[real_accelerator.py" not in line]


@pytest.mark.parametrize("argv, line", [
    (["--num-layer", "3"], "error: unrecognized arguments: --num-layer 3"),
    (["--train-iter", "5"], "error: unrecognized arguments: --train-iter 5"),
    (["--lr-decay-style", "exp"], "error: argument --lr-decay-style: invalid choice: 'exp'"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     "error: --global-batch-size (10) must be divisible by --micro-batch-size (4)"),
    (["--distributed-timeout-minutes", "0"], "error: --distributed-timeout-minutes must be positive, got 0.0"),
])
def test_a_flag_error_is_one_line_and_exit_status_1(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(line), err  # the line, not argparse's usage block before it


def test_no_prefix_matching():
    """`--num-layer 3` once trained 3 layers (argparse took it for --num-layers)."""
    with pytest.raises(SystemExit):
        parse_config(["--num-layer", "3"])
    assert parse_config(["--num-layers", "3"]).model.num_layers == 3


def test_distributed_timeout_flag():
    assert parse_config([]).training.distributed_timeout_minutes == 10
    assert parse_config(["--distributed-timeout-minutes", "0.5"]).training.distributed_timeout_minutes == 0.5


def test_pretrain_gpt_flag_error_from_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, PRETRAIN, "--num-layer", "3"], cwd=tmp_path, env=env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert _stderr_lines(proc.stderr) == ["error: unrecognized arguments: --num-layer 3"], proc.stderr
    assert "usage:" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_flag_error_under_deepspeed_with_two_ranks(tmp_path):
    """Both ranks fail on the flag; the first rank of the node prints the one line."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29651", PRETRAIN,
           "--num-layer", "3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert [line for line in out.splitlines() if "error:" in line] == \
        ["error: unrecognized arguments: --num-layer 3"], out
    assert "usage:" not in out and "Traceback" not in out


@pytest.mark.parametrize("save, message", [
    ("/proc/megacoat-ckpt", "--save /proc/megacoat-ckpt: under /proc, a pseudo file system"),
    ("FILE", "--save FILE: is a file, not a directory"),
    ("FILE/sub", "--save FILE/sub: cannot write checkpoints there"),
])
def test_save_is_checked_before_the_model_is_built(tmp_path, save, message):
    (tmp_path / "FILE").write_text("not a directory")
    proc = subprocess.run([sys.executable, PRETRAIN] + TINY + ["--train-iters", "1", "--save", save],
                          cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = _stderr_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: " + message), proc.stderr
    assert "megacoat run:" not in proc.stdout  # stopped before the banner, the model and any training
    assert (tmp_path / "FILE").read_text() == "not a directory"


def test_a_writable_save_directory_passes_and_is_created(tmp_path):
    sys.path.insert(0, ROOT)
    from pretrain_gpt import check_save_dir

    target = tmp_path / "a" / "b"
    check_save_dir(str(target))
    assert target.is_dir() and os.listdir(target) == []  # the probe file is gone
    check_save_dir(None)
