"""Checkpoints: DeepSpeed's engine state (weights, optimizer, LR schedule) plus megacoat's own (iteration,
consumed samples, the config that made it)."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


def save_checkpoint(engine, directory: str, state: TrainState, config_dict: dict) -> str:
    tag = f"iter_{state.iteration:07d}"
    engine.save_checkpoint(directory, tag=tag, client_state={
        "iteration": state.iteration, "consumed_samples": state.consumed_samples, "megacoat_config": config_dict})
    return os.path.join(directory, tag)


def load_checkpoint(engine, directory: str, config_dict: dict) -> tuple[str, TrainState] | None:
    """Load the latest checkpoint under `directory`; None when there is none yet. A checkpoint made by a
    different model is an error naming the differing fields."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--load {directory}: no such directory")
    path, client = engine.load_checkpoint(directory)
    if path is None:
        return None
    saved_model = client.get("megacoat_config", {}).get("model")
    now = config_dict["model"]
    if saved_model is not None and saved_model != now:
        diff = {k: (v, now.get(k)) for k, v in saved_model.items() if now.get(k) != v}
        raise ValueError(f"--load {path}: the checkpoint's model differs from the flags (saved, now): {diff}")
    return path, TrainState(client["iteration"], client["consumed_samples"])
