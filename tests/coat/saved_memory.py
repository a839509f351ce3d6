"""Bytes autograd keeps for backward, measured with saved_tensors_hooks over unique storages.

Parameters (and views of them) are not activations and are left out; a storage saved by several ops (a
tensor and its view, an input saved by two consumers) counts once.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


def saved_activation_bytes(fn: Callable[[], torch.Tensor], params: Iterable[torch.Tensor] = ()) -> tuple[int, dict]:
    """Run fn() under the hooks → (total bytes, {dtype name: bytes}). fn's output keeps the graph alive."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and ptr != 0:
            seen[ptr] = (st.nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    by_dtype: dict[str, int] = {}
    for nbytes, dtype in seen.values():
        by_dtype[str(dtype).replace("torch.", "")] = by_dtype.get(str(dtype).replace("torch.", ""), 0) + nbytes
    del out
    return sum(n for n, _ in seen.values()), by_dtype
