"""bench_attention_fp8.py: one clear line without a GPU, and no JSON."""
import pytest
import torch

from tests.benchmarks.conftest import run_module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    proc = run_module("benchmarks.kernels.attention_fp8", "--out", str(tmp_path / "attention.json"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: needs a CUDA GPU"
    assert not (tmp_path / "attention.json").exists()
