"""benchmarks/fidelity/head_precision_eval.py on the CPU: a tiny checkpoint evaluated with its head in FP8 and in BF16, and
bad input."""
import dataclasses
import json
import os

import torch

from tests.benchmarks.conftest import run_module
from megacoat.checkpoint.layout_free import write_layout_free
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT

SCRIPT = "benchmarks.fidelity.head_precision_eval"


def _checkpoint(tmp_path) -> str:
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=400,
                      seq_length=32)
    torch.manual_seed(0)
    weights = GPT(cfg).state_dict()
    meta = {"iteration": 0, "megacoat_config": {"model": dataclasses.asdict(cfg), "fp8": {"group_size": 32}}}
    return write_layout_free(str(tmp_path / "ckpt" / "iter_0000000"), meta, weights, tied=cfg.tie_embeddings)


def test_the_three_heads_on_one_checkpoint(tiny_data, tmp_path):
    out = str(tmp_path / "eval.json")
    proc = run_module(SCRIPT, "--checkpoint", _checkpoint(tmp_path), "--data", tiny_data, "--samples", "4",
                      "--batch-size", "2", "--out", out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["kind"] == "head_precision_eval" and res["environment"]["device"] == "cpu"
    assert set(res["batch_losses"]) == {"bf16", "coat, head in bf16", "coat, head in fp8"}
    assert all(len(v) == 2 and all(torch.isfinite(torch.tensor(v))) for v in res["batch_losses"].values())
    # the untrained model's loss is near ln(400); FP8 moves it by its rounding, far less than the loss itself
    for loss in res["mean_loss"].values():
        assert abs(loss - torch.log(torch.tensor(400.0)).item()) < 0.5
    gap = res["gaps_pct"]["head fp8 vs head bf16"]
    assert gap["seeds"] == [0, 1] and len(gap["ci95_pct"]) == 2 and abs(gap["mean_pct"]) < 5
    assert "head fp8 vs head bf16" in proc.stdout


def test_bad_input_is_one_line(tmp_path):
    proc = run_module(SCRIPT, "--checkpoint", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "x"))
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: --data") and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "x")
