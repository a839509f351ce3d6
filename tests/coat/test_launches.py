"""Launch budget of one layer: what the FP8 modes launch besides the model's own ops.

At micro-batch 1 a Llama-2-7B layer's step is short enough for the host's launch time to bound it (the old
fp8-linear, with an 8-launch amax+cast per GEMM operand, ran slower than bf16 there). Counted on CPU with the
FP8 flow on its Triton kernels (interpreter), as it runs on CUDA.
"""
import pytest
import torch

from tests.coat.flow_paths import LaunchCounter, triton_paths  # noqa: I001
from tests.ops.fp8_compare import DEV, interpreted
from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT
from megacoat.ops.cast_transpose import _cast_transpose_kernel


def _launches(mode, weight_cache="step"):
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, vocab_size=128, hidden_size=128, ffn_hidden_size=256, num_attention_heads=2,
                      seq_length=32)
    model = convert_to_coat(GPT(cfg).bfloat16(), recipe_of(mode=mode, group_size=64, weight_cache=weight_cache))
    layer, (cos, sin) = model.layers[0], model._rope(torch.device("cpu"))
    x = torch.randn(1, 32, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)  # contiguous, as a real upstream gradient (sum()'s would be an expanded scalar)
    with triton_paths():
        layer(x, cos, sin).backward(dy)  # the weight copies are built once per optimizer step, not counted
        for p in layer.parameters():
            p.grad = None
        with LaunchCounter() as count:
            layer(x, cos, sin).backward(dy)
    return count


def test_fp8_linear_adds_two_launches_per_quantized_operand():
    if DEV != "cpu" or not interpreted(_cast_transpose_kernel):
        pytest.skip("counts the interpreter's launches: CPU with TRITON_INTERPRET=1")
    bf16, fp8 = _launches("bf16"), _launches("fp8-linear")
    # every mm becomes an FP8 GEMM (megacoat::scaled_mm on the CPU); each quantized operand adds an amax and a cast+transpose: the 4 distinct
    # inputs of the 7 linears (wq/wk/wv and w1/w3 share theirs) and the 7 output gradients
    assert fp8.aten["scaled_mm"] == bf16.aten["mm"] == 21
    assert fp8.launches - bf16.launches == 2 * (4 + 7), (dict(fp8.aten), dict(fp8.triton))


def test_row_major_weight_cache_adds_one_transpose_per_dgrad():
    """--fp8-weight-cache rowwise (the default) keeps W8 only: each backward GEMM of the input gradient first
    transposes its bytes, one launch of the byte transpose per linear, nothing else."""
    if DEV != "cpu" or not interpreted(_cast_transpose_kernel):
        pytest.skip("counts the interpreter's launches: CPU with TRITON_INTERPRET=1")
    step, rowwise = _launches("fp8-linear"), _launches("fp8-linear", "rowwise")
    assert rowwise.triton["_transpose_bytes_kernel"] == 7 and "_transpose_bytes_kernel" not in step.triton
    assert rowwise.launches - step.launches == 7, (dict(rowwise.aten), dict(rowwise.triton))
