"""The fused CoatAdamW step behind one signature: the CUDA kernel (kernels/coat_adamw.cu, built through DeepSpeed's
op_builder) and the plain-torch reference (`coat_adamw_step_ref`, the contract the kernel is tested against).

`backend="auto"` takes the kernel for CUDA tensors and the reference for CPU tensors. On a GPU where the extension
cannot be built (no nvcc, ninja or compiler), "auto" stops with the build error instead of falling back to the
reference: the reference runs an order of magnitude slower and allocates float32 temporaries, so a fallback would
turn a training run's speed and memory figures into the reference's without anyone asking for it. Pass
backend="torch" to run the reference on a GPU on purpose.
"""
from __future__ import annotations

import torch

from megacoat.ops.coat_adamw_ref import adam_scalars, coat_adamw_step_ref
from megacoat.ops.coat_adamw_tables import build_remainder_table, build_tables, check_lists, chunk_elems
from megacoat.ops.numerics import K_MAX, K_MIN, fp8_max, log2_dynamic_range

BACKENDS = ("auto", "cuda", "torch")
_module = None


def load_extension(verbose: bool = False):
    """Build (first call; cached on disk by torch) and import the extension."""
    global _module
    if _module is None:
        from megacoat.ops.op_builder import CoatAdamWBuilder

        _module = CoatAdamWBuilder().load(verbose=verbose)
        if any(_module.chunk_elems(g) != chunk_elems(g) for g in (16, 128, 256)):
            raise RuntimeError("kernels/coat_adamw.h and megacoat/ops/coat_adamw_tables.py disagree on chunk size")
    return _module


def resolve_backend(backend: str, device: torch.device) -> str:
    """"cuda" or "torch" for tensors on `device` (see the module docstring for "auto")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device.type != "cuda":
        if backend == "cuda":
            raise ValueError(f"the cuda backend needs CUDA tensors, got {device}")
        return "torch"
    if backend == "auto":
        try:
            load_extension()
        except Exception as e:  # noqa: BLE001 -- any build failure: say what it was and how to go on
            raise RuntimeError(f"CoatAdamW: the CUDA extension could not be built ({type(e).__name__}: {e}); "
                               "install nvcc and ninja, or pass backend='torch' to run the (slow) reference") from e
        return "cuda"
    return backend


def coat_adamw_step_cuda(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, step: int, group_size: int, expand: bool,
                         nonfinite: torch.Tensor | None = None, remainders=None,
                         skip: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
    """The CUDA kernel: one launch for the whole list of tensors; same signature and contract as the reference."""
    if not params:
        return
    if not params[0].is_cuda:
        raise ValueError("the CUDA backend needs CUDA tensors")
    check_lists(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size, remainders)
    ext = load_extension()
    rem_table = None if remainders is None else build_remainder_table(remainders)
    ptr_table, chunk_table, _ = build_tables(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size)
    step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step)
    dm, dv = m_q[0].dtype, v_q[0].dtype
    ext.coat_adamw_step(ptr_table, chunk_table, nonfinite, rem_table, skip, grad_scale, lr * weight_decay,
                        step_size, beta1, beta2, bc2_sqrt, eps, fp8_max(dm), fp8_max(dv), log2_dynamic_range(dm),
                        log2_dynamic_range(dv), K_MIN, K_MAX, dm == torch.float8_e5m2, dv == torch.float8_e5m2,
                        bool(expand),
                        params[0].dtype == torch.bfloat16, grads[0].dtype == torch.bfloat16, group_size)


def coat_adamw_step(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, *, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, step: int, group_size: int, expand: bool,
                    nonfinite: torch.Tensor | None = None, backend: str = "auto", remainders=None,
                    skip: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
    """One fused AdamW step with FP8 moments over lists of tensors; see `coat_adamw_step_ref` for the contract
    (`remainders`: bf16 parameters whose fp32 master's low halves are kept beside them; `grad_scale`: a device
    divisor of the gradients, the clipping factor)."""
    if not params:
        return
    fn = coat_adamw_step_cuda if resolve_backend(backend, params[0].device) == "cuda" else coat_adamw_step_ref
    fn(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       weight_decay=weight_decay, step=step, group_size=group_size, expand=expand, nonfinite=nonfinite,
       remainders=remainders, skip=skip, grad_scale=grad_scale)
