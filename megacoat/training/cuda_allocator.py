"""PyTorch's CUDA caching allocator with expandable segments, unless the user chose its settings.

Under --enable-cuda-graph the blocks' activations live in the graphs' private pool and everything else in the
allocator's ordinary segments; with fixed-size segments the two cannot lend each other free space, and the
ordinary segments fragment around the large, short-lived logits. Expandable segments grow in place, so freed space
is reused whatever its size (torchtitan's launch script sets the same default).

A PYTORCH_CUDA_ALLOC_CONF set by the user is left exactly as it is.
"""
from __future__ import annotations

import os
from typing import MutableMapping

import torch

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def default_allocator_settings(environ: MutableMapping[str, str] = os.environ) -> str:
    """Expandable segments where the user set no allocator settings; returns the settings in effect. Call it
    before the first CUDA allocation: the allocator reads the variable once."""
    if ALLOC_CONF in environ:
        return environ[ALLOC_CONF]
    environ[ALLOC_CONF] = DEFAULT_ALLOC_CONF
    if environ is os.environ and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(DEFAULT_ALLOC_CONF)  # already read: new segments follow this
    return DEFAULT_ALLOC_CONF
