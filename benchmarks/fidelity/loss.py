"""Loss fidelity of the FP8 modes against BF16: the same model, data and schedule trained by `pretrain_gpt.py`
in several modes over several seeds, the final validation loss on one fixed held-out set, and the gap to bf16
with a 95% confidence interval from seed-paired differences (a pair: one seed on one kind of card).

    python -m benchmarks.fidelity.data --out .cache/fidelity_data                       # the text, once
    python -m benchmarks.fidelity.loss run --preset 125m --modes bf16 coat --seeds 1 --parallel 2 \\
        --data .cache/fidelity_data --time-budget 500 --out benchmarks/results/fidelity_125m_s1.json
    python -m benchmarks.fidelity.loss grads --checkpoint RUNDIR/bf16_s1/checkpoint --data .cache/fidelity_data \\
        --out benchmarks/results/fidelity_125m_grads.json
    python -m benchmarks.fidelity.loss report benchmarks/results/fidelity_125m_s*.json fidelity_125m_grads.json \\
        --out benchmarks/results/fidelity_125m.json                                     # + .png

`run`: every (mode, seed) is its own `pretrain_gpt.py` process, `--parallel N` of them at once (on the CPU, each with
1/N of the cores' threads; on a host with several GPUs, each run on the visible GPU that holds the fewest runs, so
N = 2 x GPUs runs two a GPU), each with its own MASTER_PORT and folder. The seed sets both the initial
weights and the training data order, so the same seed in two modes is a pair. The validation range is exactly the
held-out files (the data manifest's `--split`) and the trainer's validation samples do not depend on the seed, so
every run is evaluated on the same samples: the whole held-out set, rounded down to whole global batches.
`--time-budget` stops launching runs that would not finish and tells running ones to stop in time (they are then
recorded as incomplete and left out of the statistics), so one invocation fits one device call; `report` merges the
JSON of several calls (the statistics are benchmarks/fidelity/stats.py).

`grads` (benchmarks/fidelity/grads.py): on one fixed held-out batch, the gradient of every parameter tensor under
each mode against bf16 (same weights, from a trained checkpoint): cosine similarity and relative error. The
optimizer does not enter a gradient, so `coat` here is the COAT activation flow. Also the FP8 quantization error of
that checkpoint's real Adam moments (as stored: ZeRO's flat fp32 partitions), E4M3/E5M2 with and without dynamic
range expansion.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from benchmarks.common import ROOT
from benchmarks.fidelity import stats

# Modes by recipe (benchmarks/suite.py's names), then single changes to the default recipe. JSON written under
# earlier names stays readable: report pools runs by the name they carry.
MODES = {
    "bf16": [],
    "coat": ["--coat-fp8"],  # the default: delayed scaling, the FP8 head
    "coat-current": ["--coat-fp8", "--fp8-grad-scaling", "current", "--fp8-activation-scaling", "current",
                     "--fp8-output-layer", "off"],  # COAT's own: just-in-time scaling, the BF16 head
    "fp8-linear": ["--fp8-activations", "fp8-linear"],
    "coat-bf16-head": ["--coat-fp8", "--fp8-output-layer", "off"],
    "fp8-optimizer": ["--fp8-optimizer"],  # CoatAdamW alone
    "fp8-activations": ["--fp8-activations", "coat"],  # the precision flow alone
    "coat-no-expansion": ["--coat-fp8", "--fp8-no-expansion"],
    "coat-v-e5m2": ["--coat-fp8", "--fp8-v-dtype", "e5m2"],
    "coat-fast-accum": ["--coat-fp8", "--fp8-fast-accum"],
}
MODEL_125M = ["--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "2048", "--num-attention-heads", "12"]
MODEL_350M = ["--num-layers", "24", "--hidden-size", "1024", "--ffn-hidden-size", "2816", "--num-attention-heads", "16"]
PRESETS = {
    # model flags, sequence length, tokens per run, global/micro batch, peak LR, validation points per run
    "125m": dict(model=MODEL_125M, seq=1024, tokens=50e6, gbs=32, mbs=16, lr=6e-4, val_points=4),
    "350m": dict(model=MODEL_350M, seq=1024, tokens=30e6, gbs=32, mbs=16, lr=3e-4, val_points=4),
    # twice the tokens: at 30 M one run's own noise is ~2%
    "350m-long": dict(model=MODEL_350M, seq=1024, tokens=60e6, gbs=32, mbs=16, lr=3e-4, val_points=4),
    "ablation": dict(model=MODEL_125M, seq=1024, tokens=20e6, gbs=32, mbs=16, lr=6e-4, val_points=2),
    # a CPU check of this script (tests/benchmarks/test_fidelity.py), not a measurement
    "tiny": dict(model=["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                        "--num-attention-heads", "4"], seq=32, tokens=4 * 8 * 32, gbs=8, mbs=8, lr=1e-3, val_points=2),
}


class UserError(Exception):
    """Bad input: printed as one `error:` line, exit status 1."""


# --- environment and data -------------------------------------------------------------------------------------
def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": "cpu"}
    for name in ("deepspeed", "triton"):
        try:  # from the installed metadata: importing deepspeed only for its version costs about a second
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return env


def load_manifest(data_dir: str) -> dict:
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.isfile(path):
        raise UserError(f"--data {data_dir}: no manifest.json (build it with benchmarks/fidelity/data.py)")
    with open(path) as f:
        return json.load(f)


def eval_iters_for(manifest: dict, seq: int, gbs: int) -> tuple[int, int]:
    """(eval iterations, held-out tokens they cover): one pass over the held-out samples in whole global batches."""
    samples = (manifest["valid"]["tokens"] - 1) // seq
    iters = samples // gbs
    if iters < 1:
        raise UserError(f"the held-out set ({manifest['valid']['tokens']} tokens) is smaller than one global batch "
                        f"of {gbs} x {seq} tokens")
    return iters, iters * gbs * seq


def run_plan(preset: str, manifest: dict, on_cuda: bool, compile_: bool,
             cuda_graph: bool = False) -> tuple[list[str], dict]:
    """The pretrain_gpt.py flags every mode shares, and a description of them for the JSON."""
    p = PRESETS[preset]
    iters = max(int(p["tokens"] // (p["gbs"] * p["seq"])), 1)
    eval_iters, eval_tokens = eval_iters_for(manifest, p["seq"], p["gbs"])
    flags = [*p["model"], "--seq-length", str(p["seq"]), "--vocab-size", str(manifest["vocab_size"]),
             "--data-path", manifest["data_prefix"], "--split", manifest["split"],
             "--tokenizer-model", manifest["tokenizer_model"],
             "--micro-batch-size", str(p["mbs"]), "--global-batch-size", str(p["gbs"]), "--train-iters", str(iters),
             "--lr", str(p["lr"]), "--min-lr", str(p["lr"] / 10), "--lr-warmup-iters", str(max(iters // 50, 2)),
             "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
             "--log-interval", str(max(iters // 100, 1)), "--eval-interval", str(max(iters // p["val_points"], 1)),
             "--eval-iters", str(eval_iters), "--zero-stage", "1", "--bf16" if on_cuda else "--fp32"]
    if compile_:
        flags.append("--compile")
    if cuda_graph:  # the trainer compiles each block with it (reduce-overhead): --compile is implied
        flags.append("--enable-cuda-graph")
    desc = {"preset": preset, **{k: v for k, v in p.items() if k != "model"}, "model_flags": p["model"],
            "train_iters": iters, "tokens_per_run": iters * p["gbs"] * p["seq"], "eval_iters": eval_iters,
            "eval_tokens": eval_tokens, "held_out_tokens": manifest["valid"]["tokens"],
            "compile": compile_ or cuda_graph, "cuda_graph": cuda_graph, "precision": "bf16" if on_cuda else "fp32"}
    return flags, desc


def same_schedule(a: dict, b: dict) -> bool:
    """Two run plans that train the same way (a plan written before --cuda-graph existed ran without it)."""
    return {"cuda_graph": False, **a} == {"cuda_graph": False, **b}


# --- run ----------------------------------------------------------------------------------------------------------
def parse_log(path: str) -> dict:
    records = [json.loads(line) for line in open(path)] if os.path.isfile(path) else []
    train = [r for r in records if "loss" in r]
    steady = train[1:] or train
    return {"train_loss": [(r["iteration"], r["loss"]) for r in train],
            # the gradient norm before clipping and the steps skipped for inf/nan gradients: what a run that
            # falls behind its pair did differently (a spike, a clipped stretch, a skipped step)
            "grad_norm": [(r["iteration"], r["grad_norm"]) for r in train if r.get("grad_norm") is not None],
            "skipped_steps": train[-1].get("skipped_steps", 0) if train else 0,
            "val_loss": [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r],
            "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in steady) if steady else None,
            "max_memory_gib": max((r["max_memory_bytes"] for r in train), default=0) / 2**30}


def has_checkpoint(directory: str | None) -> bool:
    """A complete megacoat checkpoint under `directory` (its `latest`, or an iter_N with its metadata)."""
    if not directory or not os.path.isdir(directory):
        return False
    from megacoat.training.checkpointing import latest_tag

    try:
        return latest_tag(directory) is not None
    except FileNotFoundError:  # `latest` names a checkpoint that is not there: the trainer will say so
        return True


def final_val_loss(log: dict, train_iters: int) -> float | None:
    """The validation loss at the last iteration, where the log reached it (None: the run has not finished)."""
    if not log["train_loss"] or log["train_loss"][-1][0] < train_iters:
        return None
    return next((v for it, v in log["val_loss"] if it == train_iters), None)


class Run:
    """One pretrain_gpt.py process: launched, polled, then summarised."""

    def __init__(self, mode: str, seed: int, folder: str, flags: list[str], port: int, save: bool,
                 resume: bool = False, train_iters: int = 0):
        """resume: the run saves its checkpoint whenever it stops, and continues from the one its folder holds
        (the trainer's exact resume, its log kept up to that iteration); a run whose log already ends with the
        final validation is not launched again."""
        self.mode, self.seed, self.folder, self.port = mode, seed, folder, port
        os.makedirs(folder, exist_ok=True)
        self.log = os.path.join(folder, "log.jsonl")
        self.checkpoint = os.path.join(folder, "checkpoint") if save or resume else None
        resuming = resume and has_checkpoint(self.checkpoint)
        if os.path.exists(self.log) and not resuming:
            os.remove(self.log)
        self.argv = [*flags, *MODES[mode], "--seed", str(seed), "--log-json", self.log]
        if self.checkpoint:
            self.argv += ["--save", self.checkpoint]
        if resume:  # --load of the --save directory: from scratch while it holds no checkpoint
            self.argv += ["--load", self.checkpoint, "--keep-last", "1"]
        log = parse_log(self.log) if resuming else None
        self.resumed_from = log["train_loss"][-1][0] if log and log["train_loss"] else 0
        self.finished_before = log is not None and final_val_loss(log, train_iters) is not None
        self.proc, self.started, self.wall, self.gpu = None, None, None, None

    def launch(self, stop_after_s: float, cpu_threads: int | None = None, gpu: str | None = None) -> None:
        """Start the process; `cpu_threads` caps its intra-op threads (CPU runs sharing the cores); `gpu` (a
        CUDA_VISIBLE_DEVICES entry) is the one GPU it sees."""
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        self.gpu = gpu
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if cpu_threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(cpu_threads)
        argv = self.argv + ["--exit-duration-in-mins", f"{max(stop_after_s, 30) / 60:.3f}"]
        self.stdout = open(os.path.join(self.folder, "stdout.txt"), "w")
        self.started = time.time()
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], cwd=ROOT,
                                     env=env, stdout=self.stdout, stderr=subprocess.STDOUT)
        on = "" if gpu is None else f", GPU {gpu}"
        print(f"[{time.strftime('%H:%M:%S')}] start {self.mode} seed {self.seed} (port {self.port}{on})", flush=True)

    def poll(self, kill_at: float) -> bool:
        if self.proc.poll() is None and time.time() > kill_at:
            self.proc.kill()
        if self.proc.poll() is None:
            return False
        self.wall = time.time() - self.started
        self.stdout.close()
        return True

    def result(self, train_iters: int) -> dict:
        out = {"mode": self.mode, "seed": self.seed, "flags": MODES[self.mode], "argv": self.argv,
               "folder": self.folder, "wall_s": self.wall, "resumed_from_iteration": self.resumed_from,
               "gpu": self.gpu}
        if self.proc is None and not self.finished_before:
            return dict(out, status="not_started", final_val_loss=None)
        out.update(parse_log(self.log))
        final = final_val_loss(out, train_iters)
        if self.finished_before:
            out.update(status="ok", final_val_loss=final,
                       note="finished by an earlier invocation (--resume); not run again")
        elif self.proc.returncode != 0:
            with open(os.path.join(self.folder, "stdout.txt"), errors="replace") as f:
                out.update(status="failed", error=f.read()[-3000:], final_val_loss=None)
        elif final is None:
            out.update(status="incomplete", final_val_loss=None)
        else:
            out.update(status="ok", final_val_loss=final)
        if self.checkpoint and out["status"] == "ok":
            out["checkpoint"] = self.checkpoint
        return out


def visible_gpus(count: int, env: dict) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of the `count` GPUs this process sees (its own list where one is set)."""
    listed = [g.strip() for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def least_loaded_gpu(gpus: list[str], running: list) -> str | None:
    """The GPU that holds the fewest running runs (the first of them on a tie); None without GPUs. Several runs
    share a GPU as independent processes; spreading them keeps each GPU's share equal."""
    if not gpus:
        return None
    load = {g: 0 for g in gpus}
    for r in running:
        if r.gpu in load:
            load[r.gpu] += 1
    return min(gpus, key=lambda g: load[g])


def parse_run(item: str, flag: str) -> tuple[str, int]:
    mode, _, seed = item.partition(":")
    if mode not in MODES or not seed.isdigit():
        raise UserError(f"{flag} {item}: expected MODE:SEED with MODE one of {list(MODES)}")
    return mode, int(seed)


def run(args) -> dict:
    start = time.time()
    deadline = start + args.time_budget
    manifest = load_manifest(args.data)  # before importing torch: bad input fails at once
    import torch

    on_cuda = torch.cuda.is_available()
    if args.cuda_graph and not on_cuda:
        raise UserError("--cuda-graph needs a CUDA GPU")
    flags, plan = run_plan(args.preset, manifest, on_cuda, args.compile, args.cuda_graph)
    # On the CPU every run would otherwise start a thread per core: N runs then oversubscribe the cores and spin
    # against each other (4 tiny runs on 2 cores took several times their serial time).
    cpu_threads = None if on_cuda else max((os.cpu_count() or 1) // args.parallel, 1)
    # one GPU: every run sees it as the process does (no CUDA_VISIBLE_DEVICES of its own)
    gpus = visible_gpus(torch.cuda.device_count(), os.environ) if on_cuda else []
    gpus = gpus if len(gpus) > 1 else []
    # seed-major: the runs of one seed (a pair) start together
    pairs = ([parse_run(item, "--runs") for item in args.runs] if args.runs
             else [(m, s) for s in args.seeds for m in args.modes])
    if len(set(pairs)) != len(pairs):
        raise UserError(f"a run is named twice: {pairs}")
    save = {parse_run(item, "--save-checkpoint") for item in args.save_checkpoint}
    if save - set(pairs):
        raise UserError(f"--save-checkpoint {sorted(save - set(pairs))}: not a run of this invocation")
    if args.stop_every:  # each invocation trains at most this many iterations of a run (--resume continues it)
        flags = [*flags, "--exit-interval", str(args.stop_every)]
    runs = [Run(m, s, os.path.join(args.workdir, f"{m}_s{s}"), flags, args.port_base + i, (m, s) in save,
                args.resume, plan["train_iters"]) for i, (m, s) in enumerate(pairs)]
    queue, running, done = [r for r in runs if not r.finished_before], [], []
    while queue or running:
        while queue and len(running) < args.parallel:
            left = deadline - time.time()
            longest = max((r.wall for r in done if r.wall), default=0.0)
            if left < args.min_run_s or longest > left:
                break
            r = queue.pop(0)
            r.launch(left - args.stop_margin_s, cpu_threads, least_loaded_gpu(gpus, running))
            running.append(r)
        if not running:
            break
        time.sleep(0.25)  # a finished run's slot is refilled within a quarter second (tiny CPU runs last seconds)
        for r in [r for r in running if r.poll(deadline + 30)]:
            running.remove(r)
            done.append(r)
            res = r.result(plan["train_iters"])
            print(f"[{time.strftime('%H:%M:%S')}] {r.mode} seed {r.seed}: {res['status']}, final validation loss "
                  f"{res['final_val_loss']}, {r.wall:.0f} s", flush=True)
    return {"kind": "fidelity_runs", "environment": environment(), "plan": plan, "common_flags": flags,
            "data": {k: manifest[k] for k in ("data_id", "split", "vocab_size", "train", "valid", "sources")},
            "parallel": args.parallel, "gpus": len(gpus) or int(on_cuda), "time_budget_s": args.time_budget, "wall_s": time.time() - start,
            "runs": [r.result(plan["train_iters"]) for r in runs]}


# --- report ---------------------------------------------------------------------------------------------------------
def load_results(paths: list[str]) -> tuple[list, list]:
    """The (path, doc) pairs of run and grads JSON files, checked to be of one data set and one schedule."""
    runs_files, grads_files = [], []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: cannot read ({e})") from None
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind == "fidelity_runs":
            runs_files.append((path, doc))
        elif kind == "fidelity_gradients":
            grads_files.append((path, doc))
        else:
            raise UserError(f"{path}: not a fidelity.py run or grads JSON (kind {kind!r})")
    if not runs_files:
        raise UserError("report needs at least one JSON written by 'fidelity.py run'")
    first_path, first = runs_files[0]
    for path, doc in runs_files[1:]:
        for key, same in (("data_id", first["data"]["data_id"] == doc["data"]["data_id"]),
                          ("plan", same_schedule(first["plan"], doc["plan"]))):
            if not same:
                raise UserError(f"{path} and {first_path} differ in {key}: runs of different data or schedule "
                                f"cannot be compared")
    for path, doc in grads_files:
        if doc["data_id"] != first["data"]["data_id"]:
            raise UserError(f"{path}: gradients measured on data {doc['data_id']}, runs on {first['data']['data_id']}")
    return runs_files, grads_files


def _mode_order(mode: str) -> tuple[int, str]:
    """The table's order; a mode measured once and since removed from it (its JSON keeps its flags) comes last."""
    return (list(MODES).index(mode), "") if mode in MODES else (len(MODES), mode)


def report(paths: list[str]) -> dict:
    """Each mode against bf16, paired by seed **on the same card**.

    A seed fixes the data order and the initial weights, but the card picks the kernels (cuBLAS and cuDNN choose by
    device), and their rounding sends the run elsewhere: at 350 M over 60 M tokens, bf16 at seeds 11 and 12 on an
    H100 ended -0.19% and +1.47% from the same seeds on an H200, while modes run on one kind of card correlate 0.87
    seed by seed. So a pair is one seed on one device name; a run whose seed bf16 ran only on another card pairs with
    nothing (listed in `unpaired`). The same (mode, seed) may finish once per device."""
    runs_files, grads_files = load_results(paths)
    first = runs_files[0][1]
    runs, seen = [], {}
    for path, doc in runs_files:
        device = doc["environment"]["device"]
        for r in doc["runs"]:
            key = (r["mode"], r["seed"], device)
            if r["status"] == "ok" and key in seen:
                raise UserError(f"{r['mode']} seed {r['seed']} finished on {device} in both {seen[key]} and {path}")
            if r["status"] == "ok":
                seen[key] = path
            runs.append(dict(r, source=path, device=device))
    finals: dict[str, dict[tuple[int, str], float]] = {}  # mode: {(seed, device): final validation loss}
    for r in runs:
        if r["status"] == "ok":
            finals.setdefault(r["mode"], {})[(r["seed"], r["device"])] = r["final_val_loss"]
    modes = {}
    for mode in sorted(finals, key=_mode_order):
        vals = list(finals[mode].values())
        modes[mode] = {"seeds": sorted({seed for seed, _ in finals[mode]}),
                       "final_val_loss": [{"seed": seed, "device": dev, "loss": v}
                                          for (seed, dev), v in sorted(finals[mode].items())],
                       "mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None}
        if mode != "bf16" and "bf16" in finals:
            modes[mode]["gap_to_bf16"] = stats.paired_gap(finals[mode], finals["bf16"])
            modes[mode]["unpaired"] = []
            for seed, dev in sorted(finals[mode]):
                if (seed, dev) not in finals["bf16"]:
                    elsewhere = ", ".join(sorted(d for s, d in finals["bf16"] if s == seed))
                    modes[mode]["unpaired"].append(f"seed {seed} on {dev}: "
                                                   + (f"bf16 ran it on {elsewhere}" if elsewhere else "no bf16 run"))
    devices = sorted({doc["environment"]["device"] for _, doc in runs_files})
    return {"kind": "fidelity_report", "inputs": paths, "devices": devices,
            "environment": first["environment"], "plan": first["plan"], "data": first["data"],
            "common_flags": first["common_flags"],
            "targets": {"gap_mean_within_pct": stats.TARGET_MEAN_PCT, "gap_ci95_within_pct": stats.TARGET_CI_PCT,
                        "block_gradient_cosine_at_least": stats.TARGET_GRAD_COSINE},
            "modes": modes, "gradient_agreement": [doc for _, doc in grads_files],
            "runs": runs,
            "not_counted": [f"{r['mode']} seed {r['seed']}: {r['status']}" for r in runs if r["status"] != "ok"]}


def repeats(paths: list[str]) -> dict:
    """Identical runs (same mode and seed, several times): how far one command moves by itself.

    Runs are not bitwise reproducible on a GPU (kernels that sum with atomics, e.g. attention's backward; another
    card picks other kernels), and a short schedule can amplify that: this is the noise a single run carries even
    with its seed fixed, beside the seed-to-seed noise that pairing removes. `report` refuses a repeat on the same
    card, so that each (seed, card) counts once."""
    runs_files, _ = load_results(paths)
    groups: dict[tuple[str, int], list] = {}
    for path, doc in runs_files:
        for r in doc["runs"]:
            if r["status"] == "ok":
                groups.setdefault((r["mode"], r["seed"]), []).append(
                    (r["final_val_loss"], f"{path} ({doc['environment']['device']})"))
    out, rel_devs = [], []
    for (mode, seed), items in sorted(groups.items(), key=lambda kv: (kv[0][1], _mode_order(kv[0][0]))):
        vals = [v for v, _ in items]
        mean = statistics.fmean(vals)
        g = {"mode": mode, "seed": seed, "final_val_loss": vals, "sources": [p for _, p in items], "mean": mean}
        if len(vals) > 1:
            g.update(std=statistics.stdev(vals), range_pct=100 * (max(vals) - min(vals)) / mean)
            rel_devs += [(v - mean) / mean for v in vals]
        base = groups.get(("bf16", seed))
        if mode != "bf16" and base:
            g["mean_gap_to_bf16_mean_pct"] = 100 * (mean / statistics.fmean(v for v, _ in base) - 1)
        out.append(g)
    repeated = [g for g in out if len(g["final_val_loss"]) > 1]
    # pooled over the repeated groups: the relative std of one run around its group's mean (n - groups dof)
    dof = len(rel_devs) - len(repeated)
    pooled = 100 * (sum(d * d for d in rel_devs) / dof) ** 0.5 if dof > 0 else None
    return {"kind": "fidelity_repeats", "inputs": paths, "plan": runs_files[0][1]["plan"],
            "data": runs_files[0][1]["data"], "groups": out, "repeated_groups": len(repeated),
            "pooled_run_to_run_std_pct": pooled}


def plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    plan = rep["plan"]
    tokens_per_iter = plan["gbs"] * plan["seq"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for k, mode in enumerate(rep["modes"]):
        ok = [r for r in rep["runs"] if r["mode"] == mode and r["status"] == "ok"]
        if not ok:
            continue
        its = sorted(set.intersection(*[{it for it, _ in r["train_loss"]} for r in ok]))
        curves = np.array([[dict(map(tuple, r["train_loss"]))[it] for it in its] for r in ok])
        x = np.array(its) * tokens_per_iter / 1e6
        mean, std = curves.mean(0), curves.std(0, ddof=1) if len(ok) > 1 else np.zeros(len(its))
        ax.plot(x, mean, color=f"C{k}", label=f"{mode} (n={len(ok)})")
        ax.fill_between(x, mean - std, mean + std, color=f"C{k}", alpha=0.2)
        vits = sorted(set.intersection(*[{it for it, _ in r["val_loss"]} for r in ok]))
        vals = np.array([[dict(map(tuple, r["val_loss"]))[it] for it in vits] for r in ok])
        verr = vals.std(0, ddof=1) if len(ok) > 1 else None
        bx.errorbar(np.array(vits) * tokens_per_iter / 1e6 + 0.004 * k * x[-1], vals.mean(0), yerr=verr,
                    color=f"C{k}", marker="o", capsize=3, label=mode)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("training loss (mean ± std over seeds)")
    tails = [v for r in rep["runs"] if r["status"] == "ok" for _, v in r["train_loss"][len(r["train_loss"]) // 5:]]
    if tails:  # the last 80% of training, where the modes differ: the first steps' loss would flatten it
        ax.set_ylim(min(tails) - 0.05, min(tails) + 1.5)
    ax.legend()
    bx.set_xlabel("training tokens (M)")
    bx.set_ylabel(f"validation loss, {plan['eval_tokens'] / 1e6:.2f} M held-out tokens")
    gaps = [f"{m}: {v['gap_to_bf16']['mean_pct']:+.2f}%" + (
        f" [{v['gap_to_bf16']['ci95_pct'][0]:+.2f}, {v['gap_to_bf16']['ci95_pct'][1]:+.2f}]"
        if v["gap_to_bf16"]["ci95_pct"] else "") for m, v in rep["modes"].items() if v.get("gap_to_bf16")]
    bx.set_title("\n".join(gaps), fontsize=8)
    bx.legend()
    fig.suptitle(f"{plan['preset']}: {plan['tokens_per_run'] / 1e6:.3g} M tokens per run, "
                 f"{', '.join(rep['devices'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- command line -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="train every (mode, seed) and write their curves and final validation losses")
    r.add_argument("--preset", choices=list(PRESETS), required=True)
    r.add_argument("--modes", nargs="+", choices=list(MODES), default=["bf16", "coat"])
    r.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    r.add_argument("--runs", nargs="+", default=None, metavar="MODE:SEED",
                   help="exactly these runs instead of --modes x --seeds (to split a plan over device calls)")
    r.add_argument("--data", required=True, help="folder written by benchmarks/fidelity/data.py")
    r.add_argument("--parallel", type=int, default=2,
                   help="runs at once, spread over the visible GPUs (each run on the one holding the fewest)")
    r.add_argument("--time-budget", type=float, default=540, help="seconds for this whole invocation")
    r.add_argument("--min-run-s", type=float, default=60, help="start no run with less time than this left")
    r.add_argument("--stop-margin-s", type=float, default=45, help="runs are told to stop this long before the end")
    r.add_argument("--compile", action="store_true", help="--compile for every mode")
    r.add_argument("--cuda-graph", action="store_true",
                   help="--enable-cuda-graph for every mode (compiled blocks replayed as CUDA graphs, the fast FP8 "
                        "path): larger presets fit a device call; runs of one report must all use it or none")
    r.add_argument("--save-checkpoint", nargs="*", default=[], metavar="MODE:SEED",
                   help="keep this run's final checkpoint (for 'grads')")
    r.add_argument("--resume", action="store_true",
                   help="runs save a checkpoint when they stop (time budget, --stop-every) and continue from it "
                        "on the next invocation with the same --workdir: one run spread over several device "
                        "calls, its curve and final loss as one uninterrupted run's (exact resume)")
    r.add_argument("--stop-every", type=int, default=None, metavar="N",
                   help="with --resume: stop each run at every N-th iteration, so a long run is split into "
                        "calls of known length")
    r.add_argument("--workdir", default=os.path.join(ROOT, ".cache", "fidelity_runs"))
    r.add_argument("--port-base", type=int, default=29700)
    g = sub.add_parser("grads", help="gradient agreement and moment quantization error on a trained checkpoint")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--data", required=True)
    g.add_argument("--modes", nargs="+", default=["fp32", "fp8-linear", "coat"],
                   choices=["fp32", "fp8-linear", "coat"], help="compared with bf16")
    g.add_argument("--batch-size", type=int, default=8)
    for q in (r, g):
        q.add_argument("--out", required=True, help="JSON path")
    rep = sub.add_parser("report", help="merge run (and grads) JSON files: statistics, JSON and PNG")
    rep.add_argument("inputs", nargs="+")
    rep.add_argument("--out", required=True, help="JSON path; the PNG goes beside it")
    rp = sub.add_parser("repeats", help="runs repeated with the same mode and seed: how far one command moves "
                                        "by itself (report counts each seed once a card and refuses repeats)")
    rp.add_argument("inputs", nargs="+")
    rp.add_argument("--out", required=True, help="JSON path")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.what == "run":
            if args.parallel < 1 or args.time_budget <= 0:
                raise UserError("--parallel and --time-budget must be positive")
            if args.stop_every is not None and (args.stop_every < 1 or not args.resume):
                raise UserError("--stop-every needs --resume and a positive N (a run stopped without a checkpoint "
                                "could not continue)")
            result = run(args)
        elif args.what == "grads":
            if args.batch_size < 1:
                raise UserError("--batch-size must be positive")
            manifest = load_manifest(args.data)
            from benchmarks.fidelity.grads import gradient_agreement

            try:
                result = gradient_agreement(
                    args.checkpoint, manifest, args.modes, args.batch_size, environment())
            except (FileNotFoundError, ValueError) as e:
                raise UserError(f"--checkpoint {args.checkpoint}: {e}") from None
        elif args.what == "repeats":
            result = repeats(args.inputs)
        else:
            result = report(args.inputs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = f"{args.out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)
    print("wrote", args.out)
    if args.what == "repeats":
        for g in result["groups"]:
            spread = f"  range {g['range_pct']:.2f}%" if "range_pct" in g else ""
            gap = (f"  mean vs bf16's {g['mean_gap_to_bf16_mean_pct']:+.2f}%"
                   if "mean_gap_to_bf16_mean_pct" in g else "")
            print(f"{g['mode']:18s} seed {g['seed']}: " + ", ".join(f"{v:.4f}" for v in g["final_val_loss"])
                  + spread + gap)
        if result["pooled_run_to_run_std_pct"] is not None:
            print(f"one run's std around its (mode, seed) mean, pooled: {result['pooled_run_to_run_std_pct']:.2f}%")
    if args.what == "report":
        png = os.path.splitext(args.out)[0] + ".png"
        plot(result, png)
        print("wrote", png)
        for mode, m in result["modes"].items():
            gap = m.get("gap_to_bf16")
            ci = gap["ci95_pct"] if gap else None
            print(f"{mode:18s} n={len(m['final_val_loss'])} runs, mean {m['mean']:.4f}"
                  + (f"  gap {gap['mean_pct']:+.3f}% over {len(gap['seeds'])} same-card seed pairs" if gap else "")
                  + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")
                  + (f", ~{gap['seeds_for_interval']} seeds for +-{stats.TARGET_CI_PCT}%"
                     if ci and gap.get("seeds_for_interval") else ""))
            if m.get("unpaired"):
                print(f"{'':18s} not paired ({len(m['unpaired'])}): " + "; ".join(m["unpaired"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
