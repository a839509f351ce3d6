"""Tensor, pipeline and data parallelism on one host: each recipe in its best configuration through megacoat's
trainer, under DeepSpeed's launcher (one process per GPU).

    # 2 GPUs, 1.3 B model: DP=2 (ZeRO-2) and TP=2 with sequence parallelism, bf16 against the default
    python -m benchmarks.parallel.speed --gpus 2 --model 1.3b --layouts dp tp --micro-batch-size 4
    # 4 GPUs, 7 B model, 3-D layouts
    python -m benchmarks.parallel.speed --gpus 4 --model 7b --layouts dp tp2dp2 tp2pp2 --micro-batch-size 1
    # CPU smoke test of this script (tiny fp32 model, gloo)
    python -m benchmarks.parallel.speed --gpus 2 --model tiny --layouts dp tp pp --warmup 2 --iters 2 \
        --log-interval 2 --repeats 1 --global-batch-size 4 --micro-batch-size 1

A layout names the parallel sizes, e.g. `tp2pp2` or `tp2dp2`; a bare `tp`, `pp` or `dp` puts all GPUs on that axis.
Sequence parallelism whenever TP > 1; ZeRO-2 when DP > 1 without a pipeline (DeepSpeed refuses ZeRO-2 there),
ZeRO-1 otherwise, or the stage a `-z1` / `-z2` / `-z3` suffix names (`dp-z1`; ZeRO-3 runs without CUDA graphs).
Peers (benchmarks/parallel/torchtitan_peer.py: torchtitan's float8 recipes under FSDP2) run in data-parallel
layouts only, started by the same launcher; their rows say `zero_stage` 3 (FSDP shards weights too), and each
megacoat row of the layout gains `speedup_vs_<peer>` and `memory_reduction_vs_<peer>`.
Recipes come from benchmarks/suite.py; under ZeRO-3, where the trainer refuses CUDA graphs, a recipe runs
without --enable-cuda-graph (the row says so). Each (layout, mode) runs --repeats times, interleaved
with the other modes; a run trains --warmup iterations, then --iters timed ones, and a row reports the median of
the timed log intervals of its repeats. With --profile, each rank's GPU-busy fraction and communication time. Memory is the largest rank's torch.cuda.max_memory_allocated. Ratios are
against bf16 of the same layout in the same invocation. The JSON is rewritten after every run (and copied into
$OUT when set and the file lies elsewhere).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import RESULTS, ROOT, environment, free_port, write_json
from benchmarks.e2e.speed import failure, timed_window
from benchmarks.suite import GRAPH_FLAG, MODELS, PEER, RECIPES, TRAINER

MODES = [name for name, (script, _) in RECIPES.items() if script == TRAINER]
PEERS = [name for name, (script, _) in RECIPES.items() if script == PEER]
PEER_ZERO_STAGE = 3  # FSDP2's full sharding: weights, gradients and optimizer state
PROFILED_STEPS = 3
_LAYOUT = re.compile(r"(?:(tp|pp|dp)(\d*))")
_ZERO = re.compile(r"-z(\d)$")


def layout_sizes(name: str, gpus: int) -> dict[str, int]:
    """{'tp': .., 'pp': .., 'dp': ..} for a layout name such as 'tp2pp2' or 'dp' (all GPUs on that axis), with an
    optional ZeRO stage suffix ('dp-z1', see zero_stage)."""
    axes = _ZERO.sub("", name)
    parts = _LAYOUT.findall(axes)
    if not parts or "".join(a + n for a, n in parts) != axes or len({a for a, _ in parts}) != len(parts):
        raise SystemExit(f"error: --layouts {name!r}: expected e.g. tp, pp, dp, tp2pp2, tp2dp2, dp-z1")
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    sizes.update({axis: int(n) if n else gpus for axis, n in parts})
    if math.prod(sizes.values()) != gpus:
        raise SystemExit(f"error: --layouts {name!r} is TP={sizes['tp']} x PP={sizes['pp']} x DP={sizes['dp']} = "
                         f"{math.prod(sizes.values())} GPUs, but --gpus is {gpus}")
    if _ZERO.search(name):
        zero_stage(sizes, name)  # a stage the layout cannot run stops here
    return sizes


def layout_flags(name: str, gpus: int) -> list[str]:
    sizes = layout_sizes(name, gpus)
    flags = ["--tensor-model-parallel-size", str(sizes["tp"]), "--pipeline-model-parallel-size", str(sizes["pp"])]
    if sizes["tp"] > 1:
        flags.append("--sequence-parallel")
    return flags + ["--zero-stage", str(zero_stage(sizes, name))]


def plot_losses(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in out["rows"].items():
        if res.get("ok") and res["losses"]:
            ax.plot(*zip(*res["losses"]), label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ranks = "GPUs" if "device" in out["environment"] else "CPU ranks"
    ax.set_title(f"{out['gpus']} {ranks}, {out['model_name']} model, {out['data']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def worker(argv: list[str], result_path: str) -> None:
    """One rank (under DeepSpeed's launcher): train as pretrain_gpt.py does, then rank 0 writes every rank's
    peak memory."""
    import torch
    import torch.distributed as dist

    from megacoat.arguments import parse_config
    from megacoat.training.trainer import Trainer, max_memory_bytes

    trainer = Trainer(parse_config(argv))
    trainer.train()
    peak = torch.tensor([max_memory_bytes(trainer.device)], dtype=torch.float64, device=trainer.device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        p = trainer.parallel
        with open(result_path, "w") as f:
            json.dump({"max_memory_bytes_per_rank": [int(t.item()) for t in peaks],
                       "tp": p.tp_size, "pp": p.pp_size, "dp": p.dp_size,
                       "grad_accum": trainer.grad_accum}, f)


def run(gpus: int, argv: list[str], timeout: int, port: int, profile: tuple[int, int] | None = None,
        module: str = "benchmarks.parallel.speed") -> dict:
    """One training run under DeepSpeed's launcher: its log records and every rank's peak memory; with profile
    (start, end), each rank's profile of iterations (start, end]. module: what each rank runs (this file's worker,
    or a peer that writes the same log and result files)."""
    with tempfile.TemporaryDirectory() as tmp:
        log, result = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "result.json")
        if profile:
            argv = argv + ["--profile-dir", os.path.join(tmp, "profile"), "--profile-step-start", str(profile[0]),
                           "--profile-step-end", str(profile[1])]
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port", str(port),
               "--module", module, *argv, "--log-json", log]
        print("$", " ".join(argv), flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                                  env=dict(os.environ, BENCH_PARALLEL_RESULT=result))
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timeout after {timeout}s", "argv": argv}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(result):
            return failure(proc.stdout[-6000:] + proc.stderr[-6000:], argv, keep=2500)
        train = [r for r in map(json.loads, open(log)) if "loss" in r]
        extra = json.load(open(result))
        ranks = rank_profiles(os.path.join(tmp, "profile"), gpus) if profile else None
    peaks = extra["max_memory_bytes_per_rank"]
    return {"ok": True, "argv": argv, "wall_s": wall, "records": train, "profile_per_rank": ranks,
            **{k: extra[k] for k in ("tp", "pp", "dp", "grad_accum")},
            "max_memory_gib_per_gpu": [b / 2**30 for b in peaks], "max_memory_gib": max(peaks) / 2**30}


def rank_profiles(folder: str, ranks: int) -> list[dict | None]:
    """Per rank, from its profiled window: the GPU-busy fraction, and the time per step in communication kernels
    (NCCL's) and in the rest, by the kernels' self time."""
    out = []
    for rank in range(ranks):
        path = os.path.join(folder, f"top_ops_rank{rank}.json")
        if not os.path.exists(path):
            out.append(None)
            continue
        with open(path) as f:
            prof = json.load(f)
        steps = prof["steps"][1] - prof["steps"][0] + 1
        comm = sum(r["self_us"] for r in prof["top"] if "nccl" in r["name"].lower()) / 1e3 / steps
        device = prof.get("device") or {}
        out.append({"gpu_busy_fraction": device.get("gpu_busy_fraction"), "comm_ms_per_step": comm,
                    "compute_ms_per_step": prof["total_self_us"] / 1e3 / steps - comm,
                    "wall_ms_per_step": device.get("wall_us", 0) / 1e3 / steps, "time": prof.get("time")})
    return out


def row(layout: str, mode: str, runs: list[dict], gpus: int, args, env: dict, graphs: bool) -> dict:
    """One (layout, mode) from its repeats: the median of the timed intervals, per GPU."""
    windows = [(r, timed_window(r["records"], args.warmup, args.warmup + args.iters)) for r in runs if r.get("ok")]
    windows = [(r, w) for r, w in windows if w]
    sizes = layout_sizes(layout, gpus)
    out = {"layout": layout, "model": args.model, "mode": mode, "tp": sizes["tp"], "pp": sizes["pp"],
           "dp": sizes["dp"], "zero_stage": PEER_ZERO_STAGE if mode in PEERS else zero_stage(sizes, layout),
           "micro_batch_size": args.micro_batch_size,
           "global_batch_size": args.global_batch_size, "cuda_graphs": graphs, "repeats": len(windows),
           "device": env.get("device", "cpu"),
           "versions": {k: env.get(k) for k in ("torch", "triton", "deepspeed", "torchao") if k in env},
           "command": env["command"]}
    if not windows:
        first = runs[0] if runs else {}
        return {**out, "ok": False, "error": first.get("error", "the log does not cover the timed iterations")}
    tokens = statistics.median(x for _, w in windows for x in w["intervals_tokens_per_s"])
    first_record = windows[0][0]["records"][-1]
    tflops = None if first_record.get("tflops_per_gpu") is None else (
        tokens * first_record["tflops_per_gpu"] / first_record["tokens_per_s"])
    return {**out, "ok": True, "tokens_per_s_per_gpu": tokens / gpus, "tflops_per_gpu": tflops,
            "max_memory_gib": max(r["max_memory_gib"] for r, _ in windows),
            "max_memory_gib_per_gpu": windows[0][0]["max_memory_gib_per_gpu"],
            "tokens_per_s_per_gpu_repeats": [w["tokens_per_s"] / gpus for _, w in windows],
            "profile_per_rank": next((r["profile_per_rank"] for r, _ in windows if r.get("profile_per_rank")), None),
            "losses": [(r["iteration"], r["loss"]) for r in windows[0][0]["records"]]}


def add_ratios(rows: dict) -> None:
    """speedup_vs_bf16 and memory_reduction_vs_bf16 (bf16's peak over this mode's), within each layout; and on
    megacoat's rows, speedup_vs_<peer> and memory_reduction_vs_<peer> for each peer that ran in the layout."""
    for key, res in rows.items():
        layout, mode = key.split("/")
        bases = [("bf16", rows.get(f"{layout}/bf16", {}))]
        if mode not in PEERS:
            bases += [(peer, rows.get(f"{layout}/{peer}", {})) for peer in PEERS]
        for name, base in bases:
            if res.get("ok") and base.get("ok"):
                res[f"speedup_vs_{name}"] = res["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
                res[f"memory_reduction_vs_{name}"] = base["max_memory_gib"] / res["max_memory_gib"]


def zero_stage(sizes: dict[str, int], layout: str = "") -> int:
    """The layout's suffix (`-z1`, `-z2`), else ZeRO-2 when DP > 1 without a pipeline, else ZeRO-1."""
    named = _ZERO.search(layout)
    if not named:
        return 2 if sizes["dp"] > 1 and sizes["pp"] == 1 else 1
    stage = int(named.group(1))
    if stage not in (1, 2, 3) or (stage >= 2 and sizes["pp"] > 1) or (stage == 3 and sizes["tp"] > 1):
        raise SystemExit(f"error: --layouts {layout!r}: ZeRO-{stage} is not a stage this benchmark runs "
                         "(1, 2 without a pipeline, or 3 on data parallelism alone)")
    return stage


def mode_flags(mode: str, sizes: dict[str, int], on_cpu: bool = False, stage: int = 1) -> tuple[list[str], bool]:
    """A recipe's flags in a layout, and whether it keeps its CUDA graphs (not under ZeRO-3: the trainer refuses
    them there; a pipeline stage captures per micro-batch slot); on_cpu (the tiny check) runs eager, without the
    GPU-only flags."""
    flags = RECIPES[mode][1]
    if mode in PEERS:  # the peer's own flags: no CUDA graphs, compile unless on CPU
        return [f for f in flags if not (on_cpu and f == "--compile")], False
    if on_cpu:
        return [f for f in flags if f not in (GRAPH_FLAG, "--compile")], False
    graphs = GRAPH_FLAG in flags and stage != 3
    return [f for f in flags if f != GRAPH_FLAG or graphs], graphs


def peer_missing(mode: str) -> str | None:
    """Why a peer cannot run here (its float8 needs torchao, a benchmark-only dependency), or None."""
    flags = RECIPES[mode][1]
    if flags[flags.index("--float8") + 1] != "none" and importlib.util.find_spec("torchao") is None:
        from benchmarks.e2e.torchao_pretrain import MISSING

        return MISSING
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="processes (GPUs, or CPU ranks with --model tiny)")
    p.add_argument("--model", choices=list(MODELS), default="1.3b", help="tiny: fp32 CPU ranks, a check of this script")
    p.add_argument("--layouts", nargs="+", default=["dp", "tp", "pp"],
                   help="tp, pp, dp (all GPUs on one axis) or sizes such as tp2pp2, tp2dp2")
    p.add_argument("--modes", nargs="+", default=["bf16", "coat"], choices=MODES + PEERS)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32, help="sequences per step over all DP ranks")
    p.add_argument("--warmup", type=int, default=4, help="iterations before the timed window")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per run")
    p.add_argument("--log-interval", type=int, default=4, help="must divide --warmup and --iters")
    p.add_argument("--repeats", type=int, default=2, help="runs per (layout, mode), interleaved across modes")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--profile", action="store_true",
                   help=f"the first repeat runs {PROFILED_STEPS} more iterations under torch.profiler (not timed): "
                        "each rank's GPU-busy fraction and communication time")
    p.add_argument("--real-text", action="store_true",
                   help="train on the embedded default corpus (its tokenizer and vocabulary) instead of mock tokens")
    p.add_argument("--plot", action="store_true", help="also write a PNG of every run's training loss")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/parallel_<model>_<N>gpu.json)")
    args = p.parse_args(argv)
    for name in args.layouts:
        sizes = layout_sizes(name, args.gpus)  # a bad layout stops here, before any run
        if sizes["dp"] != args.gpus and set(args.modes) & set(PEERS):
            raise SystemExit(f"error: --modes {' '.join(sorted(set(args.modes) & set(PEERS)))}: the peers run "
                             f"data parallel (FSDP2) only, and --layouts {name} is not")
    if args.global_batch_size % args.micro_batch_size:
        raise SystemExit("error: --global-batch-size must be a multiple of --micro-batch-size")
    for name in ("warmup", "iters"):
        if args.log_interval < 1 or getattr(args, name) % args.log_interval:
            raise SystemExit(f"error: --{name} must be a multiple of --log-interval ({args.log_interval})")
    if args.iters < 1 or args.repeats < 1:
        raise SystemExit("error: --iters and --repeats must be positive")
    return args


def main() -> None:
    args = parse_args()
    model = MODELS[args.model]
    data = ["--mock-data"]
    if args.real_text:
        from megacoat.data.default_corpus import prepare_default_corpus

        corpus = prepare_default_corpus()  # built once here, not by every rank at once
        vocab = model.index("--vocab-size")
        model = model[:vocab] + model[vocab + 2:] + ["--vocab-size", "4096"]
        data = ["--data-path", corpus.data_prefix, "--tokenizer-model", corpus.tokenizer_model, "--split", "99,1,0"]
    common = model + ["--fp32" if args.model == "tiny" else "--bf16", *data, "--eval-iters", "0",
                      "--log-interval", str(args.log_interval),
                      "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
                      str(args.global_batch_size)]
    path = os.path.abspath(args.out or os.path.join(RESULTS, f"parallel_{args.model}_{args.gpus}gpu.json"))
    env = environment()
    if set(args.modes) & set(PEERS) and importlib.util.find_spec("torchao") is not None:
        env["torchao"] = importlib.metadata.version("torchao")
    out = {"environment": env, "gpus": args.gpus, "model_name": args.model, "model": " ".join(model),
           "data": "default corpus (real text)" if args.real_text else "mock tokens",
           "method": {"warmup_iterations": args.warmup, "timed_iterations": args.iters, "repeats": args.repeats,
                      "statistic": "median of the timed log intervals of all repeats",
                      "tflops": "the trainer's count (Megatron's: matmuls, attention included)"},
           "rows": {}}
    for layout in args.layouts:
        sizes = layout_sizes(layout, args.gpus)
        runs = {mode: [] for mode in args.modes}
        for repeat in range(args.repeats):
            for mode in args.modes:
                port = free_port()
                if mode in PEERS and peer_missing(mode):
                    out["rows"][f"{layout}/{mode}"] = {"layout": layout, "mode": mode, "ok": False,
                                                       "skipped": peer_missing(mode)}
                    if repeat == 0:
                        print(layout, mode, "skipped:", peer_missing(mode), flush=True)
                    continue
                flags, graphs = mode_flags(mode, sizes, on_cpu=args.model == "tiny", stage=zero_stage(sizes, layout))
                end = args.warmup + args.iters
                profile = (end, end + PROFILED_STEPS) if args.profile and repeat == 0 else None
                iters = ["--train-iters", str(end + (PROFILED_STEPS if profile else 0))]
                res = run(args.gpus, common + iters + layout_flags(layout, args.gpus) + flags, args.timeout, port,
                          profile, module=RECIPES[mode][0] if mode in PEERS else "benchmarks.parallel.speed")
                runs[mode].append(res)
                out["rows"][f"{layout}/{mode}"] = r = row(layout, mode, runs[mode], args.gpus, args, env, graphs)
                add_ratios(out["rows"])
                print(layout, mode, {k: r.get(k) for k in ("tokens_per_s_per_gpu", "max_memory_gib")},
                      res.get("error", "")[-800:], flush=True)
                save(out, path)
    if args.plot:
        plot_losses(out, path.replace(".json", ".png"))
        copy_to_out(path.replace(".json", ".png"))
    print("wrote", path)


def copy_to_out(path: str) -> None:
    """A copy into $OUT (what the device machine sends back), unless the file already lies there."""
    dest = os.environ.get("OUT")
    if dest and os.path.isdir(dest) and os.path.dirname(os.path.abspath(path)) != os.path.realpath(dest):
        target = os.path.join(dest, os.path.basename(path))
        if not (os.path.exists(target) and os.path.samefile(path, target)):
            shutil.copy(path, target)


def save(out: dict, path: str) -> None:
    write_json(path, out)
    copy_to_out(path)


if __name__ == "__main__":
    if os.environ.get("BENCH_PARALLEL_RESULT"):  # a rank started by run() through the launcher
        worker(sys.argv[1:], os.environ["BENCH_PARALLEL_RESULT"])
    else:
        main()
