"""Training quality of CoatAdamW: the same model, seed and data trained by pretrain_gpt.py with torch AdamW (fp32
moments), CoatAdamW (FP8 moments with expansion) and CoatAdamW without expansion. Writes the loss curves and the
final losses (mean of the last 10% of iterations, and the last validation loss) as JSON and a PNG.

    python -m benchmarks.optimizer.quality [--train-iters 200] [--name default] [-- <extra pretrain_gpt.py flags>]

Target: CoatAdamW's final loss within 1% of AdamW's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from benchmarks.common import ROOT  # noqa: E402
RUNS = {
    "AdamW": [],
    "CoatAdamW": ["--fp8-optimizer"],
    "CoatAdamW (no expansion)": ["--fp8-optimizer", "--fp8-no-expansion"],
}


def train(name: str, flags: list[str], args, workdir: str) -> dict:
    log = os.path.join(workdir, name.replace(" ", "_").replace("(", "").replace(")", "") + ".jsonl")
    if os.path.exists(log):
        os.remove(log)
    eval_interval = max(1, args.train_iters // 4)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--train-iters", str(args.train_iters),
           "--seed", str(args.seed), "--log-interval", "1", "--eval-interval", str(eval_interval),
           "--log-json", log] + flags + args.extra
    t0 = time.time()
    pythonpath = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=workdir, env=dict(os.environ, PYTHONPATH=pythonpath), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in open(log)]
    train_recs = [r for r in records if "loss" in r]
    val = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    losses = [r["loss"] for r in train_recs]
    tail = max(1, len(losses) // 10)
    return dict(name=name, flags=flags, command=" ".join(cmd), seconds=round(time.time() - t0, 1),
                iterations=[r["iteration"] for r in train_recs], loss=losses,
                final_train_loss=sum(losses[-tail:]) / tail, val_loss=val,
                final_val_loss=val[-1][1] if val else None,
                max_memory_bytes=max((r.get("max_memory_bytes") or 0) for r in train_recs))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-iters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--name", default="default", help="suffix of the result files")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--workdir", default=None, help="where the runs write logs (default: a folder in out-dir)")
    args = ap.parse_args(argv)
    args.extra = extra
    workdir = args.workdir or os.path.join(args.out_dir, f"optimizer_quality_{args.name}_runs")
    os.makedirs(workdir, exist_ok=True)
    runs = [train(name, flags, args, workdir) for name, flags in RUNS.items()]
    base = runs[0]
    for r in runs:
        r["final_train_loss_rel_to_adamw"] = r["final_train_loss"] / base["final_train_loss"] - 1
        if r["final_val_loss"] is not None and base["final_val_loss"]:
            r["final_val_loss_rel_to_adamw"] = r["final_val_loss"] / base["final_val_loss"] - 1
    import torch

    result = dict(benchmark="optimizer_quality", name=args.name, command=" ".join([sys.executable] + sys.argv),
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
                  torch=torch.__version__, python=platform.python_version(),
                  date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), train_iters=args.train_iters,
                  seed=args.seed, extra_flags=extra, target="CoatAdamW final loss within 1% of AdamW",
                  runs=runs)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"optimizer_quality_{args.name}")
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs:
            ax.plot(r["iterations"], r["loss"], label=f"{r['name']} (final {r['final_train_loss']:.4f})", lw=1)
        ax.set_xlabel("iteration")
        ax.set_ylabel("training loss")
        ax.set_title(f"optimizer quality ({args.name}, {result['device']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")
    print(f"{'optimizer':28s} {'final train':>12s} {'vs AdamW':>9s} {'final val':>10s} {'vs AdamW':>9s} {'s':>6s}")
    for r in runs:
        fv = r["final_val_loss"]
        print(f"{r['name']:28s} {r['final_train_loss']:12.4f} {100 * r['final_train_loss_rel_to_adamw']:8.2f}% "
              f"{fv if fv is not None else float('nan'):10.4f} "
              f"{100 * r.get('final_val_loss_rel_to_adamw', float('nan')):8.2f}% {r['seconds']:6.1f}")


if __name__ == "__main__":
    main()
