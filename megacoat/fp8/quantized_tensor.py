"""QuantizedTensor: FP8 data + float32 scales (+ bf16 expansion exponents), per tensor or per 1xG group.

A plain dataclass, not a tensor subclass: the callers (the FP8 optimizer and the activation precision flow) know
where they hold quantized values, and a dataclass keeps autograd, checkpointing and torch.compile simple.

Layout. Groups run along the flattened last dimension: a tensor of shape (*lead, C) has ceil(C / G) groups per
row, the last one shorter when G does not divide C (a 1-D buffer of any length is one row). `scale` (and `k`)
then have shape (*lead, ceil(C / G)). Per-tensor quantization has `group_size=None` and a 0-d `scale`.
Dequantization is x ~= data * scale (or, with expansion, the inverse power map of expansion.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from megacoat.fp8.formats import Fp8Format, get_format

GROUP_SIZES = (16, 32, 64, 128, 256)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_group_size(group_size: int) -> int:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"FP8 group size must be one of {GROUP_SIZES}, got {group_size!r}")
    return group_size


def group_scale_shape(shape: torch.Size, group_size: int) -> torch.Size:
    """Shape of the per-group scale tensor for a tensor of `shape`: last dim -> ceil(last / G)."""
    if len(shape) == 0:
        return torch.Size([1])
    return torch.Size([*shape[:-1], -(-shape[-1] // group_size)])


@dataclass
class QuantizedTensor:
    data: torch.Tensor  # FP8 (e4m3fn or e5m2), same shape as the original tensor
    scale: torch.Tensor  # float32 dequantization multipliers: 0-d (per tensor) or group_scale_shape(...)
    group_size: Optional[int]  # None: one scale for the whole tensor
    orig_dtype: torch.dtype  # dtype dequantize() returns by default
    k: Optional[torch.Tensor] = None  # bf16 expansion exponent per group; None: no dynamic range expansion

    def __post_init__(self):
        if self.data.dtype not in _FP8_DTYPES:
            raise TypeError(f"QuantizedTensor.data must be an FP8 tensor, got {self.data.dtype}")
        if self.scale.dtype != torch.float32:
            raise TypeError(f"QuantizedTensor.scale must be float32, got {self.scale.dtype}")
        if self.group_size is None:
            if self.scale.numel() != 1:
                raise ValueError(f"per-tensor QuantizedTensor needs one scale, got shape {tuple(self.scale.shape)}")
            if self.k is not None:
                raise ValueError("dynamic range expansion is per group: k needs a group_size")
        else:
            check_group_size(self.group_size)
            want = group_scale_shape(self.data.shape, self.group_size)
            if self.scale.shape != want:
                raise ValueError(f"scale shape {tuple(self.scale.shape)} does not match data shape "
                                 f"{tuple(self.data.shape)} with group size {self.group_size} (want {tuple(want)})")
        if self.k is not None:
            if self.k.dtype != torch.bfloat16 or self.k.shape != self.scale.shape:
                raise ValueError(f"k must be bfloat16 with the scale's shape {tuple(self.scale.shape)}, "
                                 f"got {self.k.dtype} {tuple(self.k.shape)}")

    # --- what the tensor represents ---
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the represented (dequantized) tensor, not the FP8 storage dtype."""
        return self.orig_dtype

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def fmt(self) -> Fp8Format:
        return get_format(self.data.dtype)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def expanded(self) -> bool:
        return self.k is not None

    def numel(self) -> int:
        return self.data.numel()

    def dim(self) -> int:
        return self.data.dim()

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: FP8 data + float32 scales (+ bf16 exponents)."""
        n = self.data.nbytes + self.scale.nbytes
        return n + (self.k.nbytes if self.k is not None else 0)

    def nonfinite_groups(self) -> torch.Tensor:
        """Number of groups (or 1 for the whole tensor) whose input held NaN/Inf; they dequantize to NaN.

        Returned as a 0-d device tensor so that asking never forces a host sync; call .item() to read it.
        """
        return torch.isnan(self.scale).sum()

    def dequantize(self, dtype: Optional[torch.dtype] = None, backend: str = "auto") -> torch.Tensor:
        from megacoat.fp8.quantize import dequantize  # late import: quantize.py builds QuantizedTensors

        return dequantize(self, dtype=dtype, backend=backend)

    # --- autograd: ctx.save_for_backward(*qt.tensors()); ctx.qmeta = qt.meta() ---
    def tensors(self) -> tuple:
        return (self.data, self.scale, self.k)

    def meta(self) -> tuple:
        return (self.group_size, self.orig_dtype)

    @classmethod
    def from_tensors(cls, tensors, meta) -> "QuantizedTensor":
        data, scale, k = tensors
        group_size, orig_dtype = meta
        return cls(data=data, scale=scale, group_size=group_size, orig_dtype=orig_dtype, k=k)

    # --- checkpointing: plain tensors and python scalars only, so torch.save / DeepSpeed handle it ---
    def to_dict(self) -> dict:
        d = {"data": self.data, "scale": self.scale, "group_size": self.group_size,
             "orig_dtype": str(self.orig_dtype).removeprefix("torch.")}
        if self.k is not None:
            d["k"] = self.k
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantizedTensor":
        orig_dtype = getattr(torch, d["orig_dtype"], None)
        if not isinstance(orig_dtype, torch.dtype):
            raise ValueError(f"QuantizedTensor state has an unknown orig_dtype {d['orig_dtype']!r}")
        return cls(data=d["data"], scale=d["scale"], group_size=d["group_size"], orig_dtype=orig_dtype,
                   k=d.get("k"))

    def to(self, device) -> "QuantizedTensor":
        return replace(self, data=self.data.to(device), scale=self.scale.to(device),
                       k=None if self.k is None else self.k.to(device))

    def __repr__(self) -> str:
        layout = "per-tensor" if self.group_size is None else f"G={self.group_size}"
        exp = ", expanded" if self.k is not None else ""
        return (f"QuantizedTensor(shape={tuple(self.shape)}, {self.fmt.name}, {layout}{exp}, "
                f"orig_dtype={self.orig_dtype}, device={self.device})")
