"""One pipeline stage on one GPU: a stage's blocks driven in the order DeepSpeed's 1F1B schedule drives them
(--in-flight forwards before their backwards), without the sends, the bubble or the other stages. What it
isolates is the stage's own compute and launch cost, the part CUDA graphs change:

    python -m benchmarks.parallel.pipeline_stage --layers 12 --micro-batch-size 4 --micro-batches 8 --in-flight 2
    # CPU check
    python -m benchmarks.parallel.pipeline_stage --model tiny --layers 2 --micro-batches 3 --iters 2 \\
        --modes bf16-eager coat-eager

Modes: <recipe>-<how>, recipe bf16 or coat (the default FP8 recipe, as the trainer resolves it under PP), how:
eager, compiled (the blocks compiled as the trainer compiles them), graphed (compiled and captured per micro-batch
slot, megacoat.parallel.stage_graphs, what --enable-cuda-graph does under PP). Every mode trains the same weights
on the same inputs; the JSON records each mode's tokens/s (the stage's, per step), its ratio against
bf16-compiled, and whether coat-graphed's inputs' and parameters' gradients equal coat-compiled's over the
checked steps (with --deterministic, where attention's backward is deterministic).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import RESULTS, environment, write_json

MODELS = {"1.3b": dict(hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, seq_length=2048,
                       vocab_size=32000),
          "tiny": dict(hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, seq_length=128, vocab_size=512)}
MODES = ("bf16-eager", "bf16-compiled", "bf16-graphed", "coat-eager", "coat-compiled", "coat-graphed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    p.add_argument("--layers", type=int, default=12, help="the stage's blocks (the 1.3 B's 24 over PP=2: 12)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches a step")
    p.add_argument("--in-flight", type=int, default=2, help="forwards ahead of their backwards (pp - stage)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["bf16-compiled", "coat-compiled", "coat-graphed"])
    p.add_argument("--check-steps", type=int, default=4, help="steps whose gradients are compared (and warm up)")
    p.add_argument("--iters", type=int, default=20, help="timed steps a repeat")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats, interleaved across modes")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms (warn only)")
    p.add_argument("--out", default=f"{RESULTS}/pipeline_stage.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and any(m.endswith("-graphed") for m in args.modes):
        p.error("--modes: the graphed modes need a CUDA device")
    if args.in_flight < 1 or args.micro_batches < 1:
        p.error("--in-flight and --micro-batches must be at least 1")
    return args


def build_stage(cfg, recipe: str, device: torch.device, compiled: bool, slots: int | None = None,
                warmup: int | None = None):
    """cfg's blocks as one pipeline stage (BlockPipe, compiled as the trainer compiles them under PP when
    `compiled`), through per-slot CUDA graphs when `slots` is given (after `warmup` eager calls a block, the
    library's default when None). The same weights on every call. Returns (forward over the stage, the model,
    the stage's BlockPipes)."""
    from megacoat.coat.convert import after_optimizer_step, convert_to_coat
    from megacoat.coat.recipe import RECIPES
    from megacoat.model import GPT
    from megacoat.parallel.pipeline import BlockPipe
    from megacoat.parallel.stage_graphs import StageGraphs

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    if recipe != "bf16":
        model = convert_to_coat(model, RECIPES[recipe].for_layout(1, 2, cfg.vocab_size, cfg.hidden_size))
    model = model.to(device).to(torch.bfloat16)
    after_optimizer_step(model)  # the FP8 weight copies
    if compiled:
        for block in model.layers:
            block.compile()
    graphs = None
    if slots is not None:
        graphs = StageGraphs() if warmup is None else StageGraphs(warmup=warmup)
        graphs.set_slots(slots)
    pipes = [BlockPipe(block, model._rope_cpu, graphs) for block in model.layers]

    def forward(x):
        for pipe in pipes:
            x = pipe(x)
        return x
    return forward, model, pipes


def build(args, mode: str, device: torch.device):
    """(forward over the stage's blocks, the blocks' parameters) for a mode."""
    from megacoat.model.config import ModelConfig

    recipe, how = mode.split("-")
    slots = min(args.in_flight, args.micro_batches) if how == "graphed" else None
    forward, model, _ = build_stage(ModelConfig(num_layers=args.layers, **MODELS[args.model]), recipe, device,
                                    compiled=how != "eager", slots=slots)
    return forward, list(model.layers.parameters())


def one_f_one_b(micro_batches: int, ahead: int) -> list[tuple[str, int]]:
    """A stage's order of forwards (F) and backwards (B) of micro-batches under 1F1B with `ahead` in flight."""
    order, f = [("F", i) for i in range(min(ahead, micro_batches))], min(ahead, micro_batches)
    for b in range(micro_batches):
        order.append(("B", b))
        if f < micro_batches:
            order.append(("F", f))
            f += 1
    return order


def step(forward, params, xs, gys, ahead):
    """One step: every micro-batch through the stage in 1F1B order, the parameters' gradients cleared first;
    returns the inputs' gradients."""
    for p in params:
        p.grad = None  # as the optimizer's zero_grad(set_to_none=True)
    live, dxs = {}, [None] * len(xs)
    for kind, i in one_f_one_b(len(xs), ahead):
        if kind == "F":
            x = xs[i].detach().requires_grad_()
            live[i] = (x, forward(x))
        else:
            x, y = live.pop(i)
            torch.autograd.backward(y, gys[i])
            dxs[i] = x.grad
    return dxs


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    shape = (args.micro_batch_size, MODELS[args.model]["seq_length"], MODELS[args.model]["hidden_size"])
    torch.manual_seed(1)
    xs = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(args.micro_batches)]
    gys = [torch.randn(shape, device=device, dtype=torch.bfloat16) * 1e-3 for _ in range(args.micro_batches)]
    tokens = args.micro_batches * args.micro_batch_size * shape[1]
    out = {**environment(), "model": args.model, "layers": args.layers, "micro_batch_size": args.micro_batch_size,
           "micro_batches": args.micro_batches, "in_flight": args.in_flight, "iters": args.iters,
           "repeats": args.repeats, "deterministic": args.deterministic, "modes": {}}
    built, checked = {}, {}
    for mode in args.modes:
        forward, params = build(args, mode, device)
        grads = []
        for _ in range(args.check_steps):  # warm-up, compile and capture; the gradients kept for the comparison
            dxs = step(forward, params, xs, gys, args.in_flight)
            grads.append([t.float().clone() for t in dxs + [p.grad for p in params]])
        built[mode], checked[mode] = (forward, params), grads
        print(f"{mode}: built", flush=True)
    for repeat in range(args.repeats):
        for mode, (forward, params) in built.items():
            sync(device)
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                step(forward, params, xs, gys, args.in_flight)
                sync(device)
                times.append(time.perf_counter() - start)
            out["modes"].setdefault(mode, {"step_s": []})["step_s"].append(statistics.median(times))
            print(f"{mode} repeat {repeat}: {tokens / statistics.median(times):,.0f} tokens/s", flush=True)
    for mode, row in out["modes"].items():
        row["tokens_per_s"] = tokens / statistics.median(row["step_s"])
    base = out["modes"].get("bf16-compiled", {}).get("tokens_per_s")
    for row in out["modes"].values():
        if base:
            row["speedup_vs_bf16_compiled"] = row["tokens_per_s"] / base
    for recipe in ("bf16", "coat"):
        a, b = checked.get(f"{recipe}-compiled"), checked.get(f"{recipe}-graphed")
        if a and b:
            out[f"{recipe}_graphed_vs_compiled"] = [
                {"equal": all(torch.equal(u, v) for u, v in zip(sa, sb)),
                 "max_abs_difference": max(float((u - v).abs().max()) for u, v in zip(sa, sb))}
                for sa, sb in zip(a, b)]
    write_json(args.out, out)
    print({m: round(r.get("speedup_vs_bf16_compiled", 0), 3) for m, r in out["modes"].items()})
    return out


if __name__ == "__main__":
    main()
