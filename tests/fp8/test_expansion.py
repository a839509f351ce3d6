"""Dynamic range expansion (reference): the k contract, invertibility bounds, edge cases, tails.

Bound (from the module docstring): an element whose f = F.max (|x|/amax)^k rounds to a normal FP8 value comes
back with relative error <= (1 + u)^(1/k) - 1 (~ u/k) plus float32 log2/exp2 error, which grows with
|log2(|x|/amax)| (an absolute error in the exponent becomes a relative one): we allow
8 * 2^-24 * (1 + |log2(|x|/amax)|) for it. In FP8's subnormal range, |q| - f is at most F.min_subnormal / 2.
"""
import math

import pytest
import torch

from megacoat.fp8 import E4M3, E5M2, K_MAX, K_MIN, expand_quantize, expansion_exponent, quantize_per_group
from megacoat.fp8.expansion import log2_range


def _groups(x, g):
    n = x.shape[-1]
    pad = -n % g
    return torch.nn.functional.pad(x.reshape(-1, n).double(), (0, pad)).reshape(x.reshape(-1, n).shape[0], -1, g)


def check_expansion_roundtrip(x, qt, fmt):
    g = qt.group_size
    xg, qg = _groups(x, g), _groups(qt.data.float(), g)
    xh = _groups(qt.dequantize(torch.float32), g)
    k = qt.k.double().reshape(xg.shape[0], -1, 1)
    amax = xg.abs().amax(-1, keepdim=True)
    r = (xg.abs() / amax).nan_to_num(0)
    f = fmt.max * r.pow(k)  # the exact value FP8 rounds
    normal = qg.abs() >= fmt.smallest_normal
    pow_err = 8 * 2.0 ** -24 * (1 + r.clamp_min(1e-300).log2().abs())
    bound = (1 + fmt.unit_roundoff) ** (1 / k) - 1 + pow_err
    rel = (xh - xg).abs() / xg.abs()
    assert (rel[normal] <= bound.expand_as(rel)[normal]).all(), f"max rel {rel[normal].max():.3g}"
    sub = ~normal & (xg != 0)
    assert ((qg.abs() - f).abs()[sub] <= fmt.min_subnormal / 2 * (1 + 1e-5)).all()
    assert (xh[xg == 0] == 0).all()


def test_exponent_formula_and_bf16_rounding():
    # amax/amin = 16: k = log2(229376) / 4 for E4M3, log2(57344 * 2^16) / 4 for E5M2, stored in bf16.
    for fmt in (E4M3, E5M2):
        k = expansion_exponent(torch.tensor([16.0]), torch.tensor([1.0]), fmt)
        assert k.dtype == torch.bfloat16
        expected = math.log2(fmt.max / fmt.min_subnormal) / 4
        assert k.item() == torch.tensor(expected).to(torch.bfloat16).item()
        assert log2_range(fmt) == pytest.approx(math.log2(fmt.dynamic_range))


def test_exponent_edge_cases():
    inf = float("inf")
    amax = torch.tensor([0.0, 2.0, 1.0, inf, 3.4e38, 2.0])
    amin = torch.tensor([inf, 2.0, 1.0 - 2 ** -20, 1.0, 1.4e-45, 0.5])
    k = expansion_exponent(amax, amin, E4M3).float()
    assert k[0] == 1 and k[1] == 1 and k[3] == 1  # all zero, one magnitude, non-finite
    assert k[2] == K_MAX  # tiny range: clamped at the top
    assert k[4] == K_MIN  # amax/amin overflows float32: k -> 0, clamped at the bottom
    assert 1 < k[5] < K_MAX
    # The widest range a finite float32 ratio can have still needs no clamp: K_MIN is only a guard.
    k = expansion_exponent(torch.tensor([2.0 ** 127]), torch.tensor([2.0 ** -149]), E4M3).float()
    assert K_MIN <= k.item() < 0.07


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("kind", ["signed", "nonneg", "narrow"])
def test_roundtrip_bound(fmt, kind):
    n = 8 * 256 + 77  # flat buffer with a short tail group
    if kind == "signed":  # Adam first-moment-like: signed, a few decades
        x = torch.randn(n) * torch.rand(n).pow(3) * 1e-3
    elif kind == "nonneg":  # second-moment-like: non-negative, many decades
        x = (torch.randn(n) * 1e-3).square() * torch.rand(n)
    else:  # k > 1: range smaller than FP8's
        x = 1 + torch.rand(n)
    qt = expand_quantize(x, fmt, 256)
    assert qt.k.shape == (9,) and qt.scale.shape == (9,)
    if kind == "narrow":
        assert (qt.k.float() > 1).all()
    check_expansion_roundtrip(x, qt, fmt)


def test_expansion_reduces_error_when_range_is_narrow():
    x = 1 + torch.rand(64, 128)
    err = lambda qt: (qt.dequantize() - x).square().mean() / x.square().mean()
    assert err(expand_quantize(x)) < err(quantize_per_group(x)) / 10


def test_rows_with_tails():
    x = torch.randn(3, 5, 300) * torch.rand(3, 5, 300).pow(4)
    qt = expand_quantize(x, "e4m3", 128)
    assert qt.scale.shape == (3, 5, 3) and qt.k.shape == (3, 5, 3)
    check_expansion_roundtrip(x, qt, E4M3)


def test_degenerate_groups_and_nonfinite():
    x = torch.rand(5, 128) + 0.5
    x[0] = 0  # all zero
    x[1] = torch.where(torch.rand(128) > 0.5, 0.25, -0.25)  # one distinct magnitude: k = 1
    x[2, 7] = float("nan")
    x[3, 9] = float("inf")
    qt = expand_quantize(x, "e4m3", 128)
    assert qt.k[0].item() == 1 and qt.k[1].item() == 1 and qt.k[2].item() == 1 and qt.k[3].item() == 1
    assert qt.scale[0] == 0
    xh = qt.dequantize()
    assert (xh[0] == 0).all() and torch.equal(xh[1], x[1])
    assert torch.isnan(xh[2]).all() and torch.isnan(xh[3]).all() and qt.nonfinite_groups().item() == 2
    assert torch.equal(xh[4], expand_quantize(x[4:], "e4m3", 128).dequantize()[0])  # unaffected


def test_bf16_input_and_k_is_what_dequantize_uses():
    x = (torch.randn(4, 256) * torch.rand(4, 256).pow(4)).to(torch.bfloat16)
    qt = expand_quantize(x)
    assert qt.dequantize().dtype == torch.bfloat16
    check_expansion_roundtrip(x.float(), qt, E4M3)


def test_subnormal_amax_group_stays_finite():
    """1 / amax overflows float32 for amax < 2^-128; such a group is scaled as if amax were 2^-126."""
    x = torch.tensor([3e-40, 1e-40, -2e-40, 0.0] * 32)
    qt = expand_quantize(x, "e4m3", 128)
    xh = qt.dequantize()
    assert torch.isfinite(qt.scale).all() and torch.isfinite(xh).all()
    assert (xh[3::4] == 0).all() and (torch.sign(xh) == torch.sign(x)).all()
    # k = 1 and the group spans 3e-40 * 2^126 * 448 ~ 11.7 of the E4M3 range: a few codes of relative precision
    assert qt.k.float().item() == 1.0 and ((xh - x).abs() <= 0.1 * x.abs()).all()
