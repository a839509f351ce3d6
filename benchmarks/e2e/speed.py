"""End-to-end speed and memory: the same model trained by each recipe (benchmarks/suite.py's RECIPES), every run a
separate process. Loss fidelity is benchmarks/fidelity/loss.py.

    # 1.3 B model, micro-batch 8: compiled bf16 against the default, 2 repeats of 30 timed iterations
    python -m benchmarks.e2e.speed --model 1.3b --micro-batch-size 8 --modes bf16 coat
    # the largest micro-batch of each mode (one run per size, up to the first that runs out of memory)
    python -m benchmarks.e2e.speed --model 1.3b --micro-batch-size 8 --search 8,12,16,24 --modes bf16 coat
    # each mode at its own largest micro-batch, measured as a point is (repeats interleaved)
    python -m benchmarks.e2e.speed --model 1.3b --at-largest bf16@16 coat@32

Speed method: each point (mode, micro-batch) runs --repeats times, each in its own process, repeats interleaved
with the other modes so that a drift of the machine spreads over all of them. A run trains --warmup iterations
(compilation, allocator warm-up), then --iters timed ones; its throughput is the tokens of the timed window over
its wall time, from the --log-json lines. A point reports the median of the timed intervals of all its repeats and
the spread of its repeats' window throughputs. With --profile the first repeat runs 3 more iterations under
torch.profiler (never timed). Memory is torch.cuda.max_memory_allocated, with max_memory_reserved beside it (a CUDA
graph's replays do not call the allocator). Ratios are against --baseline at the same micro-batch, within this one
invocation. The JSON (device, versions, command) is rewritten after every run, so a time limit keeps what ran.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import RESULTS, ROOT, environment
from benchmarks.suite import GRAPH_FLAG, MODELS, RECIPES

PROFILED_STEPS = 3


def mode_command(mode: str, cuda_graphs: bool = True) -> tuple[str, list[str]]:
    """(script, flags) of a recipe; without cuda_graphs, its flags less --enable-cuda-graph."""
    script, flags = RECIPES[mode]
    return script, [f for f in flags if cuda_graphs or f != GRAPH_FLAG]


def cpu_check_flags(flags: list[str]) -> list[str]:
    """A recipe's flags for the tiny CPU check of a script: eager, without the GPU-only ones."""
    return [f for f in flags if f not in (GRAPH_FLAG, "--compile")]


def sized_mode(spec: str) -> tuple[str, int]:
    """`MODE@MICRO_BATCH` (argparse type) -> (mode, micro-batch size)."""
    mode, at, size = spec.rpartition("@")
    if not at or not size.isdigit() or int(size) < 1 or mode not in RECIPES:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected MODE@MICRO_BATCH with MODE one of {', '.join(RECIPES)}")
    return mode, int(size)


def script_command(script: str) -> list[str]:
    """The interpreter's arguments that start a script: a file under the repository or a module (-m)."""
    return [os.path.join(ROOT, script)] if script.endswith(".py") else ["-m", script]


def run_pretrain(argv: list[str], timeout: int, profile_steps: tuple[int, int] | None = None,
                 script: str = "pretrain_gpt.py", trace_to: str | None = None) -> dict:
    """One training process (pretrain_gpt.py or a launcher with its flags); returns its JSON-log records, or
    the reason it failed ('oom' or text). profile_steps (start, end): torch.profiler over iterations
    (start, end], whose summary (top operators, GPU-busy fraction) is returned under "profile"; trace_to: where
    to keep its Chrome trace, gzipped."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, *script_command(script), *argv, "--log-json", log]
        if profile_steps:
            cmd += ["--profile-dir", os.path.join(tmp, "profile"), "--profile-step-start", str(profile_steps[0]),
                    "--profile-step-end", str(profile_steps[1])]
        print("$", " ".join(cmd[1:]), flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=run_env())
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timeout after {timeout}s", "argv": argv}
        if proc.returncode != 0:
            return failure(proc.stdout[-4000:] + proc.stderr[-4000:], argv)
        records = [json.loads(line) for line in open(log)]
        profile = top_operators(os.path.join(tmp, "profile", "top_ops_rank0.json")) if profile_steps else None
        trace = os.path.join(tmp, "profile", "trace_rank0.json")
        if trace_to and os.path.exists(trace):
            os.makedirs(os.path.dirname(os.path.abspath(trace_to)), exist_ok=True)
            with open(trace, "rb") as src, gzip.open(trace_to, "wb") as dst:
                shutil.copyfileobj(src, dst)
    train = [r for r in records if "loss" in r]
    return {
        "ok": True, "argv": argv, "script": script, "wall_s": time.perf_counter() - t0, "profile": profile,
        "max_memory_gib": max(r["max_memory_bytes"] for r in train) / 2**30,
        "max_memory_reserved_gib": _largest([r.get("max_memory_reserved_bytes") for r in train], scale=2**-30),
        "losses": [(r["iteration"], r["loss"]) for r in train],
        "val_losses": [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r],
        "records": train,
    }


def _largest(values: list, scale: float = 1.0) -> float | None:
    """The largest of the values that were recorded (None where there is none to record, as the reserved peak on a
    CPU), times scale."""
    have = [v for v in values if v is not None]
    return max(have) * scale if have else None


def run_env() -> dict:
    """Every mode's process gets the trainer's CUDA allocator settings (expandable segments unless the caller set
    PYTORCH_CUDA_ALLOC_CONF), plain-llama too, which does not go through the trainer."""
    from megacoat.training.runtime import default_allocator_settings

    env = dict(os.environ)
    default_allocator_settings(env)
    return env


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
    """Where a step's time goes: the profiled window's operators and kernels by self device time, per step, and
    the window's device summary (GPU-busy fraction, kernels and host waits per step; profiling.py)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        prof = json.load(f)
    steps = prof["steps"][1] - prof["steps"][0] + 1
    return {"steps": prof["steps"], "time": prof["time"], "ms_per_step": prof["total_self_us"] / 1e3 / steps,
            "device": prof.get("device"),
            "top": [{"name": r["name"][:120], "calls_per_step": r["calls"] / steps,
                     "ms_per_step": r["self_us"] / 1e3 / steps, "share": round(r["share"], 4)}
                    for r in prof["top"][:top]]}


def timed_window(records: list[dict], first: int, last: int) -> dict | None:
    """Throughput over iterations (first, last] from the log lines that close intervals inside it: tokens over
    wall time (each interval weighted by its length, i.e. the harmonic mean of the interval rates), the
    intervals themselves, and MFU scaled alike. None when the log does not cover the window."""
    rows = [r for r in records if first < r["iteration"] <= last]
    if not rows or rows[-1]["iteration"] != last:
        return None
    lengths = [b["iteration"] - a for a, b in zip([first] + [r["iteration"] for r in rows[:-1]], rows)]
    seconds_per_token = sum(n / r["tokens_per_s"] for n, r in zip(lengths, rows)) / sum(lengths)
    rate = 1 / seconds_per_token
    mfu = None if rows[0]["mfu"] is None else rate * rows[0]["mfu"] / rows[0]["tokens_per_s"]
    return {"tokens_per_s": rate, "mfu": mfu, "iterations": last - first,
            "intervals_tokens_per_s": [r["tokens_per_s"] for r in rows]}


def summarize(runs: list[dict], num_layers: int) -> dict:
    """One point from its repeats: median over all timed intervals, spread of the repeats' window rates
    ((max - min) / median), the worst memory, and the first profile with kernels per layer."""
    ok = [r for r in runs if r.get("ok") and r.get("window")]
    if not ok:
        first = runs[0] if runs else {}
        return {"ok": False, **{k: first[k] for k in ("error", "skipped") if k in first}, "runs": runs}
    intervals = [x for r in ok for x in r["window"]["intervals_tokens_per_s"]]
    rates = [r["window"]["tokens_per_s"] for r in ok]
    median = statistics.median(intervals)
    out = {"ok": True, "repeats": len(ok), "tokens_per_s": median,
           "tokens_per_s_repeats": rates, "spread_repeats": (max(rates) - min(rates)) / statistics.median(rates),
           "spread_intervals": (max(intervals) - min(intervals)) / median,
           "max_memory_gib": max(r["max_memory_gib"] for r in ok),
           "max_memory_reserved_gib": _largest([r.get("max_memory_reserved_gib") for r in ok])}
    w = ok[0]["window"]
    out["mfu"] = None if w["mfu"] is None else median * w["mfu"] / w["tokens_per_s"]
    profile = next((r["profile"] for r in ok if r.get("profile")), None)
    if profile and profile.get("device"):
        profile["device"]["kernels_per_layer"] = profile["device"]["kernels_per_step"] / num_layers
    out["profile"] = profile
    out["runs"] = [{k: v for k, v in r.items() if k not in ("records", "profile")} for r in runs]
    return out


def save(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def memory_model(argv: list[str]) -> dict:
    """megacoat.training.memory's estimate for one run's flags (compiled or eager activations; GiB): where memory
    goes."""
    from megacoat.arguments import parse_config
    from megacoat.training.deepspeed_config import resolve_main_params
    from megacoat.training.memory import estimate_memory

    cfg = resolve_main_params(parse_config(argv), on_cuda=True)  # the runs' default master weights on the GPU
    bf16 = cfg.training.precision != "fp32"
    est = estimate_memory(cfg.model, cfg.fp8.mode, micro_batch_size=cfg.training.micro_batch_size,
                          zero_stage=cfg.parallel.zero_stage, fp8_optimizer=cfg.optim.fp8_optimizer,
                          fp8_group_size=cfg.optim.fp8_group_size, bf16=bf16,
                          fp8_weight_cache=cfg.fp8.weight_cache,
                          main_grads_dtype=cfg.optim.main_grads_dtype or ("bf16" if bf16 else "fp32"),
                          main_params_dtype=cfg.optim.main_params_dtype, compiled=cfg.training.compile,
                          graphed_accumulation=(cfg.training.enable_cuda_graph
                                                and cfg.training.gradient_accumulation_steps(1) > 1),
                          fp8_output_layer=cfg.fp8.output_layer)
    return {k: v / 2**30 for k, v in est.as_dict().items()}


def torchao_missing(spec: str) -> str | None:
    if spec == "torchao-float8" and importlib.util.find_spec("torchao") is None:
        from benchmarks.e2e.torchao_pretrain import MISSING

        return MISSING
    return None


def speed_run(spec: str, common: list[str], mbs: int, args, profile: bool) -> dict:
    """One process of one mode at one micro-batch size: its timed window (and profile)."""
    missing = torchao_missing(spec)
    if missing:
        print(f"{spec}: skipped: {missing}", flush=True)
        return {"ok": False, "skipped": missing}
    script, flags = mode_command(spec, cuda_graphs=not args.no_cuda_graph)
    if args.model == "tiny":
        flags = cpu_check_flags(flags)
    timed_end = args.warmup + args.iters
    extra = PROFILED_STEPS if profile else 0
    precision = ["--fp32" if args.model == "tiny" else "--bf16"]  # tiny: a CPU check of this script
    argv = common + precision + flags + ["--micro-batch-size", str(mbs), "--global-batch-size", str(mbs * args.grad_accum),
                             "--train-iters", str(timed_end + extra)]
    name = f"{spec}_mb{mbs}_zero{args.zero_stage}.json.gz"
    trace = os.path.join(args.traces, name) if profile and args.traces else None
    res = run_pretrain(argv, args.timeout, (timed_end, timed_end + extra) if profile else None, script, trace)
    if res["ok"]:
        res["window"] = timed_window(res["records"], args.warmup, timed_end)
        if res["window"] is None:
            res.update(ok=False, error=f"the log does not cover the timed iterations ({args.warmup}, {timed_end}]")
        if script.endswith(".py"):
            res["memory_model_gib"] = memory_model(argv)
    print(spec, mbs, {k: res.get(k) for k in ("max_memory_gib", "max_memory_reserved_gib", "error")},
          (res.get("window") or {}).get("tokens_per_s"), flush=True)
    return res


def speed(args) -> dict:
    model = MODELS[args.model]
    num_layers = int(model[model.index("--num-layers") + 1])
    common = model + ["--mock-data", "--zero-stage", str(args.zero_stage),
                      "--eval-iters", "0", "--log-interval", str(args.log_interval)]
    out = {"environment": environment(), "model_name": args.model, "model": " ".join(model),
           "zero_stage": args.zero_stage, "cuda_graphs": not args.no_cuda_graph,
           "method": {"warmup_iterations": args.warmup, "timed_iterations": args.iters,
                      "log_interval": args.log_interval, "repeats": args.repeats, "grad_accum": args.grad_accum,
                      "profiled_iterations": PROFILED_STEPS if args.profile else 0,
                      "statistic": "median of the timed log intervals of all repeats; spread = (max - min) / "
                                   "median of the repeats' window throughputs"},
           "baseline": args.baseline, "points": {}, "largest_micro_batch": {}}
    if args.at_largest:
        measure_at_largest(out, common, num_layers, args)
    for mbs in args.micro_batch_size:
        runs = {spec: [] for spec in args.modes}
        for repeat in range(args.repeats):
            for spec in args.modes:
                runs[spec].append(speed_run(spec, common, mbs, args, profile=args.profile and repeat == 0))
                point = out["points"][str(mbs)] = {s: summarize(r, num_layers) for s, r in runs.items() if r}
                base = point.get(args.baseline, {})
                for res in point.values():
                    if res["ok"] and base.get("ok"):
                        res["speedup_vs_baseline"] = res["tokens_per_s"] / base["tokens_per_s"]
                        res["memory_vs_baseline"] = res["max_memory_gib"] / base["max_memory_gib"]
                        reserved = res.get("max_memory_reserved_gib"), base.get("max_memory_reserved_gib")
                        if all(reserved):  # GPU runs (the reserved peak includes the CUDA graphs' pools)
                            res["reserved_vs_baseline"] = reserved[0] / reserved[1]
                save(out, args.path)
    for spec in args.modes if args.search else []:
        best = None
        for size in [int(s) for s in args.search.split(",")]:
            res = speed_run(spec, common, size, args, profile=False)
            if not res["ok"]:
                if res.get("error") != "oom":
                    best = best or dict(res, micro_batch_size=size)
                break
            best = dict(summarize([res], num_layers), micro_batch_size=size)
        out["largest_micro_batch"][spec] = best
        save(out, args.path)
    ratios_at_largest(out, args.baseline)
    return out


def measure_at_largest(out: dict, common: list[str], num_layers: int, args) -> None:
    """--at-largest: each mode at its own micro-batch (its largest, from --search or the memory estimator),
    --repeats runs each, interleaved as a point's are; into out["largest_micro_batch"]."""
    sizes = dict(args.at_largest)
    runs = {spec: [] for spec in sizes}
    for _ in range(args.repeats):
        for spec, size in sizes.items():
            runs[spec].append(speed_run(spec, common, size, args, profile=False))
            out["largest_micro_batch"][spec] = dict(summarize(runs[spec], num_layers), micro_batch_size=size)
            ratios_at_largest(out, args.baseline)
            save(out, args.path)


def ratios_at_largest(out: dict, baseline: str) -> None:
    base = out["largest_micro_batch"].get(baseline)
    if base and base.get("ok"):
        for res in out["largest_micro_batch"].values():
            if res and res.get("ok"):
                res["speedup_vs_baseline_at_its_largest"] = res["tokens_per_s"] / base["tokens_per_s"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="1.3b", help="tiny: an fp32 CPU check of this script")
    p.add_argument("--modes", nargs="+", choices=list(RECIPES), default=["bf16", "coat"], metavar="MODE",
                   help=f"recipes, each in its best configuration: {', '.join(RECIPES)}")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=None,
                   help="one point per size (default: 4, or none with --at-largest)")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--search", default="", help="comma-separated micro-batch sizes to try, ascending, one run each")
    p.add_argument("--at-largest", nargs="+", type=sized_mode, default=[], metavar="MODE@MICRO_BATCH",
                   help="each mode at its own (largest) micro-batch, the ratio against --baseline's entry")
    p.add_argument("--warmup", type=int, default=5, help="iterations before the timed window (compilation)")
    p.add_argument("--iters", type=int, default=30, help="timed iterations per run")
    p.add_argument("--log-interval", type=int, default=5, help="must divide --warmup and --iters")
    p.add_argument("--repeats", type=int, default=2, help="processes per point")
    p.add_argument("--baseline", choices=list(RECIPES), default="bf16", help="the mode ratios are taken against")
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="drop --enable-cuda-graph from every recipe (compiled only: the allocated peak is the footprint)")
    p.add_argument("--profile", action="store_true",
                   help=f"the first repeat of each point runs {PROFILED_STEPS} more iterations under torch.profiler")
    p.add_argument("--traces", default=None, metavar="DIR",
                   help="with --profile, keep each profiled run's Chrome trace as DIR/<mode>_mb<N>_zero<S>.json.gz")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/e2e_speed.json)")
    args = p.parse_args(argv)
    if args.micro_batch_size is None:
        args.micro_batch_size = [] if args.at_largest else [4]
    problems = []
    if args.at_largest and args.search:
        problems.append("--at-largest measures given sizes, --search finds them: pass one")
    if len({mode for mode, _ in args.at_largest}) < len(args.at_largest):
        problems.append(f"--at-largest names a mode twice: {' '.join(f'{m}@{n}' for m, n in args.at_largest)}")
    if args.at_largest and args.baseline not in dict(args.at_largest):
        problems.append(f"--at-largest needs the baseline ({args.baseline}) among its modes, for the ratios")
    for name in ("log_interval", "iters", "repeats", "grad_accum"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.micro_batch_size and min(args.micro_batch_size) < 1:
        problems.append(f"--micro-batch-size must be positive, got {args.micro_batch_size}")
    for name in ("warmup", "iters"):
        if args.log_interval >= 1 and getattr(args, name) % args.log_interval:
            problems.append(f"--{name} ({getattr(args, name)}) must be a multiple of --log-interval "
                            f"({args.log_interval}): the timed window is made of whole log intervals")
    if problems:
        raise SystemExit(f"error: {problems[0]}")
    args.path = args.out or os.path.join(RESULTS, "e2e_speed.json")
    return args


def main() -> None:
    args = parse_args()
    result = speed(args)
    save(result, args.path)
    print("wrote", args.path)


if __name__ == "__main__":
    main()
