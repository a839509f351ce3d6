"""CUDA backend of the fused CoatAdamW step: kernels/coat_adamw.cu, built through `CoatAdamWBuilder`.

Same signature and contract as `coat_adamw_step_ref`; one launch for the whole list of tensors.
"""
from __future__ import annotations

import math
import os

import torch

from megacoat.fp8.formats import E5M2, get_format
from megacoat.ops.coat_adamw_ref import K_MAX, K_MIN, adam_scalars
from megacoat.ops.coat_adamw_tables import build_remainder_table, build_tables, check_lists, chunk_elems

_module = None


# Kernel variants built into the extension, by their index in kernels/coat_adamw.h (kVariant*). All are built so
# that one benchmark run times them side by side (benchmarks/bench_optimizer.py); the default is the fastest measured
# on the device: v3, 5.91 ms for 1 B parameters on an H200 (benchmarks/results/bench_optimizer_notes.md). v4 is
# unmeasured until a GPU session confirms it correct (tests/ops/test_coat_adamw.py, gpu) and faster.
CUDA_VARIANTS = ("v3", "v3-interleaved", "v4", "v4-2blocks")
DEFAULT_CUDA_VARIANT = "v3"
VARIANT_ENV = "MEGACOAT_COAT_ADAMW_CUDA_VARIANT"


def cuda_variant(name: str | None = None) -> int:
    """Index of a kernel variant: `name`, else $MEGACOAT_COAT_ADAMW_CUDA_VARIANT, else the default."""
    name = name or os.environ.get(VARIANT_ENV) or DEFAULT_CUDA_VARIANT
    if name not in CUDA_VARIANTS:
        raise ValueError(f"CoatAdamW CUDA kernel variant must be one of {CUDA_VARIANTS}, got {name!r}")
    return CUDA_VARIANTS.index(name)


def load_extension(verbose: bool = False):
    """Build (first call; cached on disk by torch) and import the extension."""
    global _module
    if _module is None:
        from megacoat.ops.op_builder import CoatAdamWBuilder

        _module = CoatAdamWBuilder().load(verbose=verbose)
        if any(_module.chunk_elems(g) != chunk_elems(g) for g in (16, 128, 256)):
            raise RuntimeError("kernels/coat_adamw.h and megacoat/ops/coat_adamw_tables.py disagree on chunk size")
        if _module.num_variants != len(CUDA_VARIANTS):
            raise RuntimeError(f"kernels/coat_adamw.h builds {_module.num_variants} variants, CUDA_VARIANTS names "
                               f"{len(CUDA_VARIANTS)}")
    return _module


def coat_adamw_step_cuda(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, step: int, group_size: int, expand: bool,
                         nonfinite: torch.Tensor | None = None, variant: str | None = None, remainders=None) -> None:
    """`variant`: one of CUDA_VARIANTS (default: `cuda_variant()`); every variant computes the same step.
    `remainders` (bf16 parameters with fp32-master remainders) run in the v3 kernel whatever `variant` says."""
    kernel = cuda_variant(variant) if remainders is None else CUDA_VARIANTS.index("v3")
    if not params:
        return
    if not params[0].is_cuda:
        raise ValueError("the CUDA backend needs CUDA tensors")
    check_lists(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size, remainders)
    ext = load_extension()
    rem_table = None if remainders is None else build_remainder_table(remainders)
    ptr_table, chunk_table, _ = build_tables(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size)
    step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step)
    fm, fv = get_format(m_q[0].dtype), get_format(v_q[0].dtype)
    ext.coat_adamw_step(ptr_table, chunk_table, nonfinite, rem_table, lr * weight_decay, step_size, beta1, beta2, bc2_sqrt,
                        eps, fm.max, fv.max, math.log2(fm.dynamic_range), math.log2(fv.dynamic_range), K_MIN,
                        K_MAX, fm == E5M2, fv == E5M2, bool(expand), params[0].dtype == torch.bfloat16,
                        grads[0].dtype == torch.bfloat16, group_size, kernel)
