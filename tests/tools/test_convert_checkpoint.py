"""tools/convert_checkpoint.py: a DeepSpeed checkpoint -> layout-free -> DeepSpeed files of another layout (CPU
ranks) -> layout-free again gives the same tensors bit for bit (AdamW, fp32: nothing is re-quantized), and the
run's record (iteration, data position, LR schedule, config) travels with them."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.tools.conftest import TOOLS, load_tool
from tests.training.checkpoint_runs import env, losses, run, same_sequence


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("src")
    run(tmp, ["--train-iters", "3", "--fp32", "--zero-stage", "1", "--save", str(tmp / "ckpt")], tmp / "log.json")
    return tmp / "ckpt"


def test_to_layout_free_keeps_the_record(saved, tmp_path):
    tool = load_tool("convert_checkpoint")
    assert tool.main(["--load", str(saved), "--output", str(tmp_path / "free")]) == 0
    tag = tmp_path / "free" / "iter_0000003"
    assert (tmp_path / "free" / "latest").read_text() == "iter_0000003"
    meta, src = (json.loads((d / "megacoat.json").read_text()) for d in (tag, saved / "iter_0000003"))
    assert meta["format"] == "layout-free" and meta["optimizer"]["kind"] == "adamw" and meta["optimizer"]["step"] == 3
    assert meta["lr_scheduler"]["num_steps"] == 3
    for k in ("iteration", "consumed_samples", "megacoat_config", "layout", "tokenizer"):
        assert meta[k] == src[k], k
    weights = load_file(tag / "model.safetensors")
    module = torch.load(saved / "iter_0000003" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert set(weights) == set(module) - {"output.weight"}  # tied head stored once
    assert all(torch.equal(weights[k], module[k]) for k in weights)


@pytest.mark.slow
def test_back_to_another_layout_and_again_is_exact(saved, tmp_path):
    tool = load_tool("convert_checkpoint")
    assert tool.main(["--load", str(saved), "--output", str(tmp_path / "a")]) == 0
    proc = subprocess.run([sys.executable, f"{TOOLS}/convert_checkpoint.py", "--load", str(tmp_path / "a"), "--output",
                           str(tmp_path / "dp2"), "--data-parallel-size", "2", "--zero-stage", "2"],
                          env=env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tag = tmp_path / "dp2" / "iter_0000003"
    assert (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    meta = json.loads((tag / "megacoat.json").read_text())
    assert meta["layout"]["data_parallel_size"] == 2 and meta["consumed_samples"] == 24
    assert tool.main(["--load", str(tmp_path / "dp2"), "--output", str(tmp_path / "b")]) == 0
    for name in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
        a, b = (load_file(tmp_path / d / "iter_0000003" / f"{name}.safetensors") for d in ("a", "b"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    back = json.loads((tmp_path / "b" / "iter_0000003" / "megacoat.json").read_text())
    assert back["optimizer"]["step"] == 3 and back["lr_scheduler"]["num_steps"] == 3


def test_bad_input_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, f"{TOOLS}/convert_checkpoint.py", "--load", str(tmp_path / "none"),
                           "--output", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'none'}: not a megacoat checkpoint (no " \
                                                   "megacoat.json, no 'latest' naming one)"
    proc = subprocess.run([sys.executable, f"{TOOLS}/convert_checkpoint.py", "--load", str(tmp_path), "--output",
                           str(tmp_path / "o"), "--tensor-model-parallel-size", "0"], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip() == "error: --tensor-model-parallel-size must be >= 1, got 0"


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [[], ["--fp8-optimizer"]], ids=["adamw", "coat"])
def test_resuming_from_the_layout_free_form_on_the_same_layout_is_exact(tmp_path, optimizer):
    """Same layout, so the same CoatAdamW groups: weights, dequantized-and-requantized moments, step, LR schedule
    and data position come back exactly, and the resumed losses equal the uninterrupted run's bit for bit."""
    argv = ["--train-iters", "6", "--fp32", "--zero-stage", "1"] + optimizer
    run(tmp_path, argv, tmp_path / "full.json")
    run(tmp_path, argv + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "3"], tmp_path / "log.json")
    assert load_tool("convert_checkpoint").main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "free")]) == 0
    proc = run(tmp_path, argv + ["--load", str(tmp_path / "free")], tmp_path / "log.json")
    assert f"resumed from {tmp_path / 'free' / 'iter_0000003'} at iteration 3" in proc.stdout
    assert same_sequence(losses(tmp_path / "full.json"), losses(tmp_path / "log.json"))
