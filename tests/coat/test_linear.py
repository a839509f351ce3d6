"""FP8 linear: numerics against fp32, FP8-only saved tensors, the weight cache, and the shape rules."""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ops.fp8_compare import DEV, rel_err  # noqa: I001
from megacoat.ops.formats import E4M3, E5M2
from megacoat.ops.fp8_gemm import gemm_op
from megacoat.coat.linear import (Fp8InputCache, Fp8Linear, Fp8WeightCache, fp8_linear,
                                 invalidate_fp8_weight_caches)
from tests.coat.saved_memory import saved_activation_bytes

U4, U5 = E4M3.unit_roundoff, E5M2.unit_roundoff


def _case(m=64, k=96, n=48, dtype=torch.bfloat16):
    x = torch.randn(m, k, device=DEV, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(n, k, device=DEV, dtype=dtype) * 0.05)
    return x, w


@pytest.mark.parametrize("grad_dtype,u_grad", [("e5m2", U5), ("e4m3", U4)])
def test_against_fp32_linear(grad_dtype, u_grad):
    x, w = _case()
    y = fp8_linear(x, w, grad_dtype=grad_dtype)
    dy = torch.randn_like(y)
    y.backward(dy)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yf = xf @ wf.t()
    yf.backward(dy.float())
    # forward: x and W each cast once to E4M3; backward: the output gradient once more in grad_dtype
    assert rel_err(y, yf) <= 2 * U4
    assert rel_err(x.grad, xf.grad) <= U4 + u_grad
    assert rel_err(w.grad, wf.grad) <= U4 + u_grad
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_frozen_weight_or_input_without_grad_get_the_other_gradient_only():
    x, w = _case()
    xf, wf = x.detach().float(), w.detach().float()
    dy = torch.randn(x.shape[0], w.shape[0], device=DEV, dtype=x.dtype)
    w.requires_grad_(False)  # no wgrad: no x^T saved, no g^T written
    total, by_dtype = saved_activation_bytes(lambda: fp8_linear(x, w), [w])
    assert "float8_e4m3fn" not in by_dtype
    fp8_linear(x, w).backward(dy)
    assert w.grad is None and rel_err(x.grad, dy.float() @ wf) <= U4 + U5
    w.requires_grad_(True)
    fp8_linear(x.detach(), w).backward(dy)  # no dgrad: no g written
    assert rel_err(w.grad, dy.float().t() @ xf) <= U4 + U5


def test_saves_only_fp8_activations():
    x, w = _case()
    total, by_dtype = saved_activation_bytes(lambda: fp8_linear(x, w), [w])
    assert set(by_dtype) <= {"float8_e4m3fn", "float32"}
    assert by_dtype["float8_e4m3fn"] == x.numel()  # the input, one byte per element, nothing in BF16
    assert by_dtype.get("float32", 0) <= 16  # its scale


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_saved_input_remakes_the_wgrad_operand_bit_for_bit(delayed, kernels, device):
    """save_input (wo's: attention saves its output anyway) keeps x for backward instead of its FP8 transpose, and
    casts x again there with the forward's scale: the same codes, so the output and both gradients equal those of
    the path that keeps the FP8 copy, bit for bit; and the linear saves x itself (its producer's storage), no FP8."""
    from megacoat.coat.delayed_scaling import DelayedScale
    from megacoat.ops.cast_transpose import _cast_transpose_kernel
    from tests.coat.flow_paths import triton_paths
    from tests.ops.fp8_compare import interpreted

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if kernels == "triton" and device == "cpu" and not interpreted(_cast_transpose_kernel):
        pytest.skip("the Triton path on CPU needs TRITON_INTERPRET=1")
    x, w = (t.to(device) for t in _case())
    dy = torch.randn(x.shape[0], w.shape[0], device=device, dtype=x.dtype)
    results = []
    for save_input in (False, True):
        scale = DelayedScale(4).to(device) if delayed else None
        xi, wi = x.detach().clone().requires_grad_(), torch.nn.Parameter(w.detach().clone())
        with triton_paths() if kernels == "triton" else contextlib.nullcontext():
            for _ in range(2):  # delayed: the bootstrap call, then the history's scale
                xi.grad = wi.grad = None
                y = fp8_linear(xi, wi, input_scale=scale, save_input=save_input)
                y.backward(dy)
            _, by_dtype = saved_activation_bytes(lambda: fp8_linear(xi, wi, input_scale=scale, save_input=save_input),
                                                 [wi])
        results.append((y.detach(), xi.grad, wi.grad))
        if save_input:
            assert set(by_dtype) <= {"bfloat16", "float32"} and by_dtype["bfloat16"] == 2 * x.numel()
        else:
            assert by_dtype["float8_e4m3fn"] == x.numel() and "bfloat16" not in by_dtype
    for kept, remade in zip(*results):
        assert torch.equal(kept, remade)


def test_save_input_and_a_shared_input_cache_are_refused():
    x, w = _case()
    with pytest.raises(ValueError, match="save_input keeps x"):
        fp8_linear(x, w, input_cache=Fp8InputCache(), save_input=True)


def test_weight_cache_reused_across_micro_batches_and_rebuilt_after_step():
    lin = Fp8Linear(torch.nn.Linear(32, 16, bias=False).to(DEV))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for _ in range(3):  # gradient accumulation: three micro-batches, one FP8 copy of the weight
        lin(torch.randn(16, 32, device=DEV)).sum().backward()
    assert lin.fp8_cache.builds == 1
    opt.step()  # in-place update bumps the version counter
    before = lin.fp8_cache.w8.clone()
    lin(torch.randn(16, 32, device=DEV))
    assert lin.fp8_cache.builds == 2 and not torch.equal(before, lin.fp8_cache.w8)


def test_data_writes_need_the_explicit_invalidation():
    lin = Fp8Linear(torch.nn.Linear(32, 16, bias=False).to(DEV))
    x = torch.randn(16, 32, device=DEV)
    lin(x)
    lin.weight.data.mul_(2.0)  # what DeepSpeed does: the version counter does not move
    lin(x)
    assert lin.fp8_cache.builds == 1
    invalidate_fp8_weight_caches()
    y = lin(x)
    assert lin.fp8_cache.builds == 2
    assert rel_err(y, x @ lin.weight.detach().t()) <= 2 * U4


def test_fp8_linear_shares_the_parameter():
    base = torch.nn.Linear(32, 16, bias=False)
    lin = Fp8Linear(base)
    assert lin.weight is base.weight and [n for n, _ in lin.named_parameters()] == ["weight"]


def test_shapes_that_break_the_gemm_rules_are_named():
    with pytest.raises(ValueError, match="in_features"):
        Fp8Linear(torch.nn.Linear(24, 16, bias=False))
    with pytest.raises(ValueError, match="bias"):
        Fp8Linear(torch.nn.Linear(32, 16))
    x, w = _case(m=20)
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        fp8_linear(x, w)
    with torch.no_grad():  # inference has no wgrad, so any token count works
        assert fp8_linear(x, w).shape == (20, 48)


def test_cache_concatenates_weights():
    a, b = torch.randn(16, 32), torch.randn(32, 32)
    w8, w8t, scale = Fp8WeightCache().get((a, b))
    assert w8.shape == (48, 32) and w8t.shape == (32, 48)
    assert rel_err(w8.float() * scale, torch.cat((a, b))) <= U4


def _siblings(shared):
    torch.manual_seed(1)
    cache = Fp8InputCache() if shared else None
    return [Fp8Linear(torch.nn.Linear(64, n, bias=False).to(DEV).bfloat16(), input_cache=cache)
            for n in (32, 48, 16)]


def test_siblings_share_one_fp8_input_and_get_the_same_gradients():
    """wq/wk/wv read one x: quantized once, its FP8 transpose saved once, results unchanged."""
    grads, saved = {}, {}
    for shared in (False, True):
        lins = _siblings(shared)
        x = torch.randn(2, 16, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        params = [lin.weight for lin in lins]
        saved[shared], _ = saved_activation_bytes(lambda: sum(lin(x).sum() for lin in lins), params)
        sum(lin(x).float().square().sum() for lin in lins).backward()
        grads[shared] = [x.grad] + [p.grad for p in params]
        if shared:
            assert lins[0].input_cache.hits == 5  # 2 siblings in the first forward, all 3 in the second (same x)
    assert saved[False] == 3 * saved[True]
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def test_input_cache_misses_on_another_tensor_or_an_in_place_change_and_lets_go():
    cache = Fp8InputCache()
    x = torch.randn(32, 64, device=DEV)
    first = cache.get(x, transpose=True)
    assert cache.get(x, transpose=True) is first and cache.hits == 1
    assert cache.get(x.clone(), transpose=True) is not first  # equal values, another tensor: no hit
    y = torch.randn(32, 64, device=DEV)
    before = cache.get(y, transpose=False)
    assert cache.get(y, transpose=True) is not before  # the transpose was not made: made now
    y.mul_(2)
    assert cache.get(y, transpose=True)[2].item() == 2 * before[2].item()  # version bumped: quantized again
    del y
    assert cache._value is None  # the FP8 copies die with their input


def test_input_cache_under_inference_mode():
    lins = _siblings(shared=True)
    with torch.inference_mode():
        x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
        assert all(lin(x).shape == (16, lin.out_features) for lin in lins)


def test_modules_with_a_filled_input_cache_copy_and_pickle():
    import copy
    import io

    lins = _siblings(shared=True)
    x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    lins[0](x)
    assert lins[0].input_cache._value is not None
    clone = copy.deepcopy(torch.nn.ModuleList(lins))
    assert clone[0].input_cache is clone[1].input_cache and clone[0].input_cache._value is None
    torch.save(torch.nn.ModuleList(lins), io.BytesIO())


@pytest.mark.gpu
def test_gpu_large_linear():
    x, w = _case(4096, 4096, 11008)
    y = fp8_linear(x, w)
    y.backward(torch.randn_like(y))
    assert rel_err(y, x.detach().float() @ w.detach().float().t()) <= 2 * U4


GEMM = gemm_op("cpu")  # the FP8 GEMM operator on the CPU, where these blocks run


class ScaledMMRecorder(TorchDispatchMode):
    """use_fast_accum of every FP8 GEMM that runs while active."""

    def __init__(self):
        super().__init__()
        self.fast_accum = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is GEMM:
            self.fast_accum.append(_use_fast_accum(args, kwargs))
        return func(*args, **(kwargs or {}))


def _use_fast_accum(args, kwargs) -> bool:
    names = [a.name for a in GEMM._schema.arguments]
    return dict(zip(names, args), **(kwargs or {})).get("use_fast_accum", False)


def _graph_fast_accum(gm) -> list[bool]:
    return [_use_fast_accum(n.args, n.kwargs) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is GEMM]


# coat: forward [q|k] and v (two GEMMs over the joined weight), wo, w1|w3, w2; backward the joined [q|k|v] and each
# of the other three, dgrad and wgrad
@pytest.mark.parametrize("mode, forward_gemms, backward_gemms", [("fp8-linear", 7, 14), ("coat", 5, 8)])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fast_accum_reaches_the_forward_gemms_only(mode, forward_gemms, backward_gemms, fast_accum):
    """FP8Config.fast_accum sets use_fast_accum on each forward GEMM of a block and on none of its backward
    GEMMs, eager and in the graphs torch.compile traces (the flag is a constant there)."""
    from torch._dynamo.backends.common import aot_autograd

    from tests.coat.recipes import recipe_of
    from megacoat.coat.convert import convert_to_coat
    from megacoat.model.config import ModelConfig
    from megacoat.model.gpt import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
                      vocab_size=256)
    model = convert_to_coat(GPT(cfg), recipe_of(mode=mode, group_size=32, fast_accum=fast_accum))
    block, (cos, sin) = model.layers[0], model._rope(torch.device("cpu"))
    x = torch.randn(2, 32, 64, requires_grad=True)
    with ScaledMMRecorder() as fwd:
        y = block(x, cos, sin)
    with ScaledMMRecorder() as bwd:
        y.sum().backward()
    assert fwd.fast_accum == [fast_accum] * forward_gemms
    assert bwd.fast_accum == [False] * backward_gemms

    graphs = []

    def keep(gm, _):
        graphs.append(_graph_fast_accum(gm))
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(x, cos, sin).sum().backward()
    assert graphs == [[fast_accum] * forward_gemms, [False] * backward_gemms]
