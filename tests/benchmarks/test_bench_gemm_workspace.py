"""benchmarks/kernels/gemm_workspace.py: one clear line without a GPU."""
import pytest
import torch

from tests.benchmarks.conftest import run_module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line():
    proc = run_module("benchmarks.kernels.gemm_workspace", "--out", "/dev/null", timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip() == ("error: benchmarks.kernels.gemm_workspace needs a CUDA GPU (it times cuBLASLt's "
                                   "FP8 GEMMs in a CUDA graph)")
