"""The run summary's FP8 row: what FP8 saved, measured on the trained model when a run ends.

Optimizer states: the bytes CoatAdamW holds for its two moments on this rank (FP8 codes, group scales,
expansion exponents) against AdamW's two float32 moments of the same parameters. Activations: the bytes autograd
keeps for backward (unique storages, parameters left out) over one micro-batch through the first transformer
layer, against a plain layer of the same shape in the run's activation dtype, both times the number of layers;
measured with one layer per rank only (no tensor or pipeline parallelism), else left out of the row.
"""
from __future__ import annotations

import torch

from megacoat.coat.adamw import STATE_KEYS, CoatAdamW
from megacoat.model.gpt import TransformerBlock
from megacoat.training.zero3 import gathered

MIB = 1 << 20


def fp8_row(trainer, final_loss: float | None) -> str | None:
    """'optimizer states ...; activations saved for backward ...; final loss ...', or None when the run used no
    FP8 (neither CoatAdamW nor FP8 layers)."""
    cfg = trainer.cfg
    if not (cfg.optim.fp8_optimizer or cfg.fp8.enabled):
        return None
    parts = []
    opt = _coat_adamw(trainer.engine.optimizer)
    if opt is not None and opt.state:  # a run that took no step holds no state yet
        coat, adamw = optimizer_state_bytes(opt)
        parts.append(f"optimizer states {coat / MIB:.2f} MiB against AdamW's {adamw / MIB:.2f} MiB "
                     f"({coat / adamw:.2f}x)")
    if cfg.fp8.enabled:
        if trainer.parallel.tp_size == 1 and trainer.parallel.pp_size == 1:
            m, t = cfg.model, cfg.training
            with gathered(trainer.engine.module.layers[0], cfg.parallel.zero_stage):
                fp8, plain, dtype = layer_saved_bytes(trainer.engine.module, t.micro_batch_size)
            parts.append(f"activations saved for backward {fp8 * m.num_layers / MIB:.2f} MiB against "
                         f"{plain * m.num_layers / MIB:.2f} MiB in {str(dtype).removeprefix('torch.')} "
                         f"({fp8 / plain:.2f}x; one micro-batch through layer 1, times {m.num_layers} layers)")
        else:
            parts.append("activations not measured (tensor or pipeline parallel)")
    if not parts:
        return None
    return "; ".join(parts + ([f"final loss {final_loss:.4f}"] if final_loss is not None else []))


def _coat_adamw(optimizer) -> CoatAdamW | None:
    """The CoatAdamW inside DeepSpeed's wrappers (ZeRO's optimizer keeps the one it wraps as `.optimizer`)."""
    while optimizer is not None and not isinstance(optimizer, CoatAdamW):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def optimizer_state_bytes(opt: CoatAdamW) -> tuple[int, int]:
    """(bytes of CoatAdamW's moments, bytes of AdamW's float32 moments) for the parameters `opt` steps."""
    coat = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k in STATE_KEYS)
    # counted from the state: ZeRO-3 hands CoatAdamW its partitions only during the step
    numel = sum(s["exp_avg"].numel() for s in opt.state.values() if "exp_avg" in s)
    return coat, 8 * numel


def saved_bytes(fn, params) -> int:
    """Bytes of the unique storages autograd saves while fn() runs, parameters left out."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() != 0:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def layer_saved_bytes(model, micro_batch: int) -> tuple[int, int, torch.dtype]:
    """(FP8 layer's saved bytes, plain layer's, activation dtype) for one micro-batch through model.layers[0].
    The FP8 layer runs uncompiled (its forward), as eager training would; its delayed-scaling histories see one
    more amax, which is harmless once the run is over."""
    block = model.layers[0]
    weight = next(block.parameters())
    cfg = model.cfg
    cos, sin = model._rope(weight.device)
    x = torch.randn(micro_batch, cfg.seq_length, cfg.hidden_size, dtype=weight.dtype, device=weight.device,
                    requires_grad=True)
    fp8 = saved_bytes(lambda: block.forward(x, cos, sin), block.parameters())
    with torch.device(weight.device):
        plain = TransformerBlock(cfg).to(weight.dtype)
    plain_bytes = saved_bytes(lambda: plain(x, cos, sin), plain.parameters())
    return fp8, plain_bytes, weight.dtype
