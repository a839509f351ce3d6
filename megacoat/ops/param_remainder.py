"""An fp32 master weight stored as a bf16 parameter plus a 16-bit remainder (TransformerEngine's FusedAdam
`store_param_remainders`): 2 extra bytes per parameter instead of a 4-byte fp32 copy, and exact.

Split (fp32 bits x = hi:lo, 16 bits each): the bf16 is x rounded to nearest with ties away from zero (hi + 1 when
lo >= 0x8000, i.e. when lo read as int16 is negative; bf16 is sign-magnitude, so +1 on the bits grows the
magnitude), the remainder is lo as int16. Join: hi = bf16 bits - 1 where the remainder is negative, then hi:lo.
Every fp32 value round-trips bit for bit: each bf16 value has exactly 2^16 fp32 pre-images, one per remainder.

Why not ties-to-even (what a plain `.to(torch.bfloat16)` does): under it an even bf16 value has 2^16 + 1 fp32
pre-images, one more than 16 bits can name, so no 16-bit remainder is exact. The two roundings differ only when
lo == 0x8000 exactly (one fp32 value in 2^16) and then by one bf16 ulp.

A NaN whose high half is 0x7fff / 0xffff is not rounded up (that would carry into the sign bit and turn NaN into
-0.0 / +0.0); so a NaN master comes back NaN (its payload may change) and its bf16 half is NaN or, when the NaN's
payload sits only in the low half, +-inf: never a finite weight. Infinities and values that round past bf16's
largest finite number become +-inf and come back exactly.
"""
from __future__ import annotations

import torch


def _as_int16(x: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 2^16) (int32/int64) -> the int16 with the same 16 bits."""
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)


def split_fp32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tensor -> (bf16 rounded to nearest, ties away from zero; int16 remainder), same shape."""
    if x.dtype != torch.float32:
        raise TypeError(f"split_fp32 takes float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi, lo = bits >> 16, bits & 0xFFFF
    up = (lo >= 0x8000) & ((hi & 0x7FFF) != 0x7FFF)
    hi = hi + up.to(torch.int64)
    return _as_int16(hi).view(torch.bfloat16), _as_int16(lo)


def join_fp32(p: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16, int16 remainder) -> the fp32 they encode, bit for bit what `split_fp32` was given; p's shape (the
    remainder may be flat, as CoatAdamW keeps it)."""
    if p.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(f"join_fp32 takes bfloat16 and int16, got {p.dtype} and {remainder.dtype}")
    if p.numel() != remainder.numel():
        raise ValueError(f"join_fp32: {p.numel()} parameters but {remainder.numel()} remainders")
    hi = p.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    rem = remainder.reshape(p.shape).to(torch.int64)
    hi = (hi - (rem < 0).to(torch.int64)) & 0xFFFF
    bits = (hi << 16) | (rem & 0xFFFF)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.view(torch.float32)
