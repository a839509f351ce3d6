"""PyTorch's CUDA caching allocator with expandable segments, unless the user chose its settings.

Under --enable-cuda-graph the blocks' activations live in the CUDA graphs' private memory pool, and everything
else (weights, gradients, the loss's logits) in the allocator's ordinary segments. With fixed-size segments the
two cannot lend each other free space, and the ordinary segments fragment around the large, short-lived logits:
the 1.3 B model in coat at micro-batch 32 ran out of memory on an H100 asking for 3.9 GiB (the size of its bf16
logits) with 57 GiB in the graph pool, 14.6 GiB elsewhere and 2.9 GiB reserved but unused. With expandable segments (segments
that grow in place, so freed space is reused whatever its size) it trains at a 67.3 GiB peak, which is what the
memory estimator predicts. torchtitan's launch script sets the same default.

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
