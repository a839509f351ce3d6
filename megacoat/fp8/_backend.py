"""Which implementation runs: the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1) or the torch reference."""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """'auto': Triton on CUDA tensors, the torch reference elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return x.is_cuda
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 (set before importing triton)")
    return backend == "triton"
