"""Per-tensor / per-group FP8 quantization references: error bounds, tails, shapes, edge cases."""
import pytest
import torch

from megacoat.fp8 import E4M3, E5M2, GROUP_SIZES, dequantize, quantize_per_group, quantize_per_tensor
from tests.fp8.bounds import check_group_roundtrip, per_elem


def _wide(shape, dtype=torch.float32):
    """Signed values over ~6 decades, so every group reaches FP8's subnormal range too."""
    return (torch.randn(shape) * torch.rand(shape).pow(4) * 10).to(dtype)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape,group_size", [((4, 256), 128), ((3, 300), 128), ((1000,), 128), ((2, 3, 130), 64),
                                              ((7, 50), 16), ((5, 96), 32), ((2, 700), 256)])
def test_per_group_error_bound(fmt, shape, group_size):
    x = _wide(shape)
    qt = quantize_per_group(x, fmt, group_size)
    assert qt.data.dtype == fmt.dtype and qt.scale.shape == (*shape[:-1], -(-shape[-1] // group_size))
    xg = x.reshape(-1, shape[-1])
    for r in range(xg.shape[0]):  # every group's scale maps its amax onto F.max exactly
        for g in range(qt.scale.shape[-1]):
            amax = xg[r, g * group_size:(g + 1) * group_size].abs().max()
            scale = qt.scale.reshape(-1, qt.scale.shape[-1])[r, g].item()
            assert scale == pytest.approx(amax.item() / fmt.max, rel=1e-6)
    check_group_roundtrip(x, dequantize(qt), per_elem(qt.scale, x.shape, group_size), fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    x = _wide((4, 384), dtype)
    qt = quantize_per_group(x)
    assert qt.dequantize().dtype == dtype
    check_group_roundtrip(x.float(), qt.dequantize(torch.float32), per_elem(qt.scale, x.shape, 128), E4M3)


def test_per_group_amax_maps_to_fp8_max_with_rne():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0 * (1 + 2 ** -5)]])  # 4*(1+2^-5)*448/amax = 448, exact
    qt = quantize_per_group(x, "e4m3", 16)
    assert qt.data.float().abs().max() == E4M3.max
    # Ties round to even: 448 * 9/16 / 2^-5... pick a value halfway between two E4M3 neighbours.
    y = torch.tensor([448.0, 17.0])  # 17 lies halfway between 16 and 18 (spacing 2 in [16, 32)): even -> 16
    assert quantize_per_group(y, "e4m3", 16).data.float()[1] == 16.0


def test_all_zero_group_and_nonfinite_groups():
    x = torch.randn(4, 256)
    x[0, :128] = 0
    x[1, 5] = float("nan")
    x[2, 200] = float("-inf")
    qt = quantize_per_group(x, "e4m3", 128)
    assert qt.scale[0, 0] == 0 and (qt.data[0, :128].float() == 0).all()
    assert qt.nonfinite_groups().item() == 2
    xhat = qt.dequantize()
    assert (xhat[0, :128] == 0).all()
    assert torch.isnan(xhat[1, :128]).all() and torch.isnan(xhat[2, 128:]).all()
    untouched = torch.ones(4, 256, dtype=torch.bool)
    untouched[1, :128] = untouched[2, 128:] = untouched[0, :128] = False
    assert torch.isfinite(xhat[untouched]).all()
    ref = quantize_per_group(x[3:], "e4m3", 128).dequantize()  # other groups exactly as without the bad ones
    assert torch.equal(xhat[3:], ref)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_flat_buffers_of_any_length(group_size):
    for n in (1, group_size - 1, group_size + 1, 5 * group_size + 3):
        x = _wide((n,))
        qt = quantize_per_group(x, "e4m3", group_size)
        assert qt.scale.shape == (-(-n // group_size),)
        check_group_roundtrip(x, qt.dequantize(), per_elem(qt.scale, x.shape, group_size), E4M3)


def test_empty_and_scalar():
    for shape in [(0, 128), (3, 0), (0,)]:
        qt = quantize_per_group(torch.randn(shape))
        assert qt.dequantize().shape == shape
    qt = quantize_per_group(torch.tensor(3.0))
    assert qt.dequantize().item() == pytest.approx(3.0)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_per_tensor_error_bound(fmt):
    x = _wide((8, 333)) * 0.01  # narrow values: the bound is relative to the tensor's scale
    qt = quantize_per_tensor(x, fmt)
    assert qt.scale.item() == pytest.approx(x.abs().max().item() / fmt.max, rel=1e-6)
    check_group_roundtrip(x, qt.dequantize(), qt.scale.expand_as(x), fmt)


def test_per_tensor_edge_cases():
    assert quantize_per_tensor(torch.zeros(10)).dequantize().eq(0).all()
    x = torch.randn(100)
    x[3] = float("inf")
    qt = quantize_per_tensor(x)
    assert torch.isnan(qt.dequantize()).all() and qt.nonfinite_groups().item() == 1
    # A given amax below max|x| saturates (documented), never overflows to NaN.
    y = torch.tensor([1.0, 10.0])
    out = quantize_per_tensor(y, "e4m3", amax=torch.tensor(1.0)).dequantize()
    assert out.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="one-element float32"):
        quantize_per_tensor(y, amax=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize(y)
    with pytest.raises(ValueError, match="backend must be"):
        quantize_per_tensor(y, backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        quantize_per_group(torch.randn(8), backend="triton")


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_tiny_amax_does_not_overflow_the_multiplier(fmt):
    """amax below F.max / FLT_MAX (~1.3e-36 for E4M3): F.max / amax overflowed to inf, every non-zero x became
    F.max and every zero NaN. Now amax is raised to amax_floor: values survive with FP8's relative precision
    (the grid is finer than at the floor's full range, so still within u of the nearest FP8 step near x)."""
    from megacoat.fp8.quantize import amax_floor

    floor = amax_floor(fmt)
    assert fmt.max / floor < torch.finfo(torch.float32).max and floor * 2 > fmt.max / torch.finfo(torch.float32).max
    for tiny in (1e-37, 1e-38, 1e-40):  # normal, normal, subnormal float32
        x = torch.tensor([3 * tiny, tiny, -tiny, 0.0, 2 * tiny])
        for qt in (quantize_per_group(x, fmt, 16), quantize_per_tensor(x, fmt)):
            xh = qt.dequantize()
            assert torch.isfinite(xh).all() and xh[3] == 0 and (torch.sign(xh) == torch.sign(x)).all()
            ok = (xh - x).abs() <= 2 * fmt.unit_roundoff * x.abs() + fmt.min_subnormal * qt.scale.max()
            assert ok.all(), (tiny, xh, x)
