"""Plain-torch 1xG group cast used by the references of the fused non-linear kernels (rmsnorm, swiglu).

Groups run along the last dimension; a row whose length is not a multiple of G ends in a short group
(padded with zeros for its amax, which zeros cannot change). Scales are dequantization scales,
amax / fmt_max, one fp32 per group: value = stored * scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TINY = torch.finfo(torch.float32).tiny  # floor of an amax, so an all-zero group divides by a finite scale


def group_quantize(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] → (q [M, D] in `dtype`, scales [M, ceil(D / G)] fp32)."""
    m, d = x.shape
    ng = -(-d // group_size)
    fmax = torch.finfo(dtype).max
    xp = F.pad(x.float(), (0, ng * group_size - d)).view(m, ng, group_size)
    scale = xp.abs().amax(-1).clamp(min=TINY) / fmax
    q = (xp / scale[..., None]).clamp(-fmax, fmax).to(dtype)
    return q.view(m, ng * group_size)[:, :d].contiguous(), scale


def group_dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of group_quantize, in fp32."""
    m, d = q.shape
    xp = F.pad(q.float(), (0, scale.shape[1] * group_size - d)).view(m, -1, group_size)
    return (xp * scale[..., None]).view(m, -1)[:, :d]
