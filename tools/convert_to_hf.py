"""Convert a megacoat checkpoint (any ZeRO stage, tensor- and pipeline-parallel layouts) into Hugging Face's
Llama format: config.json + model.safetensors (+ tokenizer.model and tokenizer_config.json when the run had a
tokenizer), which `transformers.LlamaForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load.

    python tools/convert_to_hf.py --load checkpoints/run1 --output hf/run1              # the `latest` one
    python tools/convert_to_hf.py --load checkpoints/run1/iter_0001000 --output hf/run1 --dtype fp32

What differs between the formats besides names:
- Rotary convention: rows of wq/wk are permuted per head from megacoat's interleaved pairs to HF's halves
  (megacoat.checkpoint.hf_llama, shared with tools/convert_from_hf.py).
- Tensor/pipeline shards: weights are gathered from DeepSpeed's per-rank files (column-parallel weights
  and the vocabulary concatenated on dim 0, row-parallel ones on dim 1, norms replicated). A layout-free
  checkpoint (tools/convert_checkpoint.py) is read as it is.
- Precision: --dtype bf16 writes the bf16 weights the run computed with; --dtype fp32 the optimizer's fp32
  master where a --bf16 run kept one (megacoat.checkpoint.from_deepspeed), else the weights as saved.
- Tokenizer: megacoat's sentencepiece model adds no dummy prefix, no BOS and no EOS when it encodes, and takes
  `<s>` in text as characters; tokenizer_config.json sets HF's Llama tokenizers to do the same, so they encode
  a text to exactly the ids the run's shards hold (HF's defaults prepend a space piece and a BOS).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacoat.arguments import ArgumentParser  # noqa: E402
from megacoat.checkpoint.from_deepspeed import read_checkpoint, zero_file  # noqa: E402
from megacoat.checkpoint.hf_llama import hf_config, hf_tokenizer_config, to_hf_state_dict  # noqa: E402
from megacoat.checkpoint.integrity import safe_torch_load  # noqa: E402
from megacoat.checkpoint.layout_free import WEIGHTS_FILE, is_layout_free  # noqa: E402
from megacoat.checkpoint.paths import META_FILE, resolve_tag_dir  # noqa: E402
from megacoat.checkpoint.sharding import merge_tensor_parallel, plain_name  # noqa: E402
from megacoat.model.config import ModelConfig  # noqa: E402


def _weights(state: dict, buffer_names) -> dict:
    """The parameters of a saved module state (DeepSpeed lists its buffers beside it): buffers such as delayed
    scaling's amax histories, training state that differs between tensor-parallel ranks, are not weights."""
    buffers = set(buffer_names or ())
    return {k: v for k, v in state.items() if k not in buffers}


def read_shards(tag_dir: str, cfg: ModelConfig) -> list[dict[str, torch.Tensor]]:
    """One state dict (plain GPT names, parameters only) per tensor-parallel rank."""
    layer_files = glob.glob(os.path.join(tag_dir, "layer_*-model_*-model_states.pt"))
    if layer_files:  # DeepSpeed's PipelineModule: one file per layer and TP rank
        shards: dict[int, dict] = {}
        for path in layer_files:
            layer, tp = map(int, re.search(r"layer_(\d+)-model_(\d+)-model_states", path).groups())
            for key, value in safe_torch_load(path).items():  # a tied head's file repeats the embedding: same tensor
                shards.setdefault(tp, {})[plain_name(f"{layer}.{key}", cfg.num_layers)] = value
        return [shards[r] for r in sorted(shards)]
    files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    if not files:
        raise FileNotFoundError(f"{tag_dir}: no DeepSpeed model-state files (mp_rank_*_model_states.pt or "
                                "layer_*-model_*-model_states.pt)")
    shards = []
    for path in files:
        sd = safe_torch_load(path)
        if not isinstance(sd, dict) or not isinstance(sd.get("module"), dict):
            raise ValueError(f"{path}: not a DeepSpeed model-state file (no 'module' state dict)")
        shards.append(_weights(sd["module"], sd.get("buffer_names")))
    return shards


def load_megacoat_checkpoint(path: str, master: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, full state dict with the plain GPT's names, megacoat.json) of a checkpoint. `master`: the
    optimizer's fp32 master weights where a --bf16 run kept them (ZeRO-1/2), else the weights the model ran with."""
    tag_dir = resolve_tag_dir(path)
    meta_path = os.path.join(tag_dir, META_FILE)
    with open(meta_path) as f:
        try:
            meta = json.load(f)
            cfg = ModelConfig(**meta["megacoat_config"]["model"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{meta_path}: not a megacoat checkpoint record ({type(e).__name__}: {e})") from None
    if is_layout_free(meta):  # tools/convert_checkpoint.py, tools/convert_from_hf.py: full fp32 tensors
        from safetensors.torch import load_file

        state = load_file(os.path.join(tag_dir, WEIGHTS_FILE))
    elif master and zero_file(tag_dir, 0, 0) is not None:
        state = read_checkpoint(tag_dir, with_state=False).weights
    else:
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


def convert(load: str, output: str, dtype: torch.dtype = torch.bfloat16) -> str:
    from safetensors.torch import save_file

    # bf16: the weights the run computed with, exactly; fp32: the master they were rounded from
    cfg, state, meta = load_megacoat_checkpoint(load, master=dtype == torch.float32)
    os.makedirs(output, exist_ok=True)
    save_file(to_hf_state_dict(cfg, state, dtype), os.path.join(output, "model.safetensors"),
              metadata={"format": "pt", "source": f"megacoat iteration {meta['iteration']}"})
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf_config(cfg, dtype), f, indent=2)
    tokenizer = (meta.get("tokenizer") or {}).get("path")
    if tokenizer and os.path.isfile(tokenizer):
        shutil.copyfile(tokenizer, os.path.join(output, "tokenizer.model"))
        with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
            json.dump(hf_tokenizer_config(tokenizer, cfg.seq_length), f, indent=2)
    return output


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])  # a bad flag: one error line, exit 1
    p.add_argument("--load", required=True, help="checkpoint directory (--save DIR) or one iter_* inside it")
    p.add_argument("--output", required=True, help="directory for config.json + model.safetensors")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = p.parse_args(argv)
    try:
        out = convert(args.load, args.output, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}/config.json and model.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
