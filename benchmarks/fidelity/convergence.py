"""Convergence of the FP8 activation modes against BF16: the same small model, data, seed and schedule trained
with pretrain_gpt.py once per mode; loss curves saved as JSON and PNG.

Pass criterion: the final training loss (mean of the last 10% of logged iterations, to look past
single-batch noise) of `coat` within 2% of `bf16`; the final validation losses are reported beside it.

    python -m benchmarks.fidelity.convergence --iters 300 [--modes bf16 coat] [-- extra pretrain flags]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "4",
         "--seq-length", "256", "--vocab-size", "4096"]


def run_mode(mode: str, iters: int, out_dir: str, extra: list[str]) -> list[dict]:
    log = os.path.join(out_dir, f"fp8_convergence_{mode}.jsonl")
    cmd = [sys.executable, "pretrain_gpt.py", *MODEL, "--train-iters", str(iters), "--log-interval", "5",
           "--eval-interval", "50", "--eval-iters", "10", "--micro-batch-size", "16", "--global-batch-size", "32",
           "--lr", "1e-3", "--lr-warmup-iters", "30", "--log-json", log, "--seed", "1234", *extra]
    if mode != "bf16":
        cmd += ["--fp8-activations", mode]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"{mode}: {time.time() - t0:.0f} s")
    with open(log) as f:
        return [json.loads(line) for line in f]


def final_loss(records: list[dict]) -> float:
    train = [r["loss"] for r in records if "loss" in r]
    tail = train[-max(1, len(train) // 10):]
    return sum(tail) / len(tail)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--modes", nargs="+", default=["bf16", "coat"])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    curves = {m: run_mode(m, args.iters, args.out_dir, args.extra) for m in args.modes}
    summary = {"benchmark": "fp8_convergence", "command": " ".join(sys.argv), "model_flags": MODEL,
               "extra_flags": args.extra, "iters": args.iters, "modes": {}}
    try:
        import torch
        summary["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        summary["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - the summary is still useful without it
        pass
    base = final_loss(curves["bf16"]) if "bf16" in curves else None
    for mode, recs in curves.items():
        val = [r["val_loss"] for r in recs if "val_loss" in r]
        fl = final_loss(recs)
        summary["modes"][mode] = {
            "final_train_loss": fl, "final_val_loss": val[-1] if val else None,
            "rel_diff_vs_bf16": None if base is None else (fl - base) / base,
            "tokens_per_s_last": [r["tokens_per_s"] for r in recs if "tokens_per_s" in r][-1],
            "curve": [(r["iteration"], r["loss"]) for r in recs if "loss" in r],
            "val_curve": [(r["iteration"], r["val_loss"]) for r in recs if "val_loss" in r]}
        print(f"{mode:>11}: final train loss {fl:.4f}, val {summary['modes'][mode]['final_val_loss']}, "
              f"vs bf16 {summary['modes'][mode]['rel_diff_vs_bf16']}")
    with open(os.path.join(args.out_dir, "fp8_convergence.json"), "w") as f:
        json.dump(summary, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, s in summary["modes"].items():
        it, loss = zip(*s["curve"])
        ax.plot(it, loss, label=f"{mode} train")
        if s["val_curve"]:
            vit, vl = zip(*s["val_curve"])
            ax.plot(vit, vl, "o--", label=f"{mode} val")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title(f"FP8 activation modes vs BF16 ({summary.get('device', '')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "fp8_convergence.png"), dpi=120)


if __name__ == "__main__":
    main()
