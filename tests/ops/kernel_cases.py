"""Shared inputs for the FP8 kernel tests: on CPU the Triton interpreter runs the kernels.

TRITON_INTERPRET must be set before triton is imported (tests/conftest.py does it when there is no GPU);
it is set here too for running a file on its own outside pytest's conftest.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (shape, group_size): flat and row layouts, short tails, every group size.
SHAPES = [((4, 256), 128), ((3, 300), 128), ((1000,), 128), ((2, 3, 130), 64), ((7, 50), 16), ((5, 96), 32),
          ((2, 700), 256), ((1,), 128)]


def wide(shape, dtype=torch.float32, device=DEVICE, seed=0):
    """Signed values over several decades (reaches FP8's subnormals), plus zeros and a constant group."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(6) * 100
    flat = x.view(-1)
    flat[::97] = 0
    return x.to(dtype).to(device)


def with_edge_groups(x, group_size):
    """Row 0's first group all zero, a NaN and an Inf in later groups (needs >= 3 groups)."""
    x = x.clone().view(-1)
    x[:group_size] = 0
    x[group_size + 3] = float("nan")
    x[2 * group_size + 1] = float("-inf")
    return x


def same(a, b):
    """Bitwise equality of two tensors, NaNs included. Under the interpreter -0 and +0 count as equal: its
    fp16 -> fp32 upcast drops the sign of -0 (on the GPU the sign bit is compared too)."""
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        if INTERPRETED:
            a, b = torch.where(a == 0x80, 0, a), torch.where(b == 0x80, 0, b)
    return a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) and \
        torch.equal(a.isnan() if a.is_floating_point() else a, b.isnan() if b.is_floating_point() else b)


def same_output(a, b):
    """Like same(), but under the interpreter a float32 -> bf16/fp16 output cast may be off by one ulp: its
    downcast truncates instead of rounding to nearest even (triton/runtime/interpreter.py _convert_float)."""
    if INTERPRETED and a.dtype in (torch.bfloat16, torch.float16):
        ulp = torch.finfo(a.dtype).eps
        close = ((a.float() - b.float()).abs() <= ulp * b.float().abs()) | (a.float() == b.float())
        return a.shape == b.shape and bool((close | (a.isnan() & b.isnan())).all())
    return same(a, b)
