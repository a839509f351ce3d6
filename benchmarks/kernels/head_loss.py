"""The FP8 head's own kernels per call (--fp8-output-layer), per tile, at the 1.3 B model's micro-batch 32 (65,536
tokens, hidden 2,048, vocabulary 32,000):

* corrections: megacoat.ops.label_corrections, the kernel against the torch reference (the path it replaced: eight
  kernels a piece of tokens), with labels drawn uniformly (as --mock-data's) and Zipf-like (as text's: a few labels
  take many tokens, so dW's atomics collide); each tile must match the reference within the kernel's own test bounds;
* stats: cross_entropy_fp8's forward pass (loss, log-sum-exp, the gradient's amax), per BLOCK:WARPS; each setting
  must give the library setting's amax and log-sum-exp within float32's reordering (2^-20 relative);
* grad: its backward cast (the E5M2 gradient in both layouts and the label residuals), per BM:BN:WARPS; each tile
  must write the library tile's bytes.

Each call is timed inside a CUDA graph, repeated; a device copy of the logits' bytes is the yardstick. The library's
setting comes first in each group.

    python -m benchmarks.kernels.head_loss [--parts corrections stats grad] [--repeats 3]
        [--sweep-corrections 64:128:4 ...] [--sweep-stats 8192:16 ...] [--sweep-grad 128:128:8 ...]
        [--out benchmarks/results/bench_head_loss.json]
    python -m benchmarks.kernels.head_loss --cpu-smoke   # no GPU: tiny shapes under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import statistics
import sys

# first: under --cpu-smoke it sets TRITON_INTERPRET before any kernel is defined
from benchmarks.common import SweepLog, best_rows, parse_tile, same_bytes, start, time_call_ms

import torch

from megacoat.ops import cross_entropy_fp8 as ce
from megacoat.ops import label_corrections as lc

SHAPE = ("1.3B mb32", 32 * 2048, 2048, 32000)  # name, tokens, hidden, vocabulary
SMOKE = ("smoke", 96, 64, 300)
PARTS = ("corrections", "stats", "grad")


def _labels(t: int, v: int, dist: str, device: str) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1)
    if dist == "uniform":
        return torch.randint(0, v, (t,), generator=g).to(device)
    weights = 1.0 / torch.arange(1, v + 1, dtype=torch.float64)  # Zipf, exponent 1: the top label ~9% at 32 k
    return torch.multinomial(weights, t, replacement=True, generator=g).to(device)


def _median_ms(fn, repeats: int, device: str) -> tuple[float, list[float]]:
    times = [time_call_ms(fn, device) for _ in range(repeats)]
    return statistics.median(times), times


def corrections_rows(shape, tiles, repeats, device):
    name, t, h, v = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    dx = torch.randn(t, h, generator=g).bfloat16().to(device)
    dw = torch.randn(v, h, generator=g).bfloat16().to(device)
    weight = torch.randn(v, h, generator=g).bfloat16().to(device)
    residual = (torch.randn(t, generator=g) * 1e-2).to(device)
    x8t = (torch.randn(h, t, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)  # no NaN codes
    xs = torch.tensor([0.01], device=device)
    moved = 2 * t * h * 3 + t * h + 4 * t * h + 4 * v * h * 2 + 2 * v * h * 2  # dx r/w, W rows, x, atomics, dW
    rows = []
    tdx, tdw = dx.clone(), dw.clone()  # the timed calls add into these, the checked ones start from dx and dw
    for dist in ("uniform", "zipf"):
        label = _labels(t, v, dist, device)
        ref = [dx.clone(), dw.clone()]
        lc.label_corrections_ref(*ref, residual, label, weight, x8t, xs)
        ms, times = _median_ms(lambda: lc.label_corrections_ref(tdx, tdw, residual, label, weight, x8t, xs),
                               repeats, device)
        rows.append({"part": "corrections", "shape": name, "labels": dist, "setting": "torch reference",
                     "library": False, "ms": ms, "ms_repeats": times, "same_bytes": True})
        for tile in tiles:
            out = [dx.clone(), dw.clone()]
            lc.label_corrections_triton(*out, residual, label, weight, x8t, xs, tile=tile)
            # dx within a bf16 step, plus the product's float32 rounding that a fused multiply-add skips (it is many
            # steps where the sum nearly cancels; tests/ops/test_label_corrections.py); dW's sums reordered
            apart = (out[0].float() - ref[0].float()).abs()
            bound = (2 ** -7 * torch.maximum(out[0].float().abs(), ref[0].float().abs())
                     + 2 ** -22 * (residual[:, None] * weight.float()[label]).abs())
            dw_err = ((out[1].float() - ref[1].float()).norm() / ref[1].float().norm()).item()
            ok = bool((apart <= bound).all()) and dw_err <= 2 ** -8
            del apart, bound
            ms, times = _median_ms(lambda: lc.label_corrections_triton(tdx, tdw, residual, label, weight, x8t, xs,
                                                                       tile=tile), repeats, device)
            rows.append({"part": "corrections", "shape": name, "labels": dist,
                         "setting": {"BT": tile[0], "BK": tile[1], "warps": tile[2]},
                         "library": tile == lc.tiles()["corrections"], "ms": ms, "ms_repeats": times,
                         "same_bytes": ok, "dx_changed_share": (out[0] != ref[0]).float().mean().item(),
                         "dw_rel_err": dw_err, "bytes": moved, "gb_per_s": moved / (ms * 1e-3) / 1e9})
    return rows


def _logits(shape, device):
    _, t, _, v = shape
    g = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(t, v, device=device, generator=g)).bfloat16()
    return logits, _labels(t, v, "zipf", device)


def stats_rows(shape, settings, repeats, device, logits, labels):
    rows = []
    library = ce.tiles()["stats"]
    base = ce.cross_entropy_stats_triton(logits, labels, -100)
    for setting in settings:
        ce.set_tile("stats", setting)
        try:
            loss, lse, amax = ce.cross_entropy_stats_triton(logits, labels, -100)
            ok = all(torch.allclose(a, b, rtol=2 ** -20, atol=0) for a, b in zip((loss, lse, amax), base))
            ms, times = _median_ms(lambda: ce.cross_entropy_stats_triton(logits, labels, -100), repeats, device)
        finally:
            ce.set_tile("stats", library)
        moved = logits.numel() * logits.element_size()
        rows.append({"part": "stats", "shape": shape[0], "setting": {"BLOCK": setting[0], "warps": setting[1]},
                     "library": setting == library, "ms": ms, "ms_repeats": times, "same_bytes": ok,
                     "bytes": moved, "gb_per_s": moved / (ms * 1e-3) / 1e9})
    return rows


def grad_rows(shape, tiles, repeats, device, logits, labels):
    rows = []
    library = ce.tiles()["grad"]
    _, lse, amax = ce.cross_entropy_stats_triton(logits, labels, -100)
    coef = torch.tensor([1.0 / labels.numel()], device=device)
    args = (logits, labels, lse, amax, coef, torch.float8_e5m2, -100)
    base = ce.cross_entropy_grad_fp8_triton(*args)
    for tile in tiles:
        ce.set_tile("grad", tile)
        try:
            out = ce.cross_entropy_grad_fp8_triton(*args)
            ok = all(same_bytes(a, b) for a, b in zip(out, base))
            del out
            ms, times = _median_ms(lambda: ce.cross_entropy_grad_fp8_triton(*args), repeats, device)
        finally:
            ce.set_tile("grad", library)
        moved = 2 * logits.numel() * logits.element_size()  # the logits read, two FP8 layouts written
        rows.append({"part": "grad", "shape": shape[0], "setting": {"BM": tile[0], "BN": tile[1], "warps": tile[2]},
                     "library": tile == library, "ms": ms, "ms_repeats": times, "same_bytes": ok, "bytes": moved,
                     "gb_per_s": moved / (ms * 1e-3) / 1e9})
    return rows


def copy_row(shape, repeats, device, logits):
    dst = torch.empty_like(logits)
    ms, times = _median_ms(lambda: dst.copy_(logits), repeats, device)
    moved = 2 * logits.numel() * logits.element_size()
    return {"part": "copy", "shape": shape[0], "setting": "logits copy", "library": False, "ms": ms,
            "ms_repeats": times, "same_bytes": True, "bytes": moved, "gb_per_s": moved / (ms * 1e-3) / 1e9}


def _describe(r) -> str:
    s = r["setting"]
    setting = s if isinstance(s, str) else " ".join(f"{k} {v}" for k, v in s.items())
    rate = f"  {r['gb_per_s']:6.0f} GB/s" if "gb_per_s" in r else ""
    labels = f" {r['labels']:7s}" if "labels" in r else ""
    return f"{r['part']:11s}{labels} {setting:24s} {r['ms'] * 1e3:9.1f} us{rate}  ok: {r['same_bytes']}"


def summary(rows: list[dict]) -> list[str]:
    """The fastest setting per part (and label distribution) against the library's, then the corrections' kernel
    against the torch path it replaced."""
    group = (lambda r: (r["part"], r.get("labels")))
    tiles = [r for r in rows if not isinstance(r["setting"], str)]  # not the torch path, not the copy
    lines = [f"best {' '.join(k for k in key if k)}: {_describe(best)}, x{speedup:.3f} the library's"
             for key, best, speedup, _ in best_rows(tiles, group, lambda r: r["ms"], lambda r: r["library"])]
    for dist in ("uniform", "zipf"):
        torch_ms = [r["ms"] for r in rows if r.get("labels") == dist and r["setting"] == "torch reference"]
        kernel_ms = [r["ms"] for r in rows if r.get("labels") == dist and r["library"]]
        if torch_ms and kernel_ms:
            lines.append(f"corrections {dist}: the kernel x{torch_ms[0] / kernel_ms[0]:.2f} "
                         "the torch reference's speed")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep-corrections", nargs="*", default=[], metavar="BT:BK:WARPS")
    p.add_argument("--sweep-stats", nargs="*", default=[], metavar="BLOCK:WARPS")
    p.add_argument("--sweep-grad", nargs="*", default=[], metavar="BM:BN:WARPS")
    p.add_argument("--out", default="benchmarks/results/bench_head_loss.json")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    started = start(args.cpu_smoke, lambda: (
        [lc.tiles()["corrections"]] + [parse_tile(t, "--sweep-corrections", ("BT", "BK", "WARPS"), 16)
                                         for t in args.sweep_corrections],
        [ce.tiles()["stats"]] + [parse_tile(t, "--sweep-stats", ("BLOCK", "WARPS"), 32)
                                                for t in args.sweep_stats],
        [ce.tiles()["grad"]] + [parse_tile(t, "--sweep-grad", ("BM", "BN", "WARPS"), 16)
                                        for t in args.sweep_grad]))
    if started is None:
        return 2
    device, (corr, stats, grad) = started
    shape, repeats = (SMOKE, 1) if args.cpu_smoke else (SHAPE, args.repeats)
    log = SweepLog(args.out, device,
                   "the FP8 head's kernels per call: label corrections, the loss's stats, the gradient's cast",
                   shape=dict(zip(("name", "tokens", "hidden", "vocab"), shape)))

    def add(new):
        for r in new:
            log.add(r)
            print(_describe(r), flush=True)

    if "corrections" in args.parts:
        add(corrections_rows(shape, corr, repeats, device))
    if "stats" in args.parts or "grad" in args.parts:
        logits, labels = _logits(shape, device)
        add([copy_row(shape, repeats, device, logits)])
        if "stats" in args.parts:
            add(stats_rows(shape, stats, repeats, device, logits, labels))
        if "grad" in args.parts:
            add(grad_rows(shape, grad, repeats, device, logits, labels))
    return log.finish(summary(log.rows))


if __name__ == "__main__":
    sys.exit(main())
