"""The fused CoatAdamW step on bf16 parameters with fp32-master remainders against the same step on the fp32 master:
bit for bit, in the torch reference (CPU) and in the CUDA kernel (GPU), over several steps. Both runs see the same
gradients and start from the same master; the moments' arithmetic does not depend on how the master is stored, so
every FP8 code, scale and exponent must agree too."""
import pytest
import torch

from megacoat.ops.coat_adamw import coat_adamw_step
from megacoat.ops.coat_adamw_ref import quantize_moment_ref
from megacoat.ops.param_remainder import join_fp32, split_fp32

HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, group_size=128, expand=True)
SIZES = (4096 * 3 + 37, 1000, 128, 5)  # whole chunks, a ragged tail, one group, less than a vector


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def fresh_state(sizes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    master = [(torch.randn(n, generator=g) * 0.02).to(device) for n in sizes]
    state = [[] for _ in range(6)]
    for n in sizes:
        for j in range(2):
            x = torch.randn(n, generator=g) * (1e-3 if j == 0 else 1e-6)
            q, s, k, _ = quantize_moment_ref(x.abs() if j else x, torch.float8_e4m3fn, 128, True)
            for c, t in enumerate((q, s, k)):
                state[3 * j + c].append(t.to(device))
    return master, state


def grads_for(step, sizes, device, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(n, generator=g) * 10 ** torch.empty(n).uniform_(-6, -1, generator=g)).to(device, dtype)
            for n in sizes]


def run_both(backend, device, grad_dtype, steps=6):
    master, state_a = fresh_state(SIZES, device)
    state_b = [[t.clone() for t in col] for col in state_a]
    halves = [split_fp32(m) for m in master]
    params_b = [h[0].clone() for h in halves]
    rems = [h[1].clone() for h in halves]
    for t in range(1, steps + 1):
        grads = grads_for(t, SIZES, device, grad_dtype)
        coat_adamw_step(master, grads, *state_a, step=t, backend=backend, **HP)
        coat_adamw_step(params_b, grads, *state_b, step=t, backend=backend, remainders=rems, **HP)
        for m, p, r in zip(master, params_b, rems):
            assert torch.equal(join_fp32(p, r).view(torch.int32), m.view(torch.int32)), f"master differs at step {t}"
            assert torch.equal(p.view(torch.int16), split_fp32(m)[0].view(torch.int16))
    for col_a, col_b in zip(state_a, state_b):
        for a, b in zip(col_a, col_b):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    moved = sum(int((p.float() != h[0].float()).sum()) for p, h in zip(params_b, halves))
    assert moved > 0.5 * sum(SIZES)  # the steps really moved the bf16 weights


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_reference_with_remainders_is_the_fp32_master_step_bitwise(grad_dtype):
    run_both("torch", "cpu", grad_dtype)


def test_remainders_are_checked():
    master, state = fresh_state((300,), "cpu")
    p, r = split_fp32(master[0])
    g = [torch.zeros(300)]
    with pytest.raises(TypeError, match="bfloat16"):
        coat_adamw_step(master, g, *state, step=1, backend="torch", remainders=[r], **HP)
    with pytest.raises(ValueError, match="int16"):
        coat_adamw_step([p], g, *state, step=1, backend="torch", remainders=[r[:10]], **HP)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_gpu_cuda_kernel_with_remainders_is_the_fp32_master_kernel_bitwise(grad_dtype):
    """The v3 kernel's REM instantiation against its fp32-parameter instantiation: the same update expression (one
    explicit FMA), so the master must agree bit for bit."""
    run_both("cuda", "cuda", grad_dtype)
