"""tools/convert_from_hf.py: a tiny Llama made locally with transformers -> megacoat layout-free checkpoint ->
(tools/convert_to_hf.py) HF again gives the same weights bit for bit (fp32, the q/k row permutation undone
exactly); megacoat's GPT with the converted weights gives HF's logits; pretrain_gpt.py --finetune starts from it."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megacoat.checkpoint.hf_llama import half_to_interleaved, interleaved_to_half
from megacoat.data.gpt_dataset import MockGPTDataset
from megacoat.model import GPT
from megacoat.model.config import ModelConfig
from tests.tools.conftest import load_tool
from tests.tools.test_convert_to_hf import hf_llama_logits
from tests.training.checkpoint_runs import TINY, losses, run

transformers = pytest.importorskip("transformers")

# The shape of checkpoint_runs.TINY, so pretrain_gpt.py's tiny runs can --finetune from it.
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A randomly initialised LlamaForCausalLM saved as config.json + model.safetensors (fp32)."""
    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA, rope_theta=500.0))
    with torch.no_grad():  # norms away from 1: a mixed-up norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mc") / "ckpt"
    assert load_tool("convert_from_hf").main(["--hf-dir", str(hf_dir), "--output", str(out)]) == 0
    return out


def test_q_k_permutations_are_inverse():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, 4), 4), w)
    assert not torch.equal(interleaved_to_half(w, 4), w)


def test_hf_to_megacoat_to_hf_gives_identical_weights(hf_dir, converted, tmp_path):
    out = load_tool("convert_to_hf").convert(str(converted), str(tmp_path / "back"), torch.float32)
    original, back = load_file(hf_dir / "model.safetensors"), load_file(os.path.join(out, "model.safetensors"))
    assert original.keys() == back.keys()
    for k in original:
        assert torch.equal(original[k], back[k]), k
    cfg_in, cfg_out = json.loads((hf_dir / "config.json").read_text()), json.loads((tmp_path / "back" / "config.json").read_text())
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "rms_norm_eps", "tie_word_embeddings"):
        assert cfg_in[k] == cfg_out[k], k
    assert cfg_out["rope_theta"] == 500.0


def test_megacoat_logits_match_hf(hf_dir, converted):
    meta = json.loads((converted / "iter_0000000" / "megacoat.json").read_text())
    assert meta["format"] == "layout-free" and meta["optimizer"] is None and meta["iteration"] == 0
    cfg = ModelConfig(**meta["megacoat_config"]["model"])
    model = GPT(cfg).eval()
    model.load_state_dict(load_file(converted / "iter_0000000" / "model.safetensors"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    with torch.no_grad():
        want, got = hf(tokens).logits, model(tokens)
        reference = hf_llama_logits(json.loads((hf_dir / "config.json").read_text()) | {"rope_theta": 500.0,
                                    "head_dim": cfg.head_dim}, load_file(hf_dir / "model.safetensors"), tokens)
    # The same fp32 arithmetic up to summation order and the rotary tables' float64 vs float32 angles.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reference, want, rtol=1e-4, atol=1e-4)


def test_finetune_starts_from_the_hf_weights(tmp_path, converted):
    """--load ... --finetune: iteration counting from 1 and the first loss is the converted model's loss on
    pretrain_gpt.py's first global batch (mock data: samples 0-7, two micro-batches of 4), computed here in fp32."""
    argv = ["--train-iters", "3", "--fp32", "--zero-stage", "1", "--untie-embeddings-and-output-weights",
            "--num-query-groups", "2", "--rotary-base", "500.0", "--load", str(converted), "--finetune"]
    proc = run(tmp_path, argv, tmp_path / "ft.json")
    assert f"fine-tuning from {converted / 'iter_0000000'} at iteration 0" in proc.stdout
    logged = losses(tmp_path / "ft.json")
    assert [i for i, _ in logged] == [1, 2, 3]
    meta = json.loads((converted / "iter_0000000" / "megacoat.json").read_text())
    model = GPT(ModelConfig(**meta["megacoat_config"]["model"])).eval()
    model.load_state_dict(load_file(converted / "iter_0000000" / "model.safetensors"))
    seed = int(TINY[TINY.index("--seed") + 1]) if "--seed" in TINY else 1234  # TrainingConfig's default seed
    data = MockGPTDataset(8, 32, 256, seed)
    batch = torch.from_numpy(np.stack([data[i] for i in range(8)]))
    with torch.no_grad():
        want = sum(float(model(mb[:, :-1], mb[:, 1:])) for mb in batch.split(4)) / 2
    assert logged[0][1] == pytest.approx(want, rel=1e-5), (logged[0][1], want)


def test_bad_hf_directory_is_one_error_line(tmp_path, capsys):
    tool = load_tool("convert_from_hf")
    assert tool.main(["--hf-dir", str(tmp_path), "--output", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.strip() == f"error: --hf-dir {tmp_path}: no config.json"
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "model_type": "llama", "hidden_act": "gelu"}))
    assert tool.main(["--hf-dir", str(tmp_path), "--output", str(tmp_path / "o")]) == 1
    assert "hidden_act = 'gelu' is not supported" in capsys.readouterr().err
