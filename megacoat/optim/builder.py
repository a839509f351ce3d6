"""Build the optimizer from an OptimizerConfig: weight-decay groups and the AdamW flavour."""
from __future__ import annotations

import torch
from torch import nn

from megacoat.optim.config import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; vectors (norm weights, biases) do not, as in Megatron and nanoGPT. A tied weight
    appears once (named_parameters de-duplicates)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(groups: list[dict], cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """torch AdamW (fused kernel on CUDA) with fp32 moments, or CoatAdamW with FP8 moments."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay)
    if cfg.fp8_optimizer:
        from megacoat.coat.adamw import CoatAdamW

        return CoatAdamW(groups, m_dtype=cfg.fp8_m_dtype, v_dtype=cfg.fp8_v_dtype, group_size=cfg.fp8_group_size,
                         expand=cfg.fp8_expand, param_remainders=cfg.main_params_dtype == "bf16-remainder",
                         **kwargs)
    return torch.optim.AdamW(groups, fused=device.type == "cuda", **kwargs)
