"""Optimizers (AdamW, CoatAdamW with FP8 moments), their parameter groups and the learning-rate schedule."""
from megacoat.optim.builder import build_optimizer, param_groups
from megacoat.coat.adamw import CoatAdamW
from megacoat.optim.config import OptimizerConfig
from megacoat.optim.lr_schedule import WarmupDecayLR, lr_at

__all__ = ["CoatAdamW", "OptimizerConfig", "WarmupDecayLR", "build_optimizer", "lr_at", "param_groups"]
