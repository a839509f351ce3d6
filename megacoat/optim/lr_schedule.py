"""Learning-rate schedule: linear warm-up, then constant / linear / cosine decay to --min-lr (Megatron's)."""
from __future__ import annotations

import math

import torch

from megacoat.optim.config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """Learning rate for optimizer step `step` (0-based: the first update uses lr_at(0))."""
    decay_iters = cfg.lr_decay_iters or train_iters
    if cfg.lr_warmup_iters and step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if step >= decay_iters:
        return cfg.min_lr
    span = max(decay_iters - cfg.lr_warmup_iters, 1)
    progress = (step - cfg.lr_warmup_iters) / span
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:  # cosine
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


class WarmupDecayLR:
    """Sets every param group's lr from `lr_at`. DeepSpeed calls `step()` after each optimizer step and saves
    `state_dict()` in its checkpoints: the step count and the schedule's settings. A resumed run keeps the step
    count and takes the settings from its flags (as Megatron does): `resume()` once the checkpoint is loaded."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, train_iters: int):
        self.optimizer = optimizer
        self.cfg = cfg
        self.train_iters = train_iters
        self.num_steps = 0
        self.saved_schedule: dict | None = None  # the settings of the checkpoint loaded, until resume()
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.num_steps, self.cfg, self.train_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def schedule(self) -> dict:
        """The settings that shape the schedule, under their flags' names."""
        c = self.cfg
        return {"lr": c.lr, "min-lr": c.min_lr, "lr-warmup-iters": c.lr_warmup_iters,
                "lr-decay-iters": c.lr_decay_iters or self.train_iters, "lr-decay-style": c.lr_decay_style,
                "train-iters": self.train_iters}

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "schedule": self.schedule()}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self.saved_schedule = state.get("schedule")
        self._apply()

    def resume(self) -> str | None:
        """After a checkpoint is loaded: set every group's rate from the flags at the loaded step (the optimizer's
        own saved state brings back the rate it was saved with, which the next step would otherwise use) and
        return one line naming the schedule flags that differ from the checkpoint's, or None."""
        self._apply()
        saved, self.saved_schedule = self.saved_schedule, None
        if not saved:
            return None
        now = self.schedule()
        changed = [f"--{k} {saved[k]:g} -> {now[k]:g}" if isinstance(now[k], (int, float)) else
                   f"--{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
        if not changed:
            return None
        return (f"LR schedule rebuilt from the flags at step {self.num_steps} ({', '.join(changed)}): lr "
                f"{self.get_last_lr()[0]:.3e} next")
