"""Every Triton kernel of the FP8 flow compiles for the H100 (sm_90), on a machine without a GPU.

The CPU tests run the kernels under Triton's interpreter, which executes their Python and accepts code the compiler
rejects (a branch whose results differ in type, a mask typed as an integer, an unsupported reshape). Here each
kernel goes through Triton's real compiler down to an sm_90 cubin, launched by its own wrapper with the wrapper's
arguments and constants (production shapes' code paths: FP8 formats, both layouts, the fast math of the GPU path),
through a driver that only compiles (`warmup`). A pass does not prove the kernel right: the interpreter tests and
the GPU tests do that; it proves the GPU build will not stop at compilation. The local Triton may be newer than
the device's.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMPILE_ALL = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, and the kernels' GPU code paths (numerics.FAST)
import torch
import triton
from triton.backends.compiler import GPUTarget


class CompileOnlyDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


triton.runtime.driver.set_active(CompileOnlyDriver())
from megacoat.ops import cast_transpose as C, rmsnorm as R, rope, rope_grad_cast as G, swiglu as S, tensor_scale as T

compiled = set()


class CompileOnly:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel.warmup(*args, grid=grid, **kwargs)
            compiled.add(f"{self.kernel.__module__.rsplit('.', 1)[-1]}.{self.kernel.__name__}")
        return launch


for module in (C, R, rope, G, S, T):
    module.launcher = CompileOnly

bf, e4, e5, g = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, 128
m, h, f = 256, 256, 384
x, w = torch.randn(m, h, dtype=bf), torch.ones(h, dtype=bf)
for fmt in (e4, e5):
    for rowwise, transpose in ((True, True), (True, False), (False, True)):
        C.quantize_transpose_triton(x, fmt, rowwise, transpose)
        C.cast_transpose_delayed_triton(x, torch.ones(4), fmt, rowwise, transpose)  # the history's scale, x's amax
C.cast_transpose_triton(x, torch.ones(1), e4, False, True)  # a given scale, x^T only: wo's wgrad operand remade
C.quantize_transpose_into_triton([x[:128], x[128:]], torch.empty(m, h, dtype=e4), torch.empty(h, m, dtype=e4),
                                 torch.empty(1))
x8, xs, rstd, ys, _ = R.rmsnorm_fp8_fwd_triton(x, w, 1e-5, g)  # both launches (the second from the amax)
for transpose in (False, True):
    R.rmsnorm_fp8_out_triton(x8, xs, rstd, w, ys, g, transpose)
R.rmsnorm_fp8_bwd_triton(torch.randn(m, h, dtype=bf), x8, xs, rstd, w, g)
R.rmsnorm_fp8_bwd_triton(torch.randn(m, h, dtype=bf), x8, xs, rstd, w, g, torch.randn(m, h, dtype=bf))  # + residual
R.rmsnorm_fp8_fwd_delayed_triton(x, w, torch.ones(4), 1e-5, g)  # the one-launch variant
R.rmsnorm_fp8_fwd_triton(x, w, 1e-5, g, add=x)  # the residual addition in the first launch
R.rmsnorm_fp8_fwd_delayed_triton(x, w, torch.ones(4), 1e-5, g, add=x)
a1, s1, a3, s3, ss, _ = S.swiglu_fp8_fwd_triton(torch.randn(m, 2 * f, dtype=bf), g)  # both launches
S.swiglu_fp8_fwd_delayed_triton(torch.randn(m, 2 * f, dtype=bf), torch.ones(4), g)  # one launch
for transpose in (False, True):
    S.swiglu_fp8_out_triton(a1, s1, a3, s3, ss, g, transpose)
ds = torch.randn(m, f, dtype=bf)
for fmt in (e4, e5):
    S.swiglu_fp8_bwd_triton(ds, a1, s1, a3, s3, g, fmt)
    S.swiglu_fp8_bwd_out_t_triton(ds, a1, s1, a3, s3, ss, g, fmt)
    S.swiglu_fp8_bwd_delayed_triton(ds, a1, s1, a3, s3, ss, torch.ones(4), g, fmt)  # the one-pass variant
dq = torch.randn(2, 4, 128, 128, dtype=bf).transpose(1, 2)  # [b, s, heads, d] as attention's backward leaves it
cos, sin = torch.randn(128, 64), torch.randn(128, 64)
rope.rope_triton(dq, cos, sin)
for fmt in (e4, e5):
    G.rope_qkv_grad_fp8_triton(dq, dq[:, :, :2], dq[:, :, :2], cos, sin, fmt)
    # delayed scaling: RoPE's kernel casting with the history's scale, then the byte transpose
    G.rope_qkv_grad_fp8_delayed_triton(dq, dq[:, :, :2], dq[:, :, :2], cos, sin, fmt, torch.ones(4))
R.rmsnorm_fp8_bwd_triton(torch.randn(m, h, dtype=bf), x8, xs, rstd, w, g, torch.randn(m, h, dtype=bf),
                         dx_amax=True)  # + dx's amax (wo's carrier)
print("compiled:", " ".join(sorted(compiled)))
"""

KERNELS = {"cast_transpose._cast_transpose_kernel", "cast_transpose._amax_kernel", "rmsnorm._fwd_kernel",
           "rmsnorm._out_kernel", "rmsnorm._bwd_kernel", "rmsnorm._column_sum_kernel", "swiglu._fwd_kernel",
           "swiglu._out_kernel", "swiglu._bwd_amax_kernel", "swiglu._bwd_cast_kernel", "rope._rope_kernel",
           "tensor_scale._roll_kernel", "cast_transpose._transpose_bytes_kernel"}


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend cannot build for sm_90")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", COMPILE_ALL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = set(proc.stdout.split("compiled:")[-1].split())
    assert compiled == KERNELS, (compiled ^ KERNELS)
