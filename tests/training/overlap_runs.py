"""Trainer steps on each rank with what the overlapped-reduction tests compare: the order of the collectives
(and of device-wide synchronizes) against each block's backward, the gradients the optimizer steps with, and the
weights after the steps. On CPU run in each rank by tests/parallel/dist_helpers.run_ranks (gloo); on GPUs under
DeepSpeed's launcher (NCCL), each rank writing its results to OUT/rank{R}.pkl:

    deepspeed --num_gpus 2 tests/training/overlap_runs.py OUT STEPS '[[flags of run 1], [flags of run 2], ...]'
"""
from __future__ import annotations

import json
import os
import pickle
import sys

import torch
import torch.distributed as dist

TINY = ["--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "4", "--lr", "3e-3",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--clip-grad", "0.05"]
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_tensor", "all_reduce_coalesced")
EVENTS: list = []  # this process's record, cleared at each step


def record_collectives() -> None:
    """Append ("C", name, numel) to EVENTS at every call of a torch.distributed reduction (DeepSpeed's comm layer
    calls them through the module); once per process."""
    if getattr(dist, "_recorded_for_overlap_tests", False):
        return
    dist._recorded_for_overlap_tests = True
    for name in COLLECTIVES:
        own = getattr(dist, name)

        def wrapped(*args, _own=own, _name=name, **kwargs):
            tensor = kwargs.get("tensor", args[0] if args else None)
            EVENTS.append(("C", _name, tensor.numel() if torch.is_tensor(tensor) else -1))
            return _own(*args, **kwargs)

        setattr(dist, name, wrapped)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    synchronize = accelerator.synchronize
    accelerator.synchronize = lambda *a, **k: (EVENTS.append(("S",)), synchronize(*a, **k))[1]


def train(argv: list[str], steps: int) -> dict:
    """`steps` optimizer steps of pretrain_gpt.py's trainer with `argv`. Returns, from this rank: the events of
    the last step ("B<"/"B>" with a block's index where its backward starts and ends, "C" collectives,
    "micro" before each micro-batch), the gradients the client optimizer stepped with at each step, the global
    gradient norms and the weights at the end."""
    from megacoat.arguments import parse_config
    from megacoat.training.trainer import Trainer

    trainer = Trainer(parse_config(TINY + argv))
    engine = trainer.engine
    events = EVENTS
    record_collectives()
    for i, block in enumerate(engine.module.layers):
        block.register_full_backward_pre_hook(lambda m, g, i=i: events.append(("B<", i)))
        block.register_full_backward_hook(lambda m, gi, go, i=i: events.append(("B>", i)))
    forward = engine.forward
    engine.forward = lambda *a, **k: (events.append(("micro",)), forward(*a, **k))[1]
    client = engine.optimizer.optimizer
    grads = []
    client_step = client.step

    def step(*args, **kwargs):
        grads.append([_host(p.grad) for g in client.param_groups for p in g["params"] if p.grad is not None])
        return client_step(*args, **kwargs)

    client.step = step
    data = trainer._loader(trainer.train_ds, 0)
    norms = []
    for _ in range(steps):
        events.clear()
        _, norm, _ = trainer.train_step(data)
        norms.append(float(norm))
    weights = [_host(p) for p in engine.module.parameters()]
    zo = engine.optimizer
    return {"events": list(events), "grads": grads, "norms": norms, "weights": weights,
            "overlap": bool(getattr(zo, "overlap_comm", False)),
            "patched": sorted(k for k in ("copy_grads_in_partition", "independent_gradient_partition_epilogue")
                              if k in vars(zo))}


def _host(t: torch.Tensor):
    """The values as a float64 numpy array (exact for bf16 and fp32): tensors themselves would cross the rank's
    result queue through shared memory, which the rank's exit can close before the parent reads it."""
    return t.detach().to(torch.float64).cpu().numpy()


def train_variants(variants: list[list[str]], steps: int) -> list[dict]:
    """train() for each argv in turn, in the same processes."""
    return [train(argv, steps) for argv in variants]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launcher adds it first
    out_dir, steps, variants = args[0], int(args[1]), json.loads(args[2])
    results = train_variants(variants, steps)
    with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
