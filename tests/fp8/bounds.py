"""Error bounds the FP8 tests check, derived from the formats (not fitted to results).

Rounding to nearest in FP8 has relative error <= u = F.eps / 2 for values in the normal range (E4M3 2^-4,
E5M2 2^-3) and absolute error <= F.min_subnormal / 2 below it. The float32 arithmetic around it (scale
factors, log2/exp2 of the expansion path) adds a few float32 ulps; FP32_SLACK covers that.
"""
import torch

from megacoat.fp8 import get_format

FP32_SLACK = 8 * 2.0 ** -24


def check_group_roundtrip(x: torch.Tensor, xhat: torch.Tensor, scale_per_elem: torch.Tensor, fmt) -> None:
    """Per-group/per-tensor quantization: relative bound in FP8's normal range, absolute one below it."""
    fmt = get_format(fmt)
    x, xhat, s = x.double(), xhat.double(), scale_per_elem.double()
    err = (xhat - x).abs()
    q_mag = x.abs() / s  # the value FP8 rounded (before rounding)
    normal = q_mag >= fmt.smallest_normal
    assert (err[normal] <= x.abs()[normal] * (fmt.unit_roundoff + FP32_SLACK)).all(), \
        f"normal-range error above u={fmt.unit_roundoff}: max rel {(err[normal] / x.abs()[normal]).max():.3g}"
    sub = ~normal & (s > 0)
    assert (err[sub] <= s[sub] * fmt.min_subnormal / 2 * (1 + FP32_SLACK) + 1e-45).all(), "subnormal-range error"


def per_elem(scale: torch.Tensor, shape: torch.Size, group_size: int) -> torch.Tensor:
    """Broadcast a (*lead, n_groups) scale back to the tensor's shape."""
    return scale.repeat_interleave(group_size, dim=-1)[..., :shape[-1]]
