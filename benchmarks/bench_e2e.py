"""End-to-end speed: the same model and data trained through `pretrain_gpt.py` in three modes,
`bf16`, `fp8-linear` (FP8 GEMMs, BF16 activations) and `coat` (CoatAdamW + the FP8 precision flow).
Loss fidelity (several seeds, a fixed held-out set, confidence intervals) is benchmarks/fidelity.py.

    # (a) equal micro-batch and (b) each mode's largest micro-batch, ~1.3 B model, mock tokens
    python benchmarks/bench_e2e.py speed --micro-batch-size 4 --search 4,8,12,16,24 --compile

Every run is a separate `pretrain_gpt.py` process (nothing leaks between modes); figures come from its
`--log-json`: tokens/s is the mean over the logged intervals after the first (which holds compilation and
warm-up), memory is `torch.cuda.max_memory_allocated`. Ratios are within this one invocation, same GPU.
Writes JSON under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

MODES = {
    "bf16": [],
    "fp8-linear": ["--fp8-activations", "fp8-linear"],
    "coat": ["--coat-fp8"],
    # the same without the per-step FP8 weight copies (2 B per block-linear parameter): the memory-lean setting
    "coat-lean": ["--coat-fp8", "--fp8-weight-cache", "none"],
}
MODEL_1P3B = ["--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads", "16",
              "--seq-length", "2048", "--vocab-size", "32000"]
MODEL_TINY = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "64", "--vocab-size", "256"]  # a CPU smoke test of this script


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import deepspeed
        import triton

        env.update(deepspeed=deepspeed.__version__, triton=triton.__version__)
    except ImportError:
        pass
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(), gpus_on_host=torch.cuda.device_count(), cuda=torch.version.cuda)
    return env


def run_pretrain(argv: list[str], timeout: int, profile_steps: tuple[int, int] | None = None) -> dict:
    """One pretrain_gpt.py process; returns its JSON-log records, or the reason it failed ('oom' or text).
    profile_steps (start, end): torch.profiler over iterations (start, end]; the logged intervals that overlap
    them are left out of tokens/s, and the top operators by device time are returned under "profile"."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--log-json", log]
        if profile_steps:
            cmd += ["--profile-dir", os.path.join(tmp, "profile"), "--profile-step-start", str(profile_steps[0]),
                    "--profile-step-end", str(profile_steps[1])]
        print("$", " ".join(cmd[1:]), flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timeout after {timeout}s", "argv": argv}
        if proc.returncode != 0:
            return failure(proc.stdout[-4000:] + proc.stderr[-4000:], argv)
        records = [json.loads(line) for line in open(log)]
        profile = top_operators(os.path.join(tmp, "profile", "top_ops_rank0.json")) if profile_steps else None
    train = [r for r in records if "loss" in r]
    return {
        "ok": True, "argv": argv, "profile": profile,
        **throughput(train, profile_steps[0] if profile_steps else None),
        "max_memory_gib": max(r["max_memory_bytes"] for r in train) / 2**30,
        "losses": [(r["iteration"], r["loss"]) for r in train],
        "val_losses": [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r],
    }


def failure(output: str, argv: list[str], keep: int = 1500) -> dict:
    """A failed run: 'oom' when it ran out of GPU memory (what a micro-batch search stops at), else its output."""
    oom = "out of memory" in output.lower() or "OutOfMemoryError" in output
    return {"ok": False, "error": "oom" if oom else output[-keep:], "argv": argv}


def throughput(train: list[dict], last_iteration: int | None = None) -> dict:
    """Mean tokens/s, TFLOP/s per GPU and MFU over the logged intervals after the first (warm-up and
    compilation); with last_iteration, only intervals ending there or before (later ones hold profiled steps)."""
    steady = train[1:] or train
    if last_iteration is not None:
        steady = [r for r in steady if r["iteration"] <= last_iteration] or steady
    return {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in steady),
            "tflops_per_gpu": statistics.mean(r["tflops_per_gpu"] for r in steady),
            "mfu": None if steady[0]["mfu"] is None else statistics.mean(r["mfu"] for r in steady)}


def top_operators(path: str, top: int = 15) -> dict | None:
    """Where a step's time goes: the profiled window's operators and kernels by self device time, per step."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        prof = json.load(f)
    steps = prof["steps"][1] - prof["steps"][0] + 1
    return {"steps": prof["steps"], "time": prof["time"], "ms_per_step": prof["total_self_us"] / 1e3 / steps,
            "top": [{"name": r["name"][:120], "calls_per_step": r["calls"] / steps,
                     "ms_per_step": r["self_us"] / 1e3 / steps, "share": round(r["share"], 4)}
                    for r in prof["top"][:top]]}


def memory_model(argv: list[str]) -> dict:
    """megacoat.training.memory's estimate for one run's flags (eager activations; GiB): where memory goes."""
    sys.path.insert(0, ROOT)
    from megacoat.arguments import parse_config
    from megacoat.training.memory import estimate_memory

    cfg = parse_config(argv)
    est = estimate_memory(cfg.model, cfg.fp8.mode, micro_batch_size=cfg.training.micro_batch_size,
                          zero_stage=cfg.parallel.zero_stage, fp8_optimizer=cfg.optim.fp8_optimizer,
                          fp8_group_size=cfg.optim.fp8_group_size, bf16=cfg.training.precision != "fp32",
                          fp8_weight_cache=cfg.fp8.weight_cache)
    return {k: v / 2**30 for k, v in est.as_dict().items()}


def compiled_modes(args) -> list[str]:
    if args.compile is None:
        return []
    return list(args.compile) or list(MODES)


def mode_flags(mode: str, args) -> list[str]:
    return MODES[mode] + (["--compile"] if mode in compiled_modes(args) else [])


def speed(args) -> dict:
    model = MODEL_TINY if args.tiny else MODEL_1P3B
    common = model + ["--bf16" if not args.tiny else "--fp32", "--mock-data", "--zero-stage", str(args.zero_stage), "--eval-iters", "0",
                           "--train-iters", str(args.iters), "--log-interval", str(args.log_interval)]
    out = {"environment": environment(), "model": " ".join(model),
           "zero_stage": args.zero_stage, "compiled_modes": compiled_modes(args), "equal_micro_batch": {}, "largest_micro_batch": {}}
    mbs = args.micro_batch_size
    profile = (args.iters - 2, args.iters) if args.profile else None
    for mode in args.modes:
        argv = common + mode_flags(mode, args) + ["--micro-batch-size", str(mbs),
                                                  "--global-batch-size", str(mbs * args.grad_accum)]
        res = run_pretrain(argv, args.timeout, profile)
        out["equal_micro_batch"][mode] = dict(res, micro_batch_size=mbs, memory_model_gib=memory_model(argv))
        print(mode, {k: res.get(k) for k in ("tokens_per_s", "mfu", "max_memory_gib", "error")}, flush=True)
    base = out["equal_micro_batch"].get("bf16", {})
    if base.get("ok"):
        for mode, res in out["equal_micro_batch"].items():
            if res.get("ok"):
                res["speedup_vs_bf16"] = res["tokens_per_s"] / base["tokens_per_s"]
                res["memory_reduction_vs_bf16"] = base["max_memory_gib"] / res["max_memory_gib"]
    if args.search:
        sizes = [int(s) for s in args.search.split(",")]
        for mode in args.modes:
            best = None
            for size in sizes:
                res = run_pretrain(common + mode_flags(mode, args) + ["--micro-batch-size", str(size),
                                                           "--global-batch-size", str(size * args.grad_accum)],
                                   args.timeout)
                print(mode, size, {k: res.get(k) for k in ("tokens_per_s", "max_memory_gib", "error")}, flush=True)
                if not res["ok"]:
                    if res["error"] != "oom":
                        best = best or dict(res, micro_batch_size=size)
                    break
                best = dict(res, micro_batch_size=size, searched=sizes)
            out["largest_micro_batch"][mode] = best
        base = out["largest_micro_batch"].get("bf16")
        if base and base.get("ok"):
            for res in out["largest_micro_batch"].values():
                if res and res.get("ok"):
                    res["speedup_vs_bf16_at_its_largest"] = res["tokens_per_s"] / base["tokens_per_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--micro-batch-size", type=int, default=4)
    s.add_argument("--grad-accum", type=int, default=2)
    s.add_argument("--search", default="", help="comma-separated micro-batch sizes to try, ascending")
    s.add_argument("--iters", type=int, default=12)
    s.add_argument("--log-interval", type=int, default=3)
    s.add_argument("--zero-stage", type=int, default=1)
    s.add_argument("--tiny", action="store_true", help="a tiny fp32 model: checks this script on a CPU")
    s.add_argument("--profile", action="store_true",
                   help="profile the last 2 iterations of each equal-micro-batch run (left out of tokens/s) and keep "
                        "the top operators by device time in the JSON: where the time goes")
    s.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    s.add_argument("--compile", nargs="*", default=None, choices=list(MODES), metavar="MODE",
                   help="--compile for these modes (flag alone: all). The FP8 modes run their own fused "
                        "Triton kernels and are measured eager unless named")
    s.add_argument("--timeout", type=int, default=600)
    s.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/bench_e2e_<what>.json)")
    args = p.parse_args()
    result = speed(args)
    path = args.out or os.path.join(RESULTS, f"bench_e2e_{args.what}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
