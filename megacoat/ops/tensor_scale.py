"""Triton: a per-tensor scale from an amax reduced inside the kernel that computes it, with no reduction launch;
and the amax history of delayed scaling (below).

Each program folds its amax into one zeroed float by a relaxed atomic max (`record_program_amax`: a `red`
instruction that no program waits on), and the kernel that consumes the total turns it into the dequantization
scale max(amax, AMAX_FLOOR) / fmt_max (`scale_from_total`, the same IEEE division as the torch references). No
partial-amax array and no torch reductions over it (amax, clamp, divide: three launches of a few microseconds
each, beside kernels of a few tens) are needed, and no program waits on another's answer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.numerics import RESCALE, RESCALE_BELOW, launcher, scale_from_amax

RESCALE, RESCALE_BELOW = tl.constexpr(RESCALE), tl.constexpr(RESCALE_BELOW)


def amax_workspace(device) -> torch.Tensor:
    """[1] float32 zero: where a kernel's programs fold their amaxes (|x| >= 0, so zero is the neutral start)."""
    return torch.zeros((1,), dtype=torch.float32, device=device)


@triton.jit
def record_program_amax(amax, amax_ptr):
    """Fold this program's amax (>= 0) into the call's (for roll_history, or for the next kernel, which reads the
    total): a relaxed atomic max, which compiles to a reduction (`red`) that no program waits on."""
    tl.atomic_max(amax_ptr, amax, sem="relaxed")


@triton.jit
def scale_from_total(amax, fmax, amax_floor):
    """The dequantization scale of a per-tensor amax: IEEE max(amax, floor) / fmax (numerics.scale_from_amax)."""
    return tl.math.div_rn(tl.maximum(amax, amax_floor), fmax)


@triton.jit
def scaled_codes(x, scale, fmax):
    """x (float32) in units of a per-tensor dequantization scale, clamped to the format's range, for the store's
    cast to FP8: numerics.cast_with_scale's float32 arithmetic (one IEEE reciprocal; a scale from the amax floor
    rescaled by a power of two first, so that 0 stays 0)."""
    c = tl.where(scale < RESCALE_BELOW, RESCALE, 1.0)
    inv = tl.div_rn(1.0, scale * c)
    return tl.clamp((x * c) * inv, -fmax, fmax)


@triton.jit
def _publish_scale(scale_ptr, scale):
    """Every program derives the same scale; the first one (of a 1-D or 2-D grid) stores it for the GEMM that
    reads the cast."""
    tl.store(scale_ptr, scale, mask=(tl.program_id(0) == 0) & (tl.program_id(1) == 0))
    return scale


@triton.jit
def cast_scale(scale_ptr, amax_ptr, fmax, amax_floor, FROM_AMAX: tl.constexpr):
    """The per-tensor scale a cast launch uses: read from scale_ptr, or (FROM_AMAX) derived by every program from
    the total amax an earlier launch folded (read as float32), and stored at scale_ptr by the first program."""
    if FROM_AMAX:
        scale = _publish_scale(scale_ptr, scale_from_total(tl.load(amax_ptr).to(tl.float32), fmax, amax_floor))
    else:
        scale = tl.load(scale_ptr)
    return scale


# Delayed scaling (megacoat.coat.delayed_scaling): the scale comes from an amax history [L] (float32, entries >= 0,
# most recent first), whose maximum each program reads itself; the call's own amax goes into a zeroed float by a
# relaxed atomic max (record_program_amax), and one single-program launch rolls it into the history after the kernel
# (not the kernel's last program: see the module docstring).
@triton.jit
def history_max(hist_ptr, hist_len, HIST: tl.constexpr):
    """The largest amax in the history (HIST: a power of two >= hist_len)."""
    i = tl.arange(0, HIST)
    return tl.max(tl.load(hist_ptr + i, mask=i < hist_len, other=0.0), axis=0)


@triton.jit
def history_scale(scale_ptr, hist_ptr, hist_len, fmax, amax_floor, HIST: tl.constexpr):
    """Delayed scaling's per-tensor scale, from the history's largest amax; stored at scale_ptr by the first
    program, as cast_scale does."""
    return _publish_scale(scale_ptr, scale_from_total(history_max(hist_ptr, hist_len, HIST), fmax, amax_floor))


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


def delayed_scale(amax: torch.Tensor, history: torch.Tensor, fp8_dtype: torch.dtype, bootstrap: bool) -> torch.Tensor:
    """The references' delayed-scaling scale, float32 [1]: from max(history), the amaxes of earlier calls, or
    (bootstrap, nothing recorded yet) from this call's own amax."""
    return scale_from_amax((amax if bootstrap else history.amax()).reshape(1), fp8_dtype).reshape(1)
