"""Convert a megacoat checkpoint (any ZeRO stage, tensor- and pipeline-parallel layouts) into Hugging Face's
Llama format: config.json + model.safetensors (+ tokenizer.model when the run had one), which
`transformers.LlamaForCausalLM.from_pretrained(OUT)` loads.

    python tools/convert_to_hf.py --load checkpoints/run1 --output hf/run1              # the `latest` one
    python tools/convert_to_hf.py --load checkpoints/run1/iter_0001000 --output hf/run1 --dtype fp32

Two things differ between the formats besides names:
- Rotary convention: megacoat rotates interleaved pairs (x[2i], x[2i+1]) per head (Meta's original Llama);
  HF rotates halves (x[i], x[i + d/2]) (`rotate_half`). Rows of wq/wk are permuted per head to match, as
  HF's own convert_llama_weights_to_hf `permute` does; wv/wo are unchanged.
- Tensor/pipeline shards: weights are gathered from DeepSpeed's per-rank files (column-parallel weights
  and the vocabulary concatenated on dim 0, row-parallel ones on dim 1, norms replicated).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacoat.model.config import ModelConfig  # noqa: E402

META_FILE = "megacoat.json"
COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")
VOCAB = ("tok_embeddings.weight", "output.weight")


def resolve_tag_dir(path: str) -> str:
    """A checkpoint directory (`--save DIR`, follows `latest`) or one tag directory inside it."""
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag_dir = os.path.join(path, f.read().strip())
        if os.path.isfile(os.path.join(tag_dir, META_FILE)):
            return tag_dir
    raise FileNotFoundError(f"{path}: not a megacoat checkpoint (no {META_FILE}, no 'latest' naming one)")


def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _pipeline_key(layer: int, key: str, num_layers: int, tied: bool) -> str | None:
    """The plain GPT's name for `key` of PipelineModule layer `layer`
    ([embedding] [block 0..L-1] [final norm] [head]); None for the tied head (a copy of the embedding)."""
    if layer == 0:
        return "tok_embeddings.weight"
    if layer <= num_layers:
        assert key.startswith("block."), key
        return f"layers.{layer - 1}.{key[len('block.'):]}"
    if layer == num_layers + 1:
        return "norm.weight"
    return None if tied else "output.weight"


def read_shards(tag_dir: str, cfg: ModelConfig) -> list[dict[str, torch.Tensor]]:
    """One state dict (plain GPT names) per tensor-parallel rank."""
    layer_files = glob.glob(os.path.join(tag_dir, "layer_*-model_*-model_states.pt"))
    if layer_files:  # DeepSpeed's PipelineModule: one file per layer and TP rank
        shards: dict[int, dict] = {}
        for path in layer_files:
            layer, tp = map(int, re.search(r"layer_(\d+)-model_(\d+)-model_states", path).groups())
            for key, value in _load(path).items():
                name = _pipeline_key(layer, key, cfg.num_layers, cfg.tie_embeddings)
                if name is not None:
                    shards.setdefault(tp, {})[name] = value
        return [shards[r] for r in sorted(shards)]
    files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    if not files:
        raise FileNotFoundError(f"{tag_dir}: no DeepSpeed model-state files (mp_rank_*_model_states.pt or "
                                "layer_*-model_*-model_states.pt)")
    return [_load(path)["module"] for path in files]


def merge_tensor_parallel(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(shards) == 1:
        return dict(shards[0])
    out = {}
    for name, first in shards[0].items():
        pieces = [s[name] for s in shards]
        if name in VOCAB or any(f".{c}." in f".{name}" for c in COLUMN):
            out[name] = torch.cat(pieces, 0)
        elif any(f".{r}." in f".{name}" for r in ROW):
            out[name] = torch.cat(pieces, 1)
        else:  # norms: replicated on every TP rank
            if not all(torch.equal(first, p) for p in pieces[1:]):
                raise ValueError(f"{name}: replicated parameter differs between tensor-parallel ranks")
            out[name] = first
    return out


def load_megacoat_checkpoint(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, full state dict with the plain GPT's names, megacoat.json) of a checkpoint."""
    tag_dir = resolve_tag_dir(path)
    with open(os.path.join(tag_dir, META_FILE)) as f:
        meta = json.load(f)
    cfg = ModelConfig(**meta["megacoat_config"]["model"])
    state = merge_tensor_parallel(read_shards(tag_dir, cfg))
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    expected = set(expected_keys(cfg))
    missing, unknown = expected - set(state), set(state) - expected
    if missing or unknown:
        raise ValueError(f"{tag_dir}: parameters do not match a {cfg.num_layers}-layer GPT: missing "
                         f"{sorted(missing)[:6]}, unexpected {sorted(unknown)[:6]}")
    for name in expected_keys(cfg):
        want = expected_shape(cfg, name)
        if tuple(state[name].shape) != want:
            raise ValueError(f"{tag_dir}: {name} has shape {tuple(state[name].shape)}, the config says {want}")
    return cfg, state, meta


def expected_keys(cfg: ModelConfig) -> list[str]:
    per_layer = ["attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                 "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
                 "feed_forward.w2.weight"]
    return (["tok_embeddings.weight", "norm.weight", "output.weight"]
            + [f"layers.{i}.{k}" for i in range(cfg.num_layers) for k in per_layer])


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, f, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups * cfg.head_dim
    last = name.split(".", 2)[-1] if name.startswith("layers.") else name
    return {"tok_embeddings.weight": (cfg.vocab_size, h), "output.weight": (cfg.vocab_size, h),
            "norm.weight": (h,), "attention_norm.weight": (h,), "ffn_norm.weight": (h,),
            "attention.wq.weight": (h, h), "attention.wk.weight": (kv, h), "attention.wv.weight": (kv, h),
            "attention.wo.weight": (h, h), "feed_forward.w1.weight": (f, h), "feed_forward.w3.weight": (f, h),
            "feed_forward.w2.weight": (h, f)}[last]


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from pairs (2i, 2i+1) to halves (i, i + d/2)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:  # tied: HF re-ties lm_head to the embedding (config.tie_word_embeddings)
        out["lm_head.weight"] = state["output.weight"]
    for i in range(cfg.num_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        out[h + "self_attn.q_proj.weight"] = interleaved_to_half(state[m + "attention.wq.weight"],
                                                                 cfg.num_attention_heads)
        out[h + "self_attn.k_proj.weight"] = interleaved_to_half(state[m + "attention.wk.weight"],
                                                                 cfg.num_query_groups)
        out[h + "self_attn.v_proj.weight"] = state[m + "attention.wv.weight"]
        out[h + "self_attn.o_proj.weight"] = state[m + "attention.wo.weight"]
        out[h + "mlp.gate_proj.weight"] = state[m + "feed_forward.w1.weight"]
        out[h + "mlp.up_proj.weight"] = state[m + "feed_forward.w3.weight"]
        out[h + "mlp.down_proj.weight"] = state[m + "feed_forward.w2.weight"]
        out[h + "input_layernorm.weight"] = state[m + "attention_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[m + "ffn_norm.weight"]
    return {k: v.detach().to(dtype).contiguous() for k, v in out.items()}


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


def convert(load: str, output: str, dtype: torch.dtype = torch.bfloat16) -> str:
    from safetensors.torch import save_file

    cfg, state, meta = load_megacoat_checkpoint(load)
    os.makedirs(output, exist_ok=True)
    save_file(to_hf_state_dict(cfg, state, dtype), os.path.join(output, "model.safetensors"),
              metadata={"format": "pt", "source": f"megacoat iteration {meta['iteration']}"})
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf_config(cfg, dtype), f, indent=2)
    tokenizer = (meta.get("tokenizer") or {}).get("path")
    if tokenizer and os.path.isfile(tokenizer):
        shutil.copyfile(tokenizer, os.path.join(output, "tokenizer.model"))
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (--save DIR) or one iter_* inside it")
    p.add_argument("--output", required=True, help="directory for config.json + model.safetensors")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = p.parse_args(argv)
    try:
        out = convert(args.load, args.output, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}/config.json and model.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
