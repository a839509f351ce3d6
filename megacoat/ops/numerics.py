"""The FP8 numerics every kernel in megacoat.ops and its torch reference share: one definition of each constant
and rule, so that the optimizer's moments and the activation flow quantize alike.

Scales are dequantization multipliers, float32: value = stored * scale, scale = max(amax, AMAX_FLOOR) / F.max.

AMAX_FLOOR = 2^-126, float32's smallest normal, for moments and activations alike. An amax below it (a group or
tensor of float32 sub-normals, or all zeros) is raised to it before scaling, which keeps every quantity the kernels
form finite: 1 / amax <= 2^126, and x / scale = x * F.max / amax <= F.max for |x| <= amax (only 1 / scale itself
can overflow, for a scale from the floor: cast_with_scale rescales by a power of two there). The values of such a
group keep their place on the FP8 grid, scaled as if their amax were 2^-126; expansion is not applied to them
(k = 1): their range says nothing worth the pow. A lower floor would let 1 / amax overflow (2^-127 -> inf), a
higher one (e.g. 2^(ceil(log2 F.max) - 128), where F.max / amax stays finite) would only matter to code that
forms F.max / amax, which no kernel does.

Non-finite input: a group (or tensor) holding a NaN or an Inf gets a non-finite scale, so it dequantizes to NaN
-- visible, never silently repaired (the optimizer's moments also count such groups and store zero codes).

Divisions in the references are tensor / tensor (IEEE round-to-nearest on CPU and CUDA, `tl.div_rn` in the
kernels): `python_float / tensor` is `reciprocal(tensor) * float` in torch, and `tensor / python_float` on CUDA
multiplies by the reciprocal. The one exception, on purpose, is group_quantize's scale (see there).
"""
from __future__ import annotations

import math
import os
import threading

import torch
import torch.nn.functional as F
from torch._library.infer_schema import infer_schema
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GROUP_SIZES = (16, 32, 64, 128, 256)  # 1xG quantization groups: a power of two that a warp's lanes divide
AMAX_FLOOR = torch.finfo(torch.float32).tiny  # 2^-126: see the module docstring
# Expansion exponent bounds (CoatAdamW's moments): K_MAX stops expanding groups whose range is already tiny
# (amax / amin < R_F^(1/64)), where a larger k buys nothing and grows the float32 pow error; K_MIN = 1/16 covers
# any finite float32 range (amax / amin <= 2^277 < R_F^16), so k never has to go lower.
K_MIN = 1.0 / 16.0
K_MAX = 64.0
# The one interpreter switch: Triton kernels run under TRITON_INTERPRET=1 on the CPU (tests), where libdevice fast
# math and inline PTX do not exist; kernels take FAST as a constexpr so each path compiles alone.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FAST = not INTERPRET


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite magnitude: E4M3 448, E5M2 57344."""
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"not an FP8 dtype: {fp8_dtype}")
    return float(torch.finfo(fp8_dtype).max)


def log2_dynamic_range(fp8_dtype: torch.dtype) -> float:
    """log2(F.max / F.min_subnormal), the range expansion maps a group onto: E4M3 ~17.81, E5M2 ~31.81."""
    fi = torch.finfo(fp8_dtype)
    return math.log2(fp8_max(fp8_dtype) / (fi.smallest_normal * fi.eps))


_FP8_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def fp8_table(fp8_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """float32 [256]: the value of each FP8 code (NaN codes included), indexed by the code's byte."""
    key = (fp8_dtype, torch.device(device))
    if key not in _FP8_TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FP8_TABLES[key] = codes.view(fp8_dtype).float().to(device)
    return _FP8_TABLES[key]


def fp8_to_float32(q: torch.Tensor) -> torch.Tensor:
    """q.float(), exact (every FP8 value is a float32). Off CUDA through fp8_table: torch's CPU conversion decodes
    FP8 one element at a time, several times slower than the gather. Traced (fake) tensors take q.float(): the
    table is a real tensor."""
    if q.is_cuda or q.dtype not in FP8_DTYPES or is_fake(q):
        return q.float()
    codes = q.contiguous().view(torch.uint8).reshape(-1).int()
    return fp8_table(q.dtype, q.device).index_select(0, codes).view(q.shape)


def check_group_size(group_size: int) -> int:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"FP8 group size must be one of {GROUP_SIZES}, got {group_size!r}")
    return group_size


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def pick(x: torch.Tensor, kernel, reference):
    """The backend choice of every op: the kernel for CUDA tensors, the torch reference elsewhere. (CPU tests run
    the Triton kernels under the interpreter by calling them by name.)"""
    return kernel if x.is_cuda else reference


# --- registered operators -------------------------------------------------------------------------------------
# Every kernel of the FP8 flow is also a PyTorch operator, megacoat::<name> (fp8_operator), so that torch.compile
# traces a block with no graph break. The operator is opaque to Inductor: at run time it launches the Triton kernels
# itself (CUDA) or runs the torch reference (CPU), the choice `pick` makes; its fake (shapes and dtypes under
# tracing) is the same body with the launches made graph nodes (wrap_triton), which do nothing on fake tensors.
# (Why not torch.library.triton_op, which lets Inductor re-compile the kernels: docs/design.md, alternatives tried.)
# Eager calls skip the operator (its Python dispatch costs more than a small kernel): `dispatch` below.
_traced = threading.local()


def launcher(kernel):
    """How the Triton functions launch `kernel`: wrap_triton(kernel) while an operator's fake runs (so the launch
    is a graph node, a no-op on fake tensors), the kernel itself otherwise."""
    return wrap_triton(kernel) if getattr(_traced, "on", False) and not getattr(_traced, "direct", False) else kernel


def fp8_operator(name: str, mutates_args: tuple[str, ...] = ()):
    """Register `body` (a function of tensors and plain values, returning tensors) as the custom operator `name`:
    at run time `body` launches its kernels directly, under tracing it is its own fake. `mutates_args` names the
    arguments `body` writes in place (a state tensor such as an amax history), so the compiler orders them."""
    def register(body):
        def run(*args):
            prev = getattr(_traced, "direct", False)
            _traced.direct = True
            try:
                return body(*args)
            finally:
                _traced.direct = prev

        op = torch.library.custom_op(name, run, mutates_args=mutates_args,
                                     schema=infer_schema(body, mutates_args=mutates_args))
        op.register_fake(body)
        return op
    return register


def traced_body(x: torch.Tensor, kernel, reference, *args):
    """The body of a megacoat:: operator: pick's choice, with launches made traceable (see launcher)."""
    prev = getattr(_traced, "on", False)
    _traced.on = True
    try:
        return pick(x, kernel, reference)(*args)
    finally:
        _traced.on = prev


def dispatch(op, x: torch.Tensor, kernel, reference, *args):
    """Run one FP8 op: the registered operator `op` under torch.compile, else the kernel (CUDA) or reference."""
    if torch.compiler.is_compiling():
        return op(*args)
    return pick(x, kernel, reference)(*args)


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """max(amax, AMAX_FLOOR) / F.max in float32 (IEEE division, as the kernels' div_rn); NaN/Inf amax -> NaN/Inf."""
    fmax = torch.full_like(amax, fp8_max(fp8_dtype), dtype=torch.float32)
    return amax.float().clamp(min=AMAX_FLOOR) / fmax


RESCALE_BELOW = 2.0 ** -64  # cast_with_scale: a scale below this is multiplied by RESCALE first
RESCALE = 2.0 ** 64


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x * (1 / scale))), the reciprocal once (IEEE). A scale from the floor (2^-126 / F.max) has no
    finite reciprocal, so below 2^-64 both x and scale are first multiplied by 2^64 (exact: a power of two, and
    |x| <= amax < 2^-48 there): the same multiply-by-reciprocal, with 0 staying 0 instead of 0 * inf = NaN."""
    fmax = fp8_max(fp8_dtype)
    s = scale.float()
    c = torch.where(s < RESCALE_BELOW, torch.full_like(s, RESCALE), torch.ones_like(s))
    y = (x.float() * c) * torch.reciprocal(s * c)
    return y.clamp(-fmax, fmax).to(fp8_dtype)


def div_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x / scale)): the division the activation flow's kernels do (triton_math.div_saturate), where
    cast_with_scale multiplies by the reciprocal as cast_transpose does."""
    fmax = fp8_max(fp8_dtype)
    return (x / scale).clamp(-fmax, fmax).to(fp8_dtype)


def group_quantize(x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """1xG groups along the last dim of x [M, D] (a short last group padded with zeros, which change no amax):
    (q [M, D] in fp8_dtype, scales [M, ceil(D / G)] fp32), q = fp8(clamp(x / scale))."""
    m, d = x.shape
    ng = num_groups(d, group_size)
    xp = _pad_to(x.float(), ng * group_size).view(m, ng, group_size)
    # amax / F.max by a Python float: on CUDA torch multiplies by the float32 reciprocal, as the kernels' `/`
    # (div.full, a scaled reciprocal) does for these group scales; per-tensor scales use scale_from_amax (IEEE)
    scale = xp.abs().amax(-1).clamp(min=AMAX_FLOOR) / fp8_max(fp8_dtype)
    q = div_cast(xp, scale[..., None], fp8_dtype)
    return q.view(m, ng * group_size)[:, :d].contiguous(), scale


def group_dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of group_quantize, in fp32."""
    m, d = q.shape
    xp = _pad_to(fp8_to_float32(q), scale.shape[1] * group_size).view(m, -1, group_size)
    return (xp * scale[..., None]).view(m, -1)[:, :d]


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [M, D] with zero columns up to `width` (x itself when D == width: no copy)."""
    return x if x.shape[1] == width else F.pad(x, (0, width - x.shape[1]))
