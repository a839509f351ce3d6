"""The process environment a run sets before it touches the GPU: the CUDA allocator's settings and cuBLAS's
workspace. Both are read once by torch (at the first allocation, the first GEMM); a value the user set is kept.

CUDA allocator: expandable segments, unless PYTORCH_CUDA_ALLOC_CONF is set. Under --enable-cuda-graph the blocks'
activations live in the graphs' private pool and everything else in the allocator's ordinary segments; with
fixed-size segments the two cannot lend each other free space, and the ordinary segments fragment around the
large, short-lived logits. Expandable segments grow in place (torchtitan's launch script sets the same default).

cuBLAS workspace (`--cublas-workspace`; `auto`, the default, is `none` where FP8 GEMMs run): with a workspace,
cuBLASLt runs Hopper's FP8 GEMMs with a dynamic tile scheduler whose counters live in the workspace, so each GEMM
is preceded by a memset of it; without one it picks the same tiles with a static schedule and sets nothing. BF16's
GEMMs do not gain. Asking for `none` over a different value the user set is an error naming it.
"""
from __future__ import annotations

import os
from typing import MutableMapping

import torch

from megacoat.config import CUBLAS_WORKSPACES

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


NO_WORKSPACE = {"CUBLASLT_WORKSPACE_SIZE": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"}  # KiB; cuBLAS's size:count


def apply_cublas_workspace(choice: str, fp8_gemms: bool, environ: MutableMapping[str, str] = os.environ) -> str:
    """`default`: torch's workspace, the environment left alone; `none`: both variables set to no workspace; `auto`:
    `none` where the run has FP8 GEMMs (fp8_gemms), `default` otherwise. Returns the setting in effect for the
    startup banner."""
    if choice not in CUBLAS_WORKSPACES:
        raise ValueError(f"--cublas-workspace must be one of {', '.join(CUBLAS_WORKSPACES)}, got {choice!r}")
    if choice == "auto":
        own = [f"{k}={environ[k]}" for k in NO_WORKSPACE if k in environ]
        if own:  # the user's own settings win over auto
            return "the environment's (" + ", ".join(own) + ")"
        if not fp8_gemms:
            return "default"
        choice = "none"
    if choice == "default":
        return "default"
    clash = [f"{k}={environ[k]}" for k, v in NO_WORKSPACE.items() if environ.get(k, v) != v]
    if clash:
        raise ValueError(f"--cublas-workspace none conflicts with {' and '.join(clash)} in the environment: unset it, "
                         "or drop the flag")
    environ.update(NO_WORKSPACE)
    return "none (CUBLASLT_WORKSPACE_SIZE=0, CUBLAS_WORKSPACE_CONFIG=:0:0)"
