"""Every random generator a training step draws from (Python, NumPy, torch on the CPU and on each GPU), captured
and restored as one dict: what a checkpoint saves per rank so that a resumed run draws what the uninterrupted
one would have. The file is read as data (weights_only); one that is not such a dict is an error naming it."""
from __future__ import annotations

import random

import numpy as np
import torch

from megacoat.checkpoint.integrity import CheckpointFileError, safe_torch_load


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


def load_rng_file(path: str) -> None:
    """Restore the generators from a file get_rng_state's dict was saved to."""
    state = safe_torch_load(path)
    try:
        if not isinstance(state, dict):
            raise TypeError(f"a {type(state).__name__}, not a dict")
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointFileError(f"{path}: not an RNG state megacoat saved ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:160]})") from None
