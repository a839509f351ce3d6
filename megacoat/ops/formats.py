"""FP8 formats: E4M3 and E5M2 with their limits read from torch.finfo, never typed in by hand."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype

    @property
    def max(self) -> float:
        """Largest finite magnitude (E4M3: 448, E5M2: 57344)."""
        return float(torch.finfo(self.dtype).max)

    @property
    def smallest_normal(self) -> float:
        return float(torch.finfo(self.dtype).smallest_normal)

    @property
    def eps(self) -> float:
        """Spacing just above 1.0 (2^-mantissa_bits): E4M3 0.125, E5M2 0.25."""
        return float(torch.finfo(self.dtype).eps)

    @property
    def mantissa_bits(self) -> int:
        return round(-math.log2(self.eps))

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (E4M3: 2^-9, E5M2: 2^-16): smallest normal times eps."""
        return self.smallest_normal * self.eps

    @property
    def dynamic_range(self) -> float:
        """max / min_subnormal: the ratio dynamic range expansion maps each group onto (E4M3: 448 / 2^-9)."""
        return self.max / self.min_subnormal

    @property
    def unit_roundoff(self) -> float:
        """Worst relative error of round-to-nearest for normal values: eps / 2."""
        return self.eps / 2


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def get_format(fmt: str | Fp8Format | torch.dtype) -> Fp8Format:
    """Accepts 'e4m3'/'e5m2', a torch FP8 dtype, or a Fp8Format."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise ValueError(f"not an FP8 dtype megacoat supports: {fmt}")
    try:
        return FORMATS[fmt.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FORMATS)}") from None

# FP8 GEMMs (torch._scaled_mm / cuBLASLt) need their matrix sizes to be multiples of this (16-byte alignment).
FP8_GEMM_MULTIPLE = 16
