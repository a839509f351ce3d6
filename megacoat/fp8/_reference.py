"""Shared plain-torch pieces of the references: grouping, NaN handling, IEEE divisions.

Bit-exactness with the Triton kernels on the GPU rests on computing the same float32 operations in the same
order. Two traps this file avoids: `python_float / tensor` is `reciprocal(tensor) * float` in torch, and
`tensor / python_float` on CUDA multiplies by the reciprocal; so every division here is tensor / tensor (IEEE
round-to-nearest on CPU and CUDA, `tl.div_rn` in the kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{what} expects a float32/bfloat16/float16 tensor, got {x.dtype}")


def div(a: torch.Tensor, b) -> torch.Tensor:
    """IEEE a / b with both operands tensors (see module docstring)."""
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    return a / b


def to_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 view (rows, groups, G) of x grouped along its last dim; the short tail group is zero-padded."""
    cols = 1 if x.dim() == 0 else x.shape[-1]
    x2 = x.reshape(x.numel() // cols if cols else 0, cols)
    rows = x2.shape[0]
    n_groups = -(-cols // group_size)
    xf = x2.float()
    pad = n_groups * group_size - cols
    if pad:
        xf = F.pad(xf, (0, pad))  # zeros change neither amax nor the non-zero amin
    return xf.view(rows, n_groups, group_size)


def from_groups(xg: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of to_groups: drop the padding and restore `shape`."""
    cols = 1 if len(shape) == 0 else shape[-1]
    return xg.reshape(xg.shape[0], xg.shape[1] * xg.shape[2])[:, :cols].reshape(shape)


def abs_nan_as_inf(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN mapped to +inf, so that max() flags NaN and Inf alike (max ignores NaN on some paths)."""
    return torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x.abs())
