"""Model and engine construction: the plain GPT, then the converters applied to it from outside (FP8 here;
tensor/pipeline parallelism join here too), then the optimizer and the DeepSpeed engine around it."""
from __future__ import annotations

import torch
from torch import nn

from megacoat.config import MegacoatConfig
from megacoat.model import GPT
from megacoat.optim import WarmupDecayLR, build_optimizer, param_groups


def build_model(cfg: MegacoatConfig, device: torch.device) -> nn.Module:
    # Same seed on every rank: data-parallel replicas must start identical (DeepSpeed also broadcasts rank 0's).
    torch.manual_seed(cfg.training.seed)
    model = GPT(cfg.model)
    if cfg.fp8.enabled:
        from megacoat.fp8.convert import convert_to_fp8

        model = convert_to_fp8(model, cfg.fp8)
    model = model.to(device)
    if cfg.training.compile:
        # Per block, like torchtitan's apply_compile: one compiled graph reused by every layer, short compile
        # times, and the embedding/loss stay eager.
        for block in model.layers:
            block.compile()
    return model


def build_engine(cfg: MegacoatConfig, model: nn.Module, ds_config: dict, device: torch.device):
    """The DeepSpeed engine with megacoat's optimizer (AdamW or CoatAdamW) and LR schedule as client objects.
    Returns (engine, scheduler)."""
    import deepspeed

    optimizer = build_optimizer(param_groups(model, cfg.optim.weight_decay), cfg.optim, device)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, dist_init_required=False,
        lr_scheduler=lambda opt: WarmupDecayLR(opt, cfg.optim, cfg.training.train_iters))
    return engine, scheduler
