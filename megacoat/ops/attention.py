"""Causal grouped-query attention over torch's scaled_dot_product_attention (flash / memory-efficient kernels
on the GPU, the math kernel on CPU).

Both the plain model (megacoat.model) and the COAT block (megacoat.coat.flow) run their attention core
through this one function, so the two compute the same thing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [b, s, heads, d], k/v [b, s, kv_heads, d] -> [b, s, heads * d]: causal SDPA, each key/value head
    serving heads / kv_heads query heads."""
    b, s = q.shape[:2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)
