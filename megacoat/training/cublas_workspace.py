"""cuBLAS and cuBLASLt without a workspace (`--cublas-workspace none`; `auto`, the default, where FP8 GEMMs run).

With a workspace, cuBLASLt runs Hopper's FP8 GEMMs with a dynamic tile scheduler whose counters live in the
workspace, so each GEMM is preceded by a memset of it; without one it picks the same tiles with a static schedule
and sets nothing. BF16's GEMMs do not gain, so `auto` keeps torch's workspace for runs without FP8 GEMMs.

torch reads both variables once, at its first GEMM, so they are set before the trainer touches the GPU. A value the
user already set is never overwritten: asking for `none` over a different one is an error naming it.
"""
from __future__ import annotations

import os
from typing import MutableMapping

from megacoat.config import CUBLAS_WORKSPACES

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
