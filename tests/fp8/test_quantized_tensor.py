"""QuantizedTensor: validation, sizes, autograd save/restore, checkpoint round trip."""
import io

import pytest
import torch

from megacoat.fp8 import QuantizedTensor, expand_quantize, quantize_per_group, quantize_per_tensor


def test_nbytes_and_metadata():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    qt = quantize_per_group(x, "e4m3", 128)
    assert qt.shape == x.shape and qt.dtype == torch.bfloat16 and qt.fp8_dtype == torch.float8_e4m3fn
    assert qt.device == x.device and qt.numel() == x.numel() and not qt.expanded
    assert qt.scale.shape == (4, 2)
    assert qt.nbytes == 4 * 256 + 4 * 2 * 4
    qe = expand_quantize(torch.randn(1000), "e5m2", 128)  # 8 groups, last one 104 long
    assert qe.nbytes == 1000 + 8 * 4 + 8 * 2 and qe.expanded
    # The moment-storage contract: 1 + (4 + 2) / G bytes per element.
    assert expand_quantize(torch.randn(128 * 64)).nbytes / (128 * 64) == pytest.approx(1 + 6 / 128)
    pt = quantize_per_tensor(x)
    assert pt.scale.dim() == 0 and pt.nbytes == x.numel() + 4


def test_dequantize_default_dtype():
    x = torch.randn(3, 130, dtype=torch.bfloat16)
    assert quantize_per_group(x).dequantize().dtype == torch.bfloat16
    assert quantize_per_group(x).dequantize(torch.float32).dtype == torch.float32


def test_validation_errors():
    q = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="FP8"):
        QuantizedTensor(torch.zeros(4, 256), torch.ones(4, 2), 128, torch.float32)
    with pytest.raises(TypeError, match="float32"):
        QuantizedTensor(q, torch.ones(4, 2, dtype=torch.bfloat16), 128, torch.float32)
    with pytest.raises(ValueError, match="scale shape"):
        QuantizedTensor(q, torch.ones(4, 3), 128, torch.float32)
    with pytest.raises(ValueError, match="group size"):
        QuantizedTensor(q, torch.ones(4, 3), 100, torch.float32)
    with pytest.raises(ValueError, match="one scale"):
        QuantizedTensor(q, torch.ones(2), None, torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        QuantizedTensor(q, torch.ones(4, 2), 128, torch.float32, k=torch.ones(4, 2))
    with pytest.raises(ValueError, match="group size"):
        quantize_per_group(torch.randn(8), group_size=48)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize_per_group(torch.arange(8))
    with pytest.raises(ValueError, match="unknown FP8 format"):
        quantize_per_group(torch.randn(8), "e3m4")


class _SaveQuantized(torch.autograd.Function):
    """The pattern the FP8 activation code uses: save FP8, rebuild in backward."""

    @staticmethod
    def forward(ctx, x):
        qt = expand_quantize(x, "e4m3", 32)
        ctx.save_for_backward(*qt.tensors())
        ctx.qmeta = qt.meta()
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        qt = QuantizedTensor.from_tensors(ctx.saved_tensors, ctx.qmeta)
        return grad * qt.dequantize()


def test_autograd_save_and_restore():
    x = torch.randn(4, 96, requires_grad=True)
    _SaveQuantized.apply(x).sum().backward()
    expected = expand_quantize(x.detach(), "e4m3", 32).dequantize()
    assert torch.equal(x.grad, expected)
    # Per-tensor (k None, group None) goes through save_for_backward too.
    qt = quantize_per_tensor(torch.randn(10))
    assert QuantizedTensor.from_tensors(qt.tensors(), qt.meta()).group_size is None


@pytest.mark.parametrize("make", [lambda x: quantize_per_tensor(x, "e5m2"), lambda x: quantize_per_group(x),
                                  lambda x: expand_quantize(x, "e4m3", 64)])
def test_checkpoint_round_trip(make):
    qt = make(torch.randn(3, 200, dtype=torch.bfloat16))
    buf = io.BytesIO()
    torch.save({"m": qt.to_dict()}, buf)
    buf.seek(0)
    back = QuantizedTensor.from_dict(torch.load(buf, weights_only=True)["m"])
    assert back.orig_dtype == torch.bfloat16 and back.group_size == qt.group_size
    assert torch.equal(back.dequantize(), qt.dequantize())
    with pytest.raises(ValueError, match="orig_dtype"):
        QuantizedTensor.from_dict({**qt.to_dict(), "orig_dtype": "float99"})
