"""tools/convert_to_hf.py: the HF Llama weights give megacoat's logits. On CPU the check runs against a small
pure-torch re-implementation of HF's Llama forward (rotate_half rotary, repeat_kv, RMSNorm in fp32), so the
q/k permutation and the key mapping are tested without `transformers`; where transformers is installed the
real LlamaForCausalLM loads the output and is compared too. Checkpoints in the ZeRO, tensor-parallel and
pipeline-parallel file layouts convert to the same weights."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from megacoat.model import GPT
from megacoat.model.config import ModelConfig
from tests.tools.conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    "tied-mha": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                            seq_length=16, vocab_size=128, rope_theta=500.0),
    "untied-gqa": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                              num_query_groups=2, seq_length=16, vocab_size=128, tie_embeddings=False),
}


@pytest.fixture(scope="module")
def tool():
    return load_tool("convert_to_hf")


# --- a reference HF Llama forward, written from transformers' modeling_llama (half-split rotary) ----------------
def _rms(x, w, eps):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_llama_logits(c: dict, sd: dict, tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(s).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], c["rms_norm_eps"])
        q = F.linear(h, sd[p + "self_attn.q_proj.weight"]).view(b, s, nh, d).transpose(1, 2)
        k = F.linear(h, sd[p + "self_attn.k_proj.weight"]).view(b, s, nkv, d).transpose(1, 2)
        v = F.linear(h, sd[p + "self_attn.v_proj.weight"]).view(b, s, nkv, d).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, nh * d)
        x = x + F.linear(a, sd[p + "self_attn.o_proj.weight"])
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
        x = x + F.linear(F.silu(F.linear(h, sd[p + "mlp.gate_proj.weight"])) * F.linear(h, sd[p + "mlp.up_proj.weight"]),
                         sd[p + "mlp.down_proj.weight"])
    head = sd["model.embed_tokens.weight"] if c["tie_word_embeddings"] else sd["lm_head.weight"]
    return F.linear(_rms(x, sd["model.norm.weight"], c["rms_norm_eps"]), head)


# --- checkpoints in DeepSpeed's file layouts ---------------------------------------------------------------
def _meta(cfg: ModelConfig, tp=1, pp=1) -> dict:
    from dataclasses import asdict

    return {"iteration": 7, "consumed_samples": 56, "tokenizer": None, "megacoat_config": {"model": asdict(cfg)},
            "layout": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}}


def _shard(name, w, tp, rank):
    if name in ("tok_embeddings.weight", "output.weight") or any(
            k in name for k in ("wq", "wk", "wv", "w1", "w3")):
        return w.chunk(tp, 0)[rank].clone()
    if "wo" in name or "w2" in name:
        return w.chunk(tp, 1)[rank].clone()
    return w.clone()


def write_checkpoint(directory, model: GPT, tp=1, pp=False):
    """megacoat.json + DeepSpeed's model files: mp_rank_XX_model_states.pt {'module': ...} per TP rank, or
    (pp) PipelineModule's layer_LL-model_XX-model_states.pt per layer and TP rank."""
    cfg = model.cfg
    tag = directory / "iter_0000007"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("iter_0000007")
    (tag / "megacoat.json").write_text(json.dumps(_meta(cfg, tp, 2 if pp else 1)))
    sd = model.state_dict()
    for r in range(tp):
        shard = {k: _shard(k, v, tp, r) for k, v in sd.items()}
        if not pp:
            torch.save({"module": shard}, tag / f"mp_rank_{r:02d}_model_states.pt")
            continue
        layers = {0: {"tok_embeddings.weight": shard["tok_embeddings.weight"]},
                  cfg.num_layers + 1: {"weight": shard["norm.weight"]},
                  cfg.num_layers + 2: ({"tok_embeddings.weight": shard["tok_embeddings.weight"]}
                                       if cfg.tie_embeddings else {"output.weight": shard["output.weight"]})}
        for i in range(cfg.num_layers):
            pre = f"layers.{i}."
            layers[i + 1] = {"block." + k[len(pre):]: v for k, v in shard.items() if k.startswith(pre)}
        for idx, layer_sd in layers.items():
            torch.save(layer_sd, tag / f"layer_{idx:02d}-model_{r:02d}-model_states.pt")


def _model(cfg):
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a mixed-up norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_weights_reproduce_megacoat_logits(tmp_path, tool, name):
    model = _model(CONFIGS[name])
    write_checkpoint(tmp_path / "ckpt", model)
    out = tool.convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert ("lm_head.weight" in sd) == (not model.cfg.tie_embeddings)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_length))
    with torch.no_grad():
        want = model(tokens)
        got = hf_llama_logits(config, sd, tokens)
    # Same fp32 arithmetic up to summation order: agreement far below any training-relevant difference.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Without the q/k permutation the rotary embedding pairs the wrong features: logits visibly differ.
    plain = dict(sd)
    for i in range(model.cfg.num_layers):
        for proj in ("q_proj", "k_proj"):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            plain[key] = model.state_dict()[f"layers.{i}.attention.w{proj[0]}.weight"]
    assert (hf_llama_logits(config, plain, tokens) - want).abs().max() > 1e-3


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=1, pp=True), dict(tp=2, pp=True)],
                         ids=["tp2", "pp", "tp2-pp"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parallel_layouts_convert_to_the_same_weights(tmp_path, tool, layout, name):
    model = _model(CONFIGS[name])
    write_checkpoint(tmp_path / "one", model)
    write_checkpoint(tmp_path / "par", model, **layout)
    a = load_file(tool.convert(str(tmp_path / "one"), str(tmp_path / "a"), torch.float32) + "/model.safetensors")
    b = load_file(tool.convert(str(tmp_path / "par"), str(tmp_path / "b"), torch.float32) + "/model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_bad_inputs_are_named(tmp_path, tool):
    with pytest.raises(FileNotFoundError, match="not a megacoat checkpoint"):
        tool.convert(str(tmp_path), str(tmp_path / "out"))
    model = _model(CONFIGS["tied-mha"])
    write_checkpoint(tmp_path / "ckpt", model)
    meta = json.loads((tmp_path / "ckpt" / "iter_0000007" / "megacoat.json").read_text())
    meta["megacoat_config"]["model"]["ffn_hidden_size"] = 128  # flags that do not fit the saved weights
    (tmp_path / "ckpt" / "iter_0000007" / "megacoat.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"layers.0.feed_forward.w1.weight has shape \(96, 64\), the config says \(128, 64\)"):
        tool.convert(str(tmp_path / "ckpt"), str(tmp_path / "out"))


@pytest.mark.parametrize("flags", [[], ["--coat-fp8"]], ids=["bf16", "coat"])
def test_a_real_training_checkpoint_converts(tmp_path, tool, flags):
    """From pretrain_gpt.py's own DeepSpeed files (ZeRO-1): HF logits equal the megacoat model's. coat's model
    state also holds its delayed-scaling amax histories (buffers, not weights): the export leaves them out."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
                      vocab_size=256)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "2", "--eval-iters", "0", "--mock-data", "--zero-stage", "1",
            "--save", str(tmp_path / "ckpt"), *flags]
    env = dict(os.environ, PYTHONPATH=ROOT, MEGACOAT_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + argv, env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), "--load",
                          str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--dtype", "fp32"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    _, state, _ = tool.load_megacoat_checkpoint(str(tmp_path / "ckpt"))
    model = GPT(cfg).eval()
    model.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 32))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    with torch.no_grad():
        torch.testing.assert_close(hf_llama_logits(config, load_file(tmp_path / "hf" / "model.safetensors"), tokens),
                                   model(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_llama_loads_the_output(tmp_path, tool, name):
    transformers = pytest.importorskip("transformers")
    model = _model(CONFIGS[name])
    write_checkpoint(tmp_path / "ckpt", model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_length))
    with torch.no_grad():
        want = model(tokens)
        tool.convert(str(tmp_path / "ckpt"), str(tmp_path / "fp32"), torch.float32)
        hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "fp32"), torch_dtype=torch.float32).eval()
        torch.testing.assert_close(hf(tokens).logits, want, rtol=1e-4, atol=1e-4)
        # bf16 export: HF in bf16 may differ from fp32 only as much as megacoat's own bf16 forward does
        # (both round every GEMM input/output to 8 mantissa bits); allow twice that, plus 2^-8 of the scale.
        tool.convert(str(tmp_path / "ckpt"), str(tmp_path / "bf16"))
        hf16 = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "bf16"), torch_dtype=torch.bfloat16)
        err_hf = (hf16.eval()(tokens).logits.float() - want).abs().max()
        err_mc = (model.to(torch.bfloat16)(tokens).float() - want).abs().max()
        assert err_hf <= 2 * err_mc + 2**-8 * want.abs().max(), (err_hf, err_mc)


@pytest.mark.slow
def test_real_tensor_and_pipeline_parallel_checkpoints_convert_like_one_rank(tmp_path, tool):
    """pretrain_gpt.py on 1 rank, on TP=2 and on PP=2 (same seed, so the same initial weights), one step each:
    the converted weights agree. TP sums its row-parallel GEMMs in another order (~1e-6 relative after one
    step); a wrong concatenation order or axis would differ at O(1)."""
    argv = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "1", "--eval-iters", "0", "--mock-data", "--fp32"]
    env = dict(os.environ, PYTHONPATH=ROOT, MEGACOAT_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    two = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port"]
    runs = {"one": ([sys.executable], []),
            "tp2": (two + ["29631"], ["--tensor-model-parallel-size", "2"]),
            "pp2": (two + ["29632"], ["--pipeline-model-parallel-size", "2"])}
    weights = {}
    for name, (launch, extra) in runs.items():
        proc = subprocess.run(launch + [os.path.join(ROOT, "pretrain_gpt.py")] + argv + extra
                              + ["--save", str(tmp_path / name)], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        out = tool.convert(str(tmp_path / name), str(tmp_path / f"hf_{name}"), torch.float32)
        weights[name] = load_file(os.path.join(out, "model.safetensors"))
    for name in ("tp2", "pp2"):
        assert weights[name].keys() == weights["one"].keys()
        for k, w in weights["one"].items():
            torch.testing.assert_close(weights[name][k], w, rtol=1e-4, atol=1e-5 * w.abs().max().item())
