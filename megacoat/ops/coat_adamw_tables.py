"""Argument checks and launch tables of the CoatAdamW step (the reference checks its arguments alike).

One launch covers a whole list of tensors: a pointer table (int64 [T, 9]: the eight tensors' addresses and the
element count) and a chunk table (int32 [chunks, 2]: tensor index, chunk index within it). Both are cached so a
steady training loop uploads nothing: the chunk table depends only on the sizes, the pointer table on the addresses.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from megacoat.ops.numerics import FP8_DTYPES, check_group_size, num_groups

PARAM_DTYPES = (torch.float32, torch.bfloat16)
GRAD_DTYPES = (torch.float32, torch.bfloat16)
_CACHE_ENTRIES = 8
_ptr_cache: OrderedDict = OrderedDict()
_chunk_cache: OrderedDict = OrderedDict()


def chunk_elems(group_size: int) -> int:
    """Elements per chunk: one CUDA block of 256 threads x 2 slices x 8 elements (kernels/coat_adamw.h)."""
    return 4096


def check_lists(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size: int) -> None:
    """Clear errors for anything the kernels cannot take, instead of a wrong result."""
    check_group_size(group_size)
    lists = dict(params=params, grads=grads, m_q=m_q, m_scale=m_scale, m_k=m_k, v_q=v_q, v_scale=v_scale, v_k=v_k)
    if len({len(x) for x in lists.values()}) != 1:
        raise ValueError(f"tensor lists differ in length: { {k: len(x) for k, x in lists.items()} }")
    device = params[0].device
    expected = dict(params=PARAM_DTYPES, grads=GRAD_DTYPES, m_q=FP8_DTYPES, v_q=FP8_DTYPES,
                    m_scale=(torch.float32,), v_scale=(torch.float32,), m_k=(torch.bfloat16,), v_k=(torch.bfloat16,))
    for name, tensors in lists.items():
        dt = tensors[0].dtype
        if dt not in expected[name]:
            raise TypeError(f"{name}: dtype {dt} not supported (expected one of {expected[name]})")
        for t in tensors:
            if t.dtype != dt:
                raise TypeError(f"{name}: mixed dtypes {dt} and {t.dtype} in one launch")
            if t.device != device:
                raise ValueError(f"{name}: tensor on {t.device}, expected {device}")
            if not t.is_contiguous():
                raise ValueError(f"{name}: tensors must be contiguous")
    for i, p in enumerate(params):
        n, ng = p.numel(), num_groups(p.numel(), group_size)
        if grads[i].numel() != n or m_q[i].numel() != n or v_q[i].numel() != n:
            raise ValueError(f"tensor {i}: param, grad and moments must have {n} elements")
        for name in ("m_scale", "m_k", "v_scale", "v_k"):
            if lists[name][i].numel() != ng:
                raise ValueError(f"tensor {i}: {name} must have {ng} entries (ceil({n}/{group_size}))")


def _remember(cache: OrderedDict, key, value):
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _CACHE_ENTRIES:
        cache.popitem(last=False)
    return value


def build_tables(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size: int):
    """(pointer table, chunk table, groups per chunk) for one launch over the lists."""
    device = params[0].device
    numels = tuple(p.numel() for p in params)
    ce = chunk_elems(group_size)
    ckey = (device, group_size, numels)
    chunks = _chunk_cache.get(ckey)
    if chunks is None:
        rows = [(i, c) for i, n in enumerate(numels) for c in range(-(-n // ce))]
        chunks = _remember(_chunk_cache, ckey, torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 2))
    ptrs = tuple((p.data_ptr(), grads[i].data_ptr(), m_q[i].data_ptr(), m_scale[i].data_ptr(), m_k[i].data_ptr(),
                  v_q[i].data_ptr(), v_scale[i].data_ptr(), v_k[i].data_ptr(), p.numel())
                 for i, p in enumerate(params))
    pkey = (device, ptrs)
    table = _ptr_cache.get(pkey)
    if table is None:
        table = _remember(_ptr_cache, pkey, torch.tensor(ptrs, dtype=torch.int64, device=device).view(-1, 9))
    return table, chunks, ce // group_size
