"""Convert megacoat checkpoints between layouts, offline, without a GPU.

To the layout-free form (full fp32 tensors per parameter, CoatAdamW's moments dequantized; any layout and either
optimizer can --load it):

    python tools/convert_checkpoint.py --load ckpt/run --output ckpt/run_free            # the `latest` one
    python tools/convert_checkpoint.py --load ckpt/run/iter_0001000 --output ckpt/run_free --weights-only

Back into DeepSpeed's files for a chosen layout (launches that many CPU ranks of pretrain_gpt.py over gloo,
which load the layout-free form and save it at once; extra pretrain_gpt.py flags after `--`, e.g. --bf16):

    python tools/convert_checkpoint.py --load ckpt/run_free --output ckpt/run_tp2 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --data-parallel-size 2 --zero-stage 1

`pretrain_gpt.py --load` converts by itself when the layout or the optimizer changed (into
`iter_N/layout_free/`); this tool does it ahead of time, or where the checkpoint's directory is read-only.
"""
from __future__ import annotations

import json
import os
import socket
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacoat.arguments import ArgumentParser  # noqa: E402
from megacoat.checkpoint.layout_free import is_layout_free  # noqa: E402
from megacoat.checkpoint.paths import META_FILE, resolve_tag_dir, write_latest, write_text_atomic  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_meta(src: str) -> dict:
    path = os.path.join(src, META_FILE)
    with open(path) as f:
        try:
            meta = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("megacoat_config"), dict):
        raise ValueError(f"{path}: not a megacoat checkpoint record (no megacoat_config)")
    return meta


def to_layout_free(load: str, output: str, weights_only: bool = False) -> str:
    from megacoat.checkpoint.from_deepspeed import to_layout_free as convert

    src = resolve_tag_dir(load)
    meta = read_meta(src)
    if is_layout_free(meta):
        raise ValueError(f"--load {src}: already layout-free (pass a layout flag to write DeepSpeed files)")
    tag = os.path.basename(os.path.normpath(src))
    os.makedirs(output, exist_ok=True)
    out = convert(src, os.path.join(output, tag), with_state=not weights_only)
    write_latest(output, tag)
    return out


def pretrain_flags(cfg: dict) -> list[str]:
    """pretrain_gpt.py flags that rebuild the model and optimizer of a saved megacoat_config."""
    m, o = cfg["model"], cfg["optim"]
    flags = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"], "--ffn-hidden-size",
             m["ffn_hidden_size"], "--num-attention-heads", m["num_attention_heads"], "--num-query-groups",
             m["num_query_groups"], "--seq-length", m["seq_length"], "--vocab-size", m["vocab_size"],
             "--norm-epsilon", m["norm_eps"], "--rotary-base", m["rope_theta"], "--init-method-std", m["init_std"],
             "--lr", o["lr"], "--min-lr", o["min_lr"], "--lr-warmup-iters", o["lr_warmup_iters"],
             "--lr-decay-style", o["lr_decay_style"], "--weight-decay", o["weight_decay"],
             "--adam-beta1", o["adam_beta1"], "--adam-beta2", o["adam_beta2"], "--adam-eps", o["adam_eps"],
             "--clip-grad", o["clip_grad"], "--fp8-m-dtype", o["fp8_m_dtype"], "--fp8-v-dtype", o["fp8_v_dtype"],
             "--fp8-group-size", o["fp8_group_size"]]
    if o["lr_decay_iters"] is not None:
        flags += ["--lr-decay-iters", o["lr_decay_iters"]]
    flags += [f for f, on in (("--untie-embeddings-and-output-weights", not m["tie_embeddings"]),
                              ("--fp8-optimizer", o["fp8_optimizer"]), ("--fp8-no-expansion", not o["fp8_expand"]))
              if on]
    return [str(f) for f in flags]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_layout(load: str, output: str, tp: int, pp: int, dp: int, zero: int, extra: list[str]) -> str:
    """DeepSpeed files at TP x PP x DP (ZeRO stage `zero`) from a layout-free checkpoint, on CPU ranks."""
    src = resolve_tag_dir(load)
    meta = read_meta(src)
    if not is_layout_free(meta):
        raise ValueError(f"--load {src}: convert it to the layout-free form first (run without layout flags)")
    cfg, t = meta["megacoat_config"], meta["megacoat_config"]["training"]
    staging = tempfile.mkdtemp(prefix="megacoat-convert-")  # the ranks' working directory
    ranks = tp * pp * dp
    gbs = t["global_batch_size"]
    mbs = next(m for m in (t["micro_batch_size"], 1) if gbs % (m * dp) == 0) if gbs % dp == 0 else None
    if mbs is None:
        raise ValueError(f"--data-parallel-size {dp} does not divide the run's global batch {gbs}")
    argv = pretrain_flags(cfg) + [
        "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", str(max(meta["iteration"], 1)),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), "--zero-stage", str(zero),
        "--load", os.path.abspath(src), "--save", os.path.abspath(output), "--mock-data", "--eval-iters", "0", "--log-interval", "1"]
    if meta.get("optimizer") is None:
        argv.append("--finetune")
    if "--bf16" not in extra:
        argv.append("--fp32")
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(_free_port())]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(launcher + [os.path.join(ROOT, "pretrain_gpt.py")] + argv + extra, env=env,
                              capture_output=True, text=True, cwd=staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if proc.returncode != 0:
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
        raise RuntimeError(f"pretrain_gpt.py exited with {proc.returncode} writing --output {output}: "
                           + (said[-1][len("error:"):].strip() if said else (proc.stdout + proc.stderr)[-3000:]))
    out = resolve_tag_dir(output)
    with open(os.path.join(out, META_FILE)) as f:
        written = json.load(f)
    # The conversion ran on mock data and a schedule of `iteration` steps: keep the source's own record.
    written["tokenizer"] = meta.get("tokenizer")
    written["megacoat_config"] = {**cfg, "parallel": written["megacoat_config"]["parallel"]}
    write_text_atomic(os.path.join(out, META_FILE), json.dumps(written, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = ArgumentParser(description=__doc__.split("\n\n")[0])  # a bad flag: one error line, exit 1
    p.add_argument("--load", required=True, help="checkpoint directory (--save DIR) or one iter_* inside it")
    p.add_argument("--output", required=True, help="directory to write (a --save DIR: iter_N/ and latest)")
    p.add_argument("--weights-only", action="store_true", help="leave the optimizer state out (for --finetune)")
    g = p.add_argument_group("target layout (from a layout-free checkpoint; all default to 1, ZeRO-1)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--data-parallel-size", type=int, default=None)
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=None)
    args = p.parse_args(argv)
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size)
    for flag, value in zip(("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                            "--data-parallel-size"), sizes):
        if value is not None and value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 1
    try:
        if all(v is None for v in sizes + (args.zero_stage,)):
            out = to_layout_free(args.load, args.output, args.weights_only)
            print(f"wrote layout-free checkpoint {out}")
        else:
            out = to_layout(args.load, args.output, *(v or 1 for v in sizes),
                            1 if args.zero_stage is None else args.zero_stage, extra)
            print(f"wrote {out} for TP {sizes[0] or 1} x PP {sizes[1] or 1} x DP {sizes[2] or 1}")
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
