"""The fused CoatAdamW step with its three backends behind one signature: CUDA (kernels/coat_adamw.cu through
DeepSpeed's op_builder), Triton, and the plain-torch reference. `backend="auto"` takes CUDA on a GPU (Triton if the
extension cannot be built there) and the reference on the CPU."""
from __future__ import annotations

import warnings

import torch

from megacoat.ops.coat_adamw_ref import coat_adamw_step_ref

BACKENDS = ("auto", "cuda", "triton", "torch")
_cuda_unavailable: str | None = None  # why the CUDA extension could not be built, once known


def resolve_backend(backend: str, device: torch.device) -> str:
    global _cuda_unavailable
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device.type != "cuda":
        if backend in ("cuda",):
            raise ValueError(f"the {backend} backend needs CUDA tensors, got {device}")
        # Triton on CPU only runs under TRITON_INTERPRET (tests); "auto" takes the reference.
        return "torch" if backend == "auto" else backend
    if backend != "auto":
        return backend
    if _cuda_unavailable is None:
        try:
            from megacoat.ops.coat_adamw_cuda import load_extension

            load_extension()
            _cuda_unavailable = ""
        except Exception as e:  # no nvcc / ninja / compiler: the Triton kernel does the same step
            _cuda_unavailable = f"{type(e).__name__}: {e}"
            warnings.warn(f"CoatAdamW: CUDA extension unavailable ({_cuda_unavailable}); using the Triton kernel")
    return "triton" if _cuda_unavailable else "cuda"


def coat_adamw_step(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, *, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, step: int, group_size: int, expand: bool,
                    nonfinite: torch.Tensor | None = None, backend: str = "auto", remainders=None) -> None:
    """One fused AdamW step with FP8 moments over lists of tensors; see `coat_adamw_step_ref` for the contract.
    `remainders` (bf16 parameters with fp32-master remainders) is taken by the CUDA and torch backends."""
    if not params:
        return
    kind = resolve_backend(backend, params[0].device)
    extra = {}
    if remainders is not None:
        if kind == "triton":
            raise ValueError("CoatAdamW with parameter remainders runs on the cuda or torch backend, not triton")
        extra["remainders"] = remainders
    if kind == "cuda":
        from megacoat.ops.coat_adamw_cuda import coat_adamw_step_cuda as fn
    elif kind == "triton":
        from megacoat.ops.coat_adamw_triton import coat_adamw_step_triton as fn
    else:
        fn = coat_adamw_step_ref
    fn(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       weight_decay=weight_decay, step=step, group_size=group_size, expand=expand, nonfinite=nonfinite, **extra)
