"""Convert a local Hugging Face Llama directory (config.json + *.safetensors, no hub access) into a megacoat
layout-free checkpoint that `pretrain_gpt.py --load OUT --finetune` starts from, in any parallel layout.

    python tools/convert_from_hf.py --hf-dir llama-3.2-1b/ --output ckpt/llama1b
    python pretrain_gpt.py --load ckpt/llama1b --finetune <the model flags it prints> ...

The weights are kept in fp32 (bf16 weights convert exactly); the rows of wq/wk go from HF's half-split rotary
order to megacoat's interleaved pairs (megacoat.checkpoint.hf_llama, the inverse of tools/convert_to_hf.py).
A tokenizer.model in the directory is copied beside the checkpoint and recorded, so a run with another
tokenizer is refused. The printed flags give the model's shape; --seq-length may differ when fine-tuning.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacoat.arguments import ArgumentParser  # noqa: E402
from megacoat.checkpoint.hf_llama import from_hf_state_dict, model_config_from_hf  # noqa: E402
from megacoat.checkpoint.layout_free import write_layout_free  # noqa: E402
from megacoat.checkpoint.paths import write_latest  # noqa: E402
from megacoat.config import MegacoatConfig  # noqa: E402
from megacoat.model.config import ModelConfig  # noqa: E402

TAG = "iter_0000000"


def read_hf(hf_dir: str) -> tuple[ModelConfig, dict]:
    """(megacoat ModelConfig, HF state dict) of a local HF Llama directory."""
    from safetensors.torch import load_file

    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no config.json")
    with open(config_path) as f:
        try:
            c = json.load(f)
        except ValueError as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(c, dict):
        raise ValueError(f"{config_path}: not a JSON object")
    try:
        cfg = model_config_from_hf(c)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_path}: {e}") from None
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no *.safetensors weights (PyTorch .bin files: re-save them "
                                "with save_pretrained(..., safe_serialization=True))")
    state = {}
    for path in files:
        try:
            state.update(load_file(path))
        except Exception as e:  # safetensors' own error type: a damaged or foreign file
            raise ValueError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return cfg, state


def model_flags(cfg: ModelConfig) -> list[str]:
    flags = ["--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size, "--ffn-hidden-size",
             cfg.ffn_hidden_size, "--num-attention-heads", cfg.num_attention_heads, "--num-query-groups",
             cfg.num_query_groups, "--seq-length", cfg.seq_length, "--vocab-size", cfg.vocab_size,
             "--norm-epsilon", cfg.norm_eps, "--rotary-base", cfg.rope_theta]
    if not cfg.tie_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    return [str(f) for f in flags]


def convert(hf_dir: str, output: str) -> str:
    from megacoat.training.checkpointing import file_identity

    cfg, hf = read_hf(hf_dir)
    weights = from_hf_state_dict(cfg, hf)
    os.makedirs(output, exist_ok=True)
    tokenizer = None
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        shutil.copyfile(os.path.join(hf_dir, "tokenizer.model"), os.path.join(output, "tokenizer.model"))
        tokenizer = file_identity(os.path.join(output, "tokenizer.model"))
    meta = {"format_version": 1, "iteration": 0, "consumed_samples": 0, "skipped_steps": 0, "layout": None,
            "tokenizer": tokenizer, "megacoat_config": MegacoatConfig(model=cfg).to_dict(), "optimizer": None,
            "lr_scheduler": None, "converted_from": os.path.abspath(hf_dir)}
    out = write_layout_free(os.path.join(output, TAG), meta, weights, tied=cfg.tie_embeddings)
    write_latest(output, TAG)
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])  # a bad flag: one error line, exit 1
    p.add_argument("--hf-dir", required=True, help="local directory with config.json and *.safetensors")
    p.add_argument("--output", required=True, help="checkpoint directory to write (for --load ... --finetune)")
    args = p.parse_args(argv)
    try:
        out = convert(args.hf_dir, args.output)
        with open(os.path.join(out, "megacoat.json")) as f:
            cfg = ModelConfig(**json.load(f)["megacoat_config"]["model"])
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}; train from it with: pretrain_gpt.py --load {args.output} --finetune "
          + " ".join(model_flags(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
