"""Triton: a per-tensor scale reduced inside the kernel that computes the amax, with no launch after it.

Each program folds its amax into one float by atomic max; the last program to finish (an atomic counter says
which) turns the total into the dequantization scale max(amax, AMAX_FLOOR) / fmt_max (megacoat.ops.numerics),
the same IEEE division as the torch references. No partial-amax array and no torch reductions over it (amax,
clamp, divide: three launches of a few microseconds each, beside kernels of a few tens) are needed. Both
counters start at zero: one memset (`scale_workspace`). Atomics are acq_rel at GPU scope (Triton's default), so
the last program's counter increment sees every other program's atomic max.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def scale_workspace(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax [1] fp32, finished-programs counter [1] int32), both zero, from one allocation and one memset."""
    ws = torch.zeros((2,), dtype=torch.int32, device=device)
    return ws[:1].view(torch.float32), ws[1:]


@triton.jit
def fold_amax_to_scale(amax, amax_ptr, count_ptr, scale_ptr, fmax, amax_floor):
    """Fold this program's amax (>= 0) into the tensor's; the last program writes the scale."""
    tl.atomic_max(amax_ptr, amax)
    if tl.atomic_add(count_ptr, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
        total = tl.atomic_max(amax_ptr, 0.0)  # an atomic read: the final value
        tl.store(scale_ptr, tl.math.div_rn(tl.maximum(total, amax_floor), fmax))


# Delayed scaling (megacoat.fp8.grad_scaling): the scale comes from an amax history [L] (float32, entries >= 0,
# most recent first) and the call records its own amax in the same kernel, so a delayed call is one launch and
# one memset, with no torch ops around it for the history's maximum and its roll.
@triton.jit
def history_max(hist_ptr, hist_len, HIST: tl.constexpr):
    """The largest amax in the history (HIST: a power of two >= hist_len)."""
    i = tl.arange(0, HIST)
    return tl.max(tl.load(hist_ptr + i, mask=i < hist_len, other=0.0), axis=0)


@triton.jit
def fold_amax_into_history(amax, amax_ptr, count_ptr, hist_ptr, hist_len, HIST: tl.constexpr):
    """Fold this program's amax (>= 0) into the tensor's; the last program rolls the history, the total in front,
    zero where it is not finite (that step is refused, and later calls should not inherit it). Every program
    reads the history before its counter increment, so the last one rewrites it after all the reads."""
    tl.atomic_max(amax_ptr, amax)
    if tl.atomic_add(count_ptr, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
        total = tl.atomic_max(amax_ptr, 0.0)  # an atomic read: the final value
        total = tl.where((total == total) & (total < float("inf")), total, 0.0)
        i = tl.arange(0, HIST)
        older = tl.load(hist_ptr + tl.maximum(i - 1, 0), mask=(i >= 1) & (i < hist_len), other=0.0)
        tl.store(hist_ptr + i, tl.where(i == 0, total, older), mask=i < hist_len)
