"""Optimizers and learning-rate schedules: parameter groups, warmup/decay schedules, CoatAdamW."""
