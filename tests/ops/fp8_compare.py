"""Comparing FP8 kernel outputs with their torch references, shared by the ops tests of the precision flow.

On CUDA the Triton casts round to nearest even like torch's: almost every byte matches and the rest differ
by one code (a division rounded differently). Under the CPU interpreter (TRITON_INTERPRET=1) the FP8 casts
are not torch's: values just under a power of two come out one binade low, so there we bound the share of
mismatched elements and the norm-wise error instead.
"""
import os

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (decorated)


def interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def assert_fp8_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    af, bf = a.float(), b.float()
    assert torch.isfinite(af).all()
    mismatch = (af != bf).float().mean().item()
    if a.is_cuda:
        codes = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
        assert mismatch <= 1e-3 and codes.max().item() <= 1, (mismatch, codes.max().item())
    else:
        rel = ((af - bf).norm() / bf.norm().clamp(min=1e-30)).item()
        assert mismatch <= 0.06 and rel <= 0.15, (mismatch, rel)


def assert_close_f32(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


def assert_delayed_scale_and_saturation(run, cast_with, amax: float, dtype: torch.dtype) -> None:
    """A delayed-scaling reference against a history with headroom and one that its own amax overflows: the scale
    is the history's maximum, the output is the plain cast with that scale, values saturate exactly when the
    history's maximum is below this call's amax, and the history rolls. run(history) -> (scale, out);
    cast_with(scale) -> the output the current-scaling path writes with that scale."""
    from megacoat.ops.numerics import scale_from_amax

    fmax = torch.finfo(dtype).max
    for hist in ([amax * 4, 0.5 * amax], [0.25 * amax, 0.125 * amax]):
        history = torch.tensor(hist, device=DEV)
        scale, out = run(history)
        want = scale_from_amax(torch.tensor([max(hist)], device=DEV), dtype)
        assert same_bytes(scale, want) and same_bytes(out, cast_with(want))
        saturated = (out.float().abs() == fmax).float().mean().item()
        assert (saturated > 0) == (max(hist) < amax)
        assert history[1] == torch.tensor(hist[0], device=DEV)  # rolled (hist as float32)


def assert_delayed_meets_current(delayed, current, scale_at: int, dtype: torch.dtype, history_len: int = 3):
    """delayed(history, bootstrap=False) and current() on one input, the scale at index `scale_at` of their outputs.
    1st delayed call (bootstrap, nothing recorded): current scaling's bytes, its own amax recorded in front (the
    one current scaling's scale comes from). 2nd call, the same input: the history holds this call's own amax, so
    the one launch writes current scaling's bytes exactly, and records the same amax. → (history, current's outputs)."""
    from megacoat.ops.numerics import scale_from_amax

    want = current()
    history = torch.zeros(history_len, device=DEV)
    assert all(same_bytes(a, b) for a, b in zip(delayed(history, True), want))
    assert same_bytes(want[scale_at], scale_from_amax(history[:1], dtype)) and history[1:].eq(0).all()
    assert all(same_bytes(a, b) for a, b in zip(delayed(history), want))
    assert history[0].item() == history[1].item() > 0 and history[2:].eq(0).all()
    return history, want
