"""Relative quantization error of real Adam moments in FP8: E4M3 vs E5M2, per-group G=128, with and without
dynamic range expansion (the COAT paper's Table/Figure on moment quantization, checked rather than assumed).

The moments come from a short training run of the default model (GPT(ModelConfig()), torch AdamW) on the
default corpus (Python stdlib sources, megacoat.data.prepare_default_corpus). Each parameter's moment is
quantized as CoatAdamW stores it (its reference quantizer, megacoat.ops.coat_adamw_ref): flattened, 1xG groups,
the last group shorter. Error = sum((x^-x)^2) /
sum(x^2) over all parameters; also the error this causes in Adam's update direction m / (sqrt(v) + eps).
CPU is fine (~12 min on 2 cores):
    python -m benchmarks.optimizer.quant_error [--steps 200] [--out benchmarks/results/fp8_quant_error]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

from megacoat.data import GPTDataset, IndexedDataset, prepare_default_corpus
from megacoat.ops.coat_adamw_ref import dequantize_moment_ref, quantize_moment_ref
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT

G = 128
EPS = 1e-8


def train(steps: int, batch: int, snapshots: list[int], seed: int = 0):
    """Yield (step, optimizer) at each snapshot step of an AdamW run of the default model."""
    torch.manual_seed(seed)
    cfg = ModelConfig()
    corpus = prepare_default_corpus(progress=False)
    indexed = IndexedDataset(corpus.data_prefix)
    data = GPTDataset(indexed, 0, len(indexed), cfg.seq_length, steps * batch, seed, name="fp8_quant_error")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1)
    for step in range(1, steps + 1):
        tokens = torch.from_numpy(np.stack([data[(step - 1) * batch + i] for i in range(batch)])).long()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step in snapshots:
            yield step, loss.item(), opt


FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def rel_err(x: torch.Tensor, xh: torch.Tensor) -> float:
    return float((xh.double() - x.double()).square().sum() / x.double().square().sum())


def measure(opt) -> dict:
    return measure_moments([s["exp_avg"].reshape(-1) for s in opt.state.values()],
                           [s["exp_avg_sq"].reshape(-1) for s in opt.state.values()])


def measure_moments(ms: list[torch.Tensor], vs: list[torch.Tensor]) -> dict:
    """Relative MSE of the first (ms) and second (vs) moments, each tensor quantized on its own in 1xG groups,
    in E4M3 and E5M2, with and without expansion; also the error of the update m / (sqrt(v) + eps)."""
    m_all, v_all = torch.cat(ms), torch.cat(vs)
    out = {"numel": m_all.numel()}
    update = m_all / (v_all.sqrt() + EPS)
    for fmt in ("e4m3", "e5m2"):
        for expand in (False, True):
            dtype = FP8[fmt]
            stored = {id(x): quantize_moment_ref(x, dtype, G, expand)[:3] for x in ms + vs}
            mh = torch.cat([dequantize_moment_ref(*stored[id(m)], G) for m in ms])
            vh = torch.cat([dequantize_moment_ref(*stored[id(v)], G) for v in vs])
            key = f"{fmt}{'_expand' if expand else ''}"
            ks = [stored[id(x)][2].float() for x in ms + vs] if expand else None
            out[key] = {
                "m_rel_mse": rel_err(m_all, mh), "v_rel_mse": rel_err(v_all, vh),
                # What Adam applies: the update direction with both moments quantized the same way.
                "update_rel_mse": rel_err(update, mh / (vh.clamp_min(0).sqrt() + EPS)),
                "v_zero_fraction": float(((vh == 0) & (v_all != 0)).double().mean()),
            }
            if ks is not None:
                km = torch.cat(ks[:len(ms)])
                kv = torch.cat(ks[len(ms):])
                out[key]["k_m_median"] = float(km.median())
                out[key]["k_v_median"] = float(kv.median())
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = res["snapshots"][-1]
    variants = ["e4m3", "e5m2", "e4m3_expand", "e5m2_expand"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, metric, title in zip(axes, ["m_rel_mse", "v_rel_mse", "update_rel_mse"],
                                 ["first moment m", "second moment v", "update m / (sqrt(v) + eps)"]):
        vals = [last[v][metric] for v in variants]
        bars = ax.bar(variants, vals, color=["C0", "C1", "C2", "C3"])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel("relative MSE  sum((x^-x)^2) / sum(x^2)")
        ax.tick_params(axis="x", rotation=20)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2e}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"FP8 per-group (G={G}) quantization of AdamW moments, default model, step {last['step']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/fp8_quant_error", help="path prefix for .json / .png")
    args = ap.parse_args()
    snapshots = sorted({max(1, args.steps // 6), args.steps // 2, args.steps})
    res = {"device": "cpu", "torch": torch.__version__, "python": platform.python_version(),
           "command": " ".join(sys.argv), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "model": "GPT(ModelConfig()) defaults", "optimizer": "torch AdamW lr 1e-3 betas (0.9, 0.95) wd 0.1",
           "data": "default corpus (Python stdlib sources)", "group_size": G, "batch": args.batch,
           "metric": "relative MSE = sum((x^-x)^2) / sum(x^2) over all parameters", "snapshots": []}
    t0 = time.time()
    for step, loss, opt in train(args.steps, args.batch, snapshots):
        r = measure(opt)
        r.update(step=step, loss=loss)
        res["snapshots"].append(r)
        print(f"step {step:4d} loss {loss:.3f} ({time.time() - t0:.0f}s)")
        for v in ("e4m3", "e5m2", "e4m3_expand", "e5m2_expand"):
            print(f"  {v:12s} m {r[v]['m_rel_mse']:.3e}  v {r[v]['v_rel_mse']:.3e}  "
                  f"update {r[v]['update_rel_mse']:.3e}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, args.out + ".png")
    print(f"wrote {args.out}.json and .png")


if __name__ == "__main__":
    main()
