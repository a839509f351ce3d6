"""Every random generator a training step draws from (Python, NumPy, torch on the CPU and on each GPU), captured
and restored as one dict: what a checkpoint saves per rank so that a resumed run draws what the uninterrupted
one would have."""
from __future__ import annotations

import random

import numpy as np
import torch


def get_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
