"""Gradient agreement of the FP8 modes with bf16 on a trained checkpoint, and the FP8 quantization error of that
checkpoint's real Adam moments (`fidelity.py grads`).

The same weights are loaded into each mode and one fixed held-out batch goes through it; per parameter tensor
the cosine similarity and relative error of its gradient against bf16's. The optimizer does not enter a gradient,
so `coat` here is the COAT activation flow. The moments are the optimizer state as the checkpoint holds it (ZeRO's
flat fp32 partitions, the tensors CoatAdamW quantizes in groups of 128 under ZeRO), quantized with
benchmarks/optimizer/quant_error.py: E4M3/E5M2, with and without dynamic range expansion.
"""
from __future__ import annotations

import glob
import os
import statistics

from benchmarks.common import fixed_recipe, load_tool
from benchmarks.fidelity.stats import TARGET_GRAD_COSINE


def fixed_batch(manifest: dict, seq: int, size: int):
    """The first `size` samples of the held-out range, in file order (no shuffle): the same batch every time."""
    import numpy as np
    import torch

    from megacoat.data.builders import split_ranges
    from megacoat.data.gpt_dataset import GPTDataset
    from megacoat.data.indexed_dataset import IndexedDataset

    indexed = IndexedDataset(manifest["data_prefix"])
    lo, hi = split_ranges(len(indexed), manifest["split"])[1]
    ds = GPTDataset(indexed, lo, hi, seq, size, seed=0, name="fidelity_grads")
    batch = torch.from_numpy(np.stack([ds[i] for i in range(size)]))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def mode_gradients(model_cfg, state: dict, mode: str, tokens, labels) -> dict:
    """{parameter name: fp32 gradient} of the loss on (tokens, labels) with the checkpoint's weights in `mode`
    ('fp32', 'bf16', 'fp8-linear' or 'coat'); bf16 and FP8 modes hold bf16 weights on CUDA, as the trainer does."""
    import torch

    from megacoat.coat import convert_to_coat
    from megacoat.model.gpt import GPT

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if mode == "fp32" or device.type == "cpu" else torch.bfloat16
    with torch.device(device):
        model = GPT(model_cfg)
    model.load_state_dict(state)
    if mode not in ("fp32", "bf16"):
        model = convert_to_coat(model, fixed_recipe(mode))
    model = model.to(device=device, dtype=dtype)
    loss = model(tokens.to(device), labels.to(device))
    loss.backward()
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


def compare_gradients(ref: dict, other: dict) -> dict:
    per = {}
    for name, g in ref.items():
        h = other[name]
        gn, hn = float(g.norm()), float(h.norm())
        per[name] = {"cosine": float((g * h).sum() / (gn * hn)) if gn and hn else float("nan"),
                     "relative_error": float((h - g).norm()) / gn if gn else float("nan")}
    block = {n: v for n, v in per.items() if n.startswith("layers.")}
    worst = min(block, key=lambda n: block[n]["cosine"]) if block else None
    below = sorted(n for n, v in block.items() if not v["cosine"] >= TARGET_GRAD_COSINE)
    return {"per_tensor": per, "block_min_cosine": block[worst]["cosine"] if worst else None,
            "block_min_cosine_tensor": worst,
            "block_median_relative_error": statistics.median(v["relative_error"] for v in block.values())
            if block else None, "block_tensors_below_target": below, "meets_target": not below}


def checkpoint_moments(tag_dir: str):
    """Every (exp_avg, exp_avg_sq) pair in the checkpoint's optimizer files, as the optimizer holds them."""
    import torch

    ms, vs = [], []

    def walk(obj):
        if isinstance(obj, dict):
            if torch.is_tensor(obj.get("exp_avg")) and torch.is_tensor(obj.get("exp_avg_sq")):
                ms.append(obj["exp_avg"].float().reshape(-1))
                vs.append(obj["exp_avg_sq"].float().reshape(-1))
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    for path in sorted(glob.glob(os.path.join(tag_dir, "*optim_states.pt"))):
        walk(torch.load(path, map_location="cpu", weights_only=False))
    return ms, vs


def gradient_agreement(checkpoint: str, manifest: dict, modes: list[str], batch_size: int, environment: dict) -> dict:
    """The `fidelity_gradients` JSON: each mode against bf16 on the checkpoint, and its moments' FP8 error.
    Raises ValueError or FileNotFoundError for a path that is not a megacoat checkpoint."""
    import torch

    from benchmarks.optimizer.quant_error import measure_moments
    hf = load_tool('convert_to_hf')
    model_cfg, state, meta = hf.load_megacoat_checkpoint(checkpoint)
    tokens, labels = fixed_batch(manifest, model_cfg.seq_length, batch_size)
    found = {}
    for mode in ["bf16", *modes]:
        torch.manual_seed(0)
        found[mode] = mode_gradients(model_cfg, state, mode, tokens, labels)
    out = {"kind": "fidelity_gradients", "environment": environment, "checkpoint": checkpoint,
           "checkpoint_iteration": meta.get("iteration"), "data_id": manifest["data_id"],
           "batch": {"samples": batch_size, "seq_length": model_cfg.seq_length, "source": "held-out, file order"},
           "precision": "bf16 weights and activations" if torch.cuda.is_available() else "fp32 (CPU)",
           "reference": "bf16", "modes": {m: compare_gradients(found["bf16"], found[m]) for m in modes}}
    ms, vs = checkpoint_moments(hf.resolve_tag_dir(checkpoint))
    out["moments"] = None
    if ms:
        q = measure_moments(ms, vs)
        q["expansion_lowers_error"] = {fmt: {x: q[f"{fmt}_expand"][f"{x}_rel_mse"] < q[fmt][f"{x}_rel_mse"]
                                             for x in ("m", "v")} for fmt in ("e4m3", "e5m2")}
        out["moments"] = dict(q, source="the checkpoint's Adam moments (ZeRO flat partitions)")
    return out
