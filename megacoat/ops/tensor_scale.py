"""Triton: a per-tensor amax folded in by the kernel that reads the tensor, and the scale made from it after that
kernel; and the amax history of delayed scaling (below).

Each program folds its amax into one zeroed float by a relaxed atomic max that nothing waits on (no partial-amax
array, no torch reductions over it); one single-program launch after the kernel turns the total into the
dequantization scale max(amax, AMAX_FLOOR) / fmt_max (megacoat.ops.numerics), the same IEEE division as the torch
references. Finding the total inside the kernel instead (the last program to finish, told by an acq_rel counter,
writes the scale) makes every program wait for its counter increment's answer: on the H100 that made SwiGLU's
one-pass backward 30% slower (272 against 208 us a call at the 1.3 B shape, benchmarks/results/bench_e2e_notes.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.numerics import AMAX_FLOOR, launcher


def amax_workspace(device) -> torch.Tensor:
    """The call's amax: [1] float32, zero (amaxes are >= 0: the neutral start)."""
    return torch.zeros((1,), dtype=torch.float32, device=device)


@triton.jit
def record_program_amax(amax, amax_ptr):
    """Fold this program's amax (>= 0) into the call's; nothing waits on it (the kernel after this one reads it)."""
    tl.atomic_max(amax_ptr, amax, sem="relaxed")


@triton.jit
def _scale_kernel(amax_ptr, scale_ptr, fmax, amax_floor):
    tl.store(scale_ptr, tl.math.div_rn(tl.maximum(tl.load(amax_ptr), amax_floor), fmax))


def amax_to_scale(amax: torch.Tensor, scale: torch.Tensor, fmax: float) -> None:
    """scale[0] = max(amax, AMAX_FLOOR) / fmax on the device, one single-program launch after the kernel that
    folded the amax in."""
    launcher(_scale_kernel)[(1,)](amax, scale, fmax, AMAX_FLOOR, num_warps=1)


# Delayed scaling (megacoat.fp8.delayed_scaling): the scale comes from an amax history [L] (float32, entries >= 0,
# most recent first), whose maximum each program reads itself; the call's own amax goes in by record_program_amax,
# and one single-program launch rolls it into the history after the kernel.
@triton.jit
def history_max(hist_ptr, hist_len, HIST: tl.constexpr):
    """The largest amax in the history (HIST: a power of two >= hist_len)."""
    i = tl.arange(0, HIST)
    return tl.max(tl.load(hist_ptr + i, mask=i < hist_len, other=0.0), axis=0)


@triton.jit
def _roll_kernel(hist_ptr, amax_ptr, hist_len, HIST: tl.constexpr):
    total = tl.load(amax_ptr)
    total = tl.where((total == total) & (total < float("inf")), total, 0.0)
    i = tl.arange(0, HIST)
    older = tl.load(hist_ptr + tl.maximum(i - 1, 0), mask=(i >= 1) & (i < hist_len), other=0.0)
    tl.debug_barrier()  # every entry read before any is written
    tl.store(hist_ptr + i, tl.where(i == 0, total, older), mask=i < hist_len)


def roll_history(history: torch.Tensor, amax: torch.Tensor) -> None:
    """record_amax on the device in one launch: `history` rolled in place with `amax` ([1] float32, the call's
    total) in front, zero where it is not finite (that step is refused, and later calls should not inherit it)."""
    n = history.numel()
    launcher(_roll_kernel)[(1,)](history, amax, n, HIST=triton.next_power_of_2(n), num_warps=1)


def record_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """roll_history in torch (the references): `history` rolled in place with `amax` in front, zero where it is not
    finite."""
    amax = amax.reshape(1)
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    history.copy_(torch.cat((amax.to(history.dtype), history[:-1])))
