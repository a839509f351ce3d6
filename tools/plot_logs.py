"""PNG plots from megacoat JSON training logs (--log-json): loss (train, and validation as markers),
tokens/s and peak memory against iteration, every log on the same axes (e.g. BF16 vs COAT).

    python tools/plot_logs.py bf16.json coat.json --labels BF16 COAT --output plots/
    → plots/loss.png, plots/tokens_per_s.png, plots/memory.png, plots/summary.png (the three side by side)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

PANELS = (("loss", "loss", "training loss"), ("tokens_per_s", "tokens/s", "throughput (tokens/s, all GPUs)"),
          ("memory", "GiB", "peak memory per GPU (GiB)"))


def read_log(path: str) -> dict:
    """{'train': [records with a loss], 'val': [(iteration, val_loss)]}; a malformed line names its place."""
    train, val = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e})") from None
            if "val_loss" in r:
                val.append((r["iteration"], r["val_loss"]))
            elif "loss" in r:
                train.append(r)
    if not train and not val:
        raise ValueError(f"{path}: no training records (is it a megacoat --log-json file?)")
    return {"train": train, "val": val}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over the finite values (NaN from skipped steps stays out of it)."""
    if window <= 1:
        return values
    out, buf = [], []
    for v in values:
        if v is not None and math.isfinite(v):
            buf = (buf + [v])[-window:]
        out.append(sum(buf) / len(buf) if buf else float("nan"))
    return out


def series(log: dict, panel: str, window: int) -> tuple[list[int], list[float]]:
    its = [r["iteration"] for r in log["train"]]
    if panel == "loss":
        return its, smooth([r["loss"] for r in log["train"]], window)
    if panel == "tokens_per_s":
        return its, [r.get("tokens_per_s") for r in log["train"]]
    return its, [r["max_memory_bytes"] / 2**30 if r.get("max_memory_bytes") is not None else float("nan")
                 for r in log["train"]]


def _draw(ax, logs, labels, panel, ylabel, title, window):
    for log, label, color in zip(logs, labels, [f"C{i}" for i in range(len(logs))]):
        its, ys = series(log, panel, window)
        ax.plot(its, [float("nan") if y is None else y for y in ys], label=label, color=color, linewidth=1.2)
        if panel == "loss" and log["val"]:
            vi, vl = zip(*log["val"])
            ax.plot(vi, vl, "o", color=color, markersize=4, label=f"{label} (validation)")
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def plot(paths: list[str], output: str, labels: list[str] | None = None, window: int = 1) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(paths):
        raise ValueError(f"--labels: {len(labels)} labels for {len(paths)} logs")
    labels = labels or [os.path.splitext(os.path.basename(p))[0] for p in paths]
    logs = [read_log(p) for p in paths]
    os.makedirs(output, exist_ok=True)
    written = []
    for panel, ylabel, title in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _draw(ax, logs, labels, panel, ylabel, title, window)
        fig.tight_layout()
        written.append(os.path.join(output, f"{panel}.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    for ax, (panel, ylabel, title) in zip(axes, PANELS):
        _draw(ax, logs, labels, panel, ylabel, title, window)
    fig.tight_layout()
    written.append(os.path.join(output, "summary.png"))
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="JSON logs written with --log-json")
    p.add_argument("--labels", nargs="+", default=None, help="one per log (default: file names)")
    p.add_argument("--output", default="plots", help="directory for the PNG files")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window for the loss")
    args = p.parse_args(argv)
    try:
        written = plot(args.logs, args.output, args.labels, args.smooth)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("wrote " + " ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
