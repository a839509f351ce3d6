"""Hugging Face Llama <-> megacoat GPT: parameter names, the rotary row order of wq/wk, and the config.

Rotary convention: megacoat rotates interleaved pairs (x[2i], x[2i+1]) per head (Meta's original Llama); HF
rotates halves (x[i], x[i + d/2]) (`rotate_half`). Rows of wq/wk are permuted per head between the two, as HF's
own convert_llama_weights_to_hf `permute` does; wv/wo and everything else map one to one.
"""
from __future__ import annotations

import torch

from megacoat.model.config import ModelConfig

# megacoat name inside layer i -> HF name inside model.layers.i
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from pairs (2i, 2i+1) to halves (i, i + d/2)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of interleaved_to_half: rows (i, i + d/2) of each head back to pairs (2i, 2i+1)."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads(cfg: ModelConfig, name: str) -> int | None:
    return {"attention.wq.weight": cfg.num_attention_heads, "attention.wk.weight": cfg.num_query_groups}.get(name)


def to_hf_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """megacoat's full state dict (plain GPT names) -> HF LlamaForCausalLM's, in `dtype`."""
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:  # tied: HF re-ties lm_head to the embedding (config.tie_word_embeddings)
        out["lm_head.weight"] = state["output.weight"]
    for i in range(cfg.num_layers):
        for ours, theirs in LAYER_NAMES.items():
            w = state[f"layers.{i}.{ours}"]
            heads = _heads(cfg, ours)
            out[f"model.layers.{i}.{theirs}"] = w if heads is None else interleaved_to_half(w, heads)
    return {k: v.detach().to(dtype).contiguous() for k, v in out.items()}


def from_hf_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM's state dict -> megacoat's plain GPT names, fp32 (`output.weight` only when untied)."""
    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise ValueError(f"the Hugging Face weights lack {key}")
        return hf[key].float()

    out = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        for ours, theirs in LAYER_NAMES.items():
            w = take(f"model.layers.{i}.{theirs}")
            heads = _heads(cfg, ours)
            out[f"layers.{i}.{ours}"] = w if heads is None else half_to_interleaved(w, heads)
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_length, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "torch_dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype], "use_cache": True,
    }


def model_config_from_hf(c: dict) -> ModelConfig:
    """The megacoat ModelConfig of an HF Llama config.json; features megacoat's GPT lacks are errors."""
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "max_position_embeddings", "vocab_size", "rms_norm_eps")
    missing = [k for k in required if k not in c]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    if c.get("model_type") != "llama":
        raise ValueError(f"model_type is {c.get('model_type')!r}; only Llama checkpoints convert")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None)):
        if c.get(key, ok) != ok:
            raise ValueError(f"{key} = {c[key]!r} is not supported by megacoat's GPT (needs {ok!r})")
    heads = c["num_attention_heads"]
    if c.get("head_dim", c["hidden_size"] // heads) != c["hidden_size"] // heads:
        raise ValueError(f"head_dim {c['head_dim']} != hidden_size / num_attention_heads; not supported")
    rope = c.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta here
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported by megacoat's GPT (needs 'default')")
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    return ModelConfig(num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                       ffn_hidden_size=c["intermediate_size"], num_attention_heads=heads,
                       num_query_groups=c.get("num_key_value_heads") or heads,
                       seq_length=c["max_position_embeddings"], vocab_size=c["vocab_size"],
                       norm_eps=c["rms_norm_eps"], rope_theta=float(theta),
                       tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                       init_std=c.get("initializer_range", 0.02))


def hf_tokenizer_config(model_path: str, max_length: int) -> dict:
    """tokenizer_config.json that makes HF's Llama tokenizers (slow, fast, AutoTokenizer) encode a text to the ids
    megacoat's sentencepiece model gives: no dummy prefix space, no BOS/EOS added, special-token text not parsed."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=model_path)
    except (RuntimeError, OSError) as e:
        raise ValueError(f"{model_path}: not a sentencepiece model ({e})") from None

    def piece(i: int) -> str | None:
        return sp.id_to_piece(i) if i >= 0 else None

    return {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
            "add_prefix_space": False, "legacy": False, "split_special_tokens": True,
            "clean_up_tokenization_spaces": False, "model_max_length": max_length,
            "unk_token": piece(sp.unk_id()), "bos_token": piece(sp.bos_id()), "eos_token": piece(sp.eos_id()),
            "pad_token": piece(sp.pad_id())}
