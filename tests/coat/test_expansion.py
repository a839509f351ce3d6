"""Dynamic range expansion (megacoat.coat.expansion) and group scaling (megacoat.coat.group_scaling)."""
import torch

from megacoat.coat.expansion import dequantize_moment, quantize_moment
from megacoat.coat.group_scaling import group_dequantize, group_quantize


def test_expansion_keeps_a_wide_group_more_exactly_than_group_scaling_alone():
    torch.manual_seed(0)
    x = torch.exp(torch.randn(1024) * 4)  # magnitudes over many octaves, as a second moment has
    errors = {}
    for expand in (False, True):
        q, scale, k, bad = quantize_moment(x, torch.float8_e4m3fn, 128, expand)
        assert bad == 0 and (k == 1).all() != expand
        errors[expand] = ((dequantize_moment(q, scale, k, 128) - x).abs() / x).median()
    assert errors[True] < errors[False] / 2


def test_group_scaling_gives_each_group_its_own_scale():
    x = torch.ones(2, 64)
    x[0, :32] *= 1000  # one loud group does not coarsen its neighbour
    q, scale = group_quantize(x, 32, torch.float8_e4m3fn)
    assert scale.shape == (2, 2) and scale[0, 0] > 100 * scale[0, 1]
    torch.testing.assert_close(group_dequantize(q, scale, 32), x, rtol=2 ** -3, atol=0)
