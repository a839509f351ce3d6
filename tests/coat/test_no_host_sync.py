"""No host sync in a transformer layer's forward + backward in the FP8 modes.

A sync (`.item()`, `float(t)`, `if t:`, `nonzero`, a data-dependent shape) stalls the CPU until the GPU
drains, so the next kernels launch late; at micro-batch 1 a layer is short enough for that to show. Every
such pattern reaches the dispatcher as one of the ops below, so a TorchDispatchMode sees it on CPU, both on
the torch reference path and on the Triton path (run by the interpreter, as on CUDA).
"""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.coat.flow_paths import triton_paths  # noqa: I001
from tests.ops.fp8_compare import DEV
from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT

SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique",
               "_unique", "_unique2", "unique_consecutive", "unique_dim", "allclose"}


class SyncRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCING_OPS:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def _layer(mode):
    cfg = ModelConfig(num_layers=1, vocab_size=128, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                      seq_length=32)
    model = convert_to_coat(GPT(cfg).to(DEV).bfloat16(), recipe_of(mode=mode, group_size=32))
    return model.layers[0], model._rope(torch.device(DEV))


def test_recorder_sees_a_sync():  # the check below can fail
    with SyncRecorder() as rec:
        float(torch.ones(2, device=DEV).sum())
    assert rec.syncs


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("mode", ["fp8-linear", "coat"])
def test_layer_forward_backward_has_no_host_sync(mode, path):
    if path == "triton" and DEV == "cpu":
        from megacoat.ops.cast_transpose import _cast_transpose_kernel
        from tests.ops.fp8_compare import interpreted
        if not interpreted(_cast_transpose_kernel):
            pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    if path == "reference" and DEV == "cuda":
        pytest.skip("on CUDA the flow runs its kernels")
    layer, (cos, sin) = _layer(mode)
    x = torch.randn(1, 32, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    with triton_paths() if path == "triton" else contextlib.nullcontext(), SyncRecorder() as rec:
        layer(x, cos, sin).float().square().sum().backward()  # a first step: it builds the weight copies too
    assert rec.syncs == []


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8-linear", "coat"])
def test_gpu_layer_runs_under_sync_debug_mode_error(mode):
    """On the device, CUDA's own check: any synchronizing call in the step raises."""
    layer, (cos, sin) = _layer(mode)
    x = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x, cos, sin).float().square().sum().backward()  # Triton compiles, weight copies: outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, cos, sin).float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
