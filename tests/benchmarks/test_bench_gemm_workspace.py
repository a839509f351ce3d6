"""bench_gemm_workspace.py: the layer's GEMM shapes, and one clear line without a GPU."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gemm_workspace.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line():
    proc = subprocess.run([sys.executable, SCRIPT, "--out", os.devnull], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip() == ("bench_gemm_workspace.py needs a CUDA GPU (it times cuBLASLt's FP8 GEMMs in a "
                                   "CUDA graph)")
