"""How much of the FP8 output layer's loss gap is its evaluation: one trained checkpoint, its held-out loss with
the head in FP8 and in BF16 (same weights, the blocks in the COAT flow both times), and with no FP8 at all.

The FP8 head's runs are validated with the head in FP8 too. The logits of an E4M3 GEMM carry its rounding (3 mantissa bits an
operand), noise that by itself raises a cross-entropy. If the gap is that noise, a checkpoint evaluated with its
head in BF16 loses it; if the training is worse, it stays. Batch-paired gaps with a 95% t-interval over batches.

    python -m benchmarks.fidelity.head_precision_eval --checkpoint RUNDIR/coat_s3/checkpoint \\
        --data .cache/fidelity_data --samples 64 --batch-size 8 --out head_precision_eval.json
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.common import fixed_recipe, load_tool

HEADS = {  # name: (activation mode, head in FP8)
    "bf16": ("bf16", False),
    "coat, head in bf16": ("coat", False),
    "coat, head in fp8": ("coat", True),
}


def batch_losses(model_cfg, state: dict, mode: str, fp8_head: bool, group_size: int, tokens, labels,
                 batch_size: int) -> list[float]:
    """The mean loss of each batch of `batch_size` samples, no gradients (as the trainer's validation, whose delayed
    scaling sites then cast with current scaling), the checkpoint's weights in bf16 on CUDA (fp32 on CPU)."""
    import torch

    from megacoat.coat import convert_to_coat
    from megacoat.model.gpt import GPT

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):
        model = GPT(model_cfg)
    model.load_state_dict(state)
    model = convert_to_coat(model, fixed_recipe(mode, output_layer=fp8_head, group_size=group_size))
    model = model.to(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    out = []
    with torch.no_grad():
        for i in range(0, tokens.shape[0], batch_size):
            out.append(float(model(tokens[i:i + batch_size].to(device), labels[i:i + batch_size].to(device))))
    return out


def measure(checkpoint: str, manifest: dict, samples: int, batch_size: int, environment: dict) -> dict:
    hf = load_tool('convert_to_hf')
    from benchmarks.fidelity import stats
    from benchmarks.fidelity.grads import fixed_batch
    model_cfg, state, meta = hf.load_megacoat_checkpoint(checkpoint)
    tokens, labels = fixed_batch(manifest, model_cfg.seq_length, samples)
    group_size = meta.get("megacoat_config", {}).get("fp8", {}).get("group_size", 128)
    losses = {name: batch_losses(model_cfg, state, mode, head, group_size, tokens, labels, batch_size)
              for name, (mode, head) in HEADS.items()}
    per_batch = lambda name: dict(enumerate(losses[name]))  # noqa: E731
    return {"kind": "head_precision_eval", "environment": environment, "checkpoint": checkpoint,
            "checkpoint_iteration": meta.get("iteration"), "data_id": manifest["data_id"],
            "held_out": {"samples": samples, "batch_size": batch_size, "seq_length": model_cfg.seq_length,
                         "source": "the held-out range's first samples, in file order"},
            "mean_loss": {name: sum(v) / len(v) for name, v in losses.items()}, "batch_losses": losses,
            "gaps_pct": {"head fp8 vs head bf16": stats.paired_gap(per_batch("coat, head in fp8"),
                                                                   per_batch("coat, head in bf16")),
                         "head bf16 vs no fp8": stats.paired_gap(per_batch("coat, head in bf16"), per_batch("bf16"))}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a megacoat checkpoint (its folder or an iter_N in it)")
    p.add_argument("--data", required=True, help="folder written by benchmarks/fidelity/data.py")
    p.add_argument("--samples", type=int, default=64, help="held-out samples (sequences)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", required=True, help="JSON path")
    args = p.parse_args(argv)
    from benchmarks.fidelity import loss as fidelity
    try:
        if args.batch_size < 1 or args.samples < 2 * args.batch_size:
            raise fidelity.UserError("--batch-size must be positive and --samples at least two batches")
        manifest = fidelity.load_manifest(args.data)
        try:
            result = measure(args.checkpoint, manifest, args.samples, args.batch_size, fidelity.environment())
        except (ValueError, FileNotFoundError) as e:
            raise fidelity.UserError(f"--checkpoint {args.checkpoint}: {e}") from None
    except fidelity.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, loss in result["mean_loss"].items():
        print(f"{name:20s} {loss:.4f}")
    for name, gap in result["gaps_pct"].items():
        print(f"{name:22s} {gap['mean_pct']:+.3f}% [{gap['ci95_pct'][0]:+.3f}, {gap['ci95_pct'][1]:+.3f}]")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
